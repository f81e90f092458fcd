"""lazoo.kernels: Triton kernels and their ``torch.autograd.Function`` wrappers.

Imported lazily by the ops (only when the Triton backend runs), so that ``import lazoo`` never
defines a Triton kernel: under ``TRITON_INTERPRET=1`` the variable must be set before that.
"""
