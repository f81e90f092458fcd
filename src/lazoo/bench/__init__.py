"""lazoo's benchmark harnesses, each run as ``python -m lazoo.bench.<name>`` or ``lazoo bench <name>`` (the same
options, defined in ``lazoo_cli.bench``):

* ``kernels``: every op's Triton kernels against SDPA and fla, with each row's roofline fraction;
* ``vla``, ``ovq``, ``local_linear``, ``ttt``: those ops beside SDPA, Gated DeltaNet and their PyTorch forms;
* ``training``, ``generate``: tokens/s of training and ms per new token of ~125M models beside Llama and fla's;
* ``qwen``, ``mamba2``: models of Qwen3.5-0.8B's and of Bamba's shape converted from transformers' own classes,
  against them (``mamba2`` also times the Mamba-2 op against fla and transformers' PyTorch form);
* ``delta_frontier``: the (gated) delta rule against FlashQLA and fla on a Gated DeltaNet layer's inputs.

Beside them, run with ``python -m``: ``profile_op`` (one op's kernels per forward + backward), ``profile_decode``
(where a compiled decode step's time goes) and ``kernel_resources`` (a Triton kernel's shared memory, registers
and spills on Hopper, compiled without a GPU). The timings need a CUDA GPU; every module imports without one.

What they share: ``timing`` (median ms, forward and forward + backward, time budgets), ``report`` (environment
records, JSON files, table cells), ``inputs`` (the usual op inputs, causal SDPA) and ``models`` (the ~125M models).
"""
