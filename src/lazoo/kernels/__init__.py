"""lazoo.kernels: Triton kernels and their ``torch.autograd.Function`` wrappers.

Imported lazily by the ops (only when the Triton backend runs), so that ``import lazoo`` never
defines a Triton kernel: under ``TRITON_INTERPRET=1`` the variable must be set before that.
One module per mechanism family; what several of them use lives in ``_common`` (tile prologues,
chunk maps of packed sequences, operand types, block sizes) and ``_utils`` (the interpreter, the
device, tile sizes; defines no kernel).
"""
