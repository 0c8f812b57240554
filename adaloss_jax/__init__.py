"""adaloss_jax: loss scaling for fp16/fp8 mixed-precision training in JAX."""

from adaloss_jax._adaptive import adaptive_scaled, adaptive_unscale
from adaloss_jax._check import GradientCheck, check_gradients
from adaloss_jax._checkpoint import load_state, save_state
from adaloss_jax._common import LossScaleState, all_finite, select_tree
from adaloss_jax._config import AdaptiveScale, adaptive
from adaloss_jax._diagnostics import check_health, scale_summary, scale_table, status_line
from adaloss_jax._formats import (
    BFLOAT16,
    FLOAT8_E4M3,
    FLOAT8_E5M2,
    FLOAT16,
    FLOAT32,
    FORMATS,
    FloatFormat,
    float_format,
)
from adaloss_jax._grad import adaptive_value_and_grad
from adaloss_jax._groups import param_groups
from adaloss_jax._layout import GroupVector
from adaloss_jax._lookup import scale_state
from adaloss_jax._policies import (
    DynamicLossScale,
    GlobalScaler,
    NoLossScale,
    StaticLossScale,
    dynamic,
    no_scaling,
    static,
)
from adaloss_jax._record import scale_group
from adaloss_jax._skip import SkipNonFiniteState, skip_nonfinite
from adaloss_jax._state import AdaptiveScaleState, ScaleStats
from adaloss_jax._transforms import (
    LossScaleStats,
    loss_scaled,
    scale_loss,
    unscale,
    value_and_grad,
)

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

__all__ = [
    "AdaptiveScale",
    "AdaptiveScaleState",
    "BFLOAT16",
    "DynamicLossScale",
    "FLOAT16",
    "FLOAT32",
    "FLOAT8_E4M3",
    "FLOAT8_E5M2",
    "FORMATS",
    "FloatFormat",
    "GlobalScaler",
    "GradientCheck",
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
    "check_gradients",
    "check_health",
    "dynamic",
    "float_format",
    "load_state",
    "loss_scaled",
    "no_scaling",
    "param_groups",
    "save_state",
    "scale_group",
    "scale_loss",
    "scale_state",
    "scale_summary",
    "scale_table",
    "select_tree",
    "skip_nonfinite",
    "static",
    "status_line",
    "unscale",
    "value_and_grad",
]
