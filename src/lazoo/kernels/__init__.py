"""lazoo.kernels: Triton kernels and their ``torch.autograd.Function`` wrappers.

Imported lazily by the ops (only when the Triton backend runs), so that ``import lazoo`` never
defines a Triton kernel: under ``TRITON_INTERPRET=1`` the variable must be set before that.
One module per mechanism family (VLA's and OVQ's several kernels in the subpackages ``vla`` and ``ovq``), and a few
for the layers around them (``short_conv``, ``rms_norm``, ``gates``: a Gated DeltaNet layer's g and β;
``decode_linear``: a decode step's input products, each set in one launch); what each
takes (head dims, chunk sizes, dtypes) is stated in ``limits``, which imports no Triton. What several of them use:
``_tiles`` (the chunked kernels' tile prologues, state tile loads and stores), ``_chunk_layout`` (the chunks of
packed sequences), ``_launch`` (launch settings, block sizes, operand types), ``_segments`` (state walks in
segments), ``_graphs`` (CUDA graphs), ``_tensor_cache`` (tables kept on the ``cu_seqlens`` they come from) and
``_utils`` (the interpreter, the device, tile sizes; defines no kernel).
"""
