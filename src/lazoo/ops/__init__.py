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
compute dtypes (each is defined under ``_common.without_autocast``).

The package holds every name of every op module's ``__all__`` (the modules are found, not listed: a new op module
needs no edit here) and ``BACKENDS``. ``lazoo.ops.<module>`` is the module (``lazoo.ops.linear``) unless an op has
its name: ``delta_product``, ``ela``, ``rls``, ``titans`` and ``vla`` are the ops, their modules
``sys.modules["lazoo.ops.vla"]`` and so on.
"""

from ..registry import import_submodules
from ._common import BACKENDS

_MODULES = import_submodules(__name__, __path__)


def _bind_public_names(modules) -> list[str]:
    """Bind every name of each module's ``__all__`` here; return the names. Two modules must not export one name."""
    owner = {}
    for module in modules:
        for name in module.__all__:
            if name in owner:
                raise ImportError(f"lazoo.ops: {name!r} is exported by both {owner[name]} and {module.__name__}")
            owner[name] = module.__name__
            globals()[name] = getattr(module, name)
    return list(owner)


__all__ = sorted(["BACKENDS", *_bind_public_names(_MODULES)])
