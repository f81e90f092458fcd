"""lazoo.ops: pure tensor functions, one module per mechanism family.

Layout everywhere: q/k ``[B, T, H, dk]``, v ``[B, T, H, dv]``, per-head scalars (gates, beta)
``[B, T, H]``, states ``[B, H, dv, dk]`` (a state of several parts is a dict of tensors), mask
``[B, T]`` (bool, or numbers exactly 0/1; 1 = real token). A pad leaves every part of the state untouched, outputs 0
and gets gradient 0: each op zeroes every per-token input at the pads once, at its boundary, so a NaN or Inf there
never reaches a real token in any backend or kernel; and no op mixes samples, so a non-finite sample changes no
other. Gates are checked at real tokens against their documented range (log decays g <= 0).
Every op takes ``initial_state=None, output_final_state=False, mask=None, backend=None`` and
returns ``(output [B, T, H, dv] in the input dtype, final_state or None)``. States are in the
compute dtype: float64 for float64 inputs, float32 otherwise.
Backends: ``backend=`` or the ``LAZOO_BACKEND`` variable: "recurrent" (step-by-step reference),
"chunk" (chunk-parallel PyTorch), "triton" (lazoo.kernels, where the op has one), None = auto (Triton
on CUDA when it can run the case, else chunk). The ops run with autocast off: they pick their own
compute dtypes (each is defined under ``dtypes.without_autocast``).

The package holds every name of every op module's ``__all__`` and ``BACKENDS``, imported below one module at a time
(a new op module adds its line; ``tests/test_package_imports.py`` checks that none is missing). What the op modules
share holds no op: ``backend`` (backend choice), ``checks`` (argument checks), ``states`` (initial states),
``boundary`` (an op's preamble and result, pads), ``dtypes``, ``chunks``, ``scan``, ``norms`` and ``packing``
(``cu_seqlens``). ``lazoo.ops.<module>`` is the module (``lazoo.ops.linear``) unless an op has its name:
``delta_product``, ``ela``, ``kda``, ``mamba2``, ``rls``, ``titans`` and ``vla`` are the ops, their modules
``sys.modules["lazoo.ops.vla"]`` and so on.
"""

from .backend import BACKENDS
from .bidirectional import bidirectional_linear_attention
from .delta import chunk_generalized_delta, delta_rule, gated_delta_rule
from .delta_product import delta_product
from .ela import ELA_KERNELS, ela, ela_feature_dim, ela_features, ela_kernel
from .kda import chunk_kda, kda
from .linear import FEATURE_MAPS, chunk_gated_linear, chunk_gla, gated_linear_attention, gla, linear_attention
from .local_linear import local_linear_attention
from .mamba2 import mamba2
from .ovq import ovq_attention, ovq_dict_size, vq_attention
from .rls import rls
from .softmax import softmax_attention
from .titans import titans
from .ttt import ttt_linear, ttt_linear_decode_step, ttt_mlp, ttt_mlp_decode_step
from .vla import vla

__all__ = [
    "BACKENDS", "ELA_KERNELS", "FEATURE_MAPS", "bidirectional_linear_attention", "chunk_gated_linear",
    "chunk_generalized_delta", "chunk_gla", "chunk_kda", "delta_product", "delta_rule", "ela", "ela_feature_dim",
    "ela_features", "ela_kernel", "gated_delta_rule", "gated_linear_attention", "gla", "kda", "linear_attention",
    "local_linear_attention", "mamba2", "ovq_attention", "ovq_dict_size", "rls", "softmax_attention", "titans",
    "ttt_linear", "ttt_linear_decode_step", "ttt_mlp", "ttt_mlp_decode_step", "vla", "vq_attention",
]
