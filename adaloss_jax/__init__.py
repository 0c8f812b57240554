"""adaloss_jax: loss scaling for fp16/fp8 mixed-precision training in JAX."""

from adaloss_jax import _common, checkpoint, diagnostics, formats
from adaloss_jax._adaptive import adaptive_scaled, adaptive_unscale
from adaloss_jax._adaptive_scaler import AdaptiveScale, adaptive
from adaloss_jax._common import LossScaleState, all_finite, select_tree
from adaloss_jax._global_scalers import (
    DynamicLossScale,
    GlobalScaler,
    NoLossScale,
    StaticLossScale,
    dynamic,
    no_scaling,
    static,
)
from adaloss_jax._global_transforms import (
    LossScaleStats,
    loss_scaled,
    scale_loss,
    unscale,
    value_and_grad,
)
from adaloss_jax._grad import adaptive_value_and_grad
from adaloss_jax._groups import param_groups
from adaloss_jax._layout import GroupVector
from adaloss_jax._lookup import scale_state
from adaloss_jax._record import scale_group
from adaloss_jax._skip import SkipNonFiniteState, skip_nonfinite
from adaloss_jax._state import AdaptiveScaleState, ScaleStats

# Front ends register the hooks through which their frameworks report module calls (the
# core imports no framework); linen's is registered here when flax is installed.
try:
    import flax.linen as _linen
except ImportError:  # no flax: nothing to register
    _linen = None
if _linen is not None:  # an error inside the hook itself is raised, not hidden
    import adaloss_jax.flax._linen_hook  # noqa: F401
del _linen

__version__ = "0.2.0"


# Moved into namespaces in 0.3 (CHANGELOG.md lists them): the old top-level names warn
# for one release, then go.
DEPRECATED = {name: space for space, names in (
    ("diagnostics", diagnostics.__all__), ("formats", formats.__all__),
    ("checkpoint", checkpoint.__all__)) for name in names}


def __getattr__(name):
    if name in DEPRECATED:
        space = DEPRECATED[name]
        _common.warn_renamed(f"adaloss_jax.{name}", f"adaloss_jax.{space}.{name}")
        return getattr(globals()[space], name)
    raise AttributeError(f"module 'adaloss_jax' has no attribute {name!r}")


__all__ = [
    "AdaptiveScale",
    "AdaptiveScaleState",
    "DynamicLossScale",
    "GlobalScaler",
    "GroupVector",
    "LossScaleState",
    "LossScaleStats",
    "NoLossScale",
    "ScaleStats",
    "SkipNonFiniteState",
    "StaticLossScale",
    "adaptive",
    "adaptive_scaled",
    "adaptive_unscale",
    "adaptive_value_and_grad",
    "all_finite",
    "checkpoint",
    "diagnostics",
    "dynamic",
    "formats",
    "loss_scaled",
    "no_scaling",
    "param_groups",
    "scale_group",
    "scale_loss",
    "scale_state",
    "select_tree",
    "skip_nonfinite",
    "static",
    "unscale",
    "value_and_grad",
]
