"""adaloss_jax: loss scaling for fp16/fp8 mixed-precision training in JAX."""

from adaloss_jax._adaptive import (
    AdaptiveScale,
    AdaptiveScaleState,
    adaptive,
    adaptive_state,
    adaptive_unscale,
    adaptive_value_and_grad,
    param_groups,
    scale_summary,
    scale_table,
)
from adaloss_jax._check import GradientCheck, check_gradients
from adaloss_jax._checkpoint import load_state, save_state
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
from adaloss_jax._policies import (
    DynamicLossScale,
    LossScalePolicy,
    LossScaleState,
    NoLossScale,
    StaticLossScale,
    dynamic,
    no_scaling,
    static,
)
from adaloss_jax._transforms import (
    SkipNonFiniteState,
    all_finite,
    loss_scaled,
    scale_loss,
    scale_state,
    select_tree,
    skip_nonfinite,
    unscale,
    value_and_grad,
)

__version__ = "0.1.0"

__all__ = [
    "GradientCheck",
    "check_gradients",
    "AdaptiveScale",
    "AdaptiveScaleState",
    "adaptive",
    "adaptive_state",
    "adaptive_unscale",
    "adaptive_value_and_grad",
    "param_groups",
    "scale_summary",
    "scale_table",
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "FLOAT8_E4M3",
    "FLOAT8_E5M2",
    "FORMATS",
    "DynamicLossScale",
    "FloatFormat",
    "LossScalePolicy",
    "LossScaleState",
    "NoLossScale",
    "SkipNonFiniteState",
    "StaticLossScale",
    "all_finite",
    "dynamic",
    "float_format",
    "load_state",
    "loss_scaled",
    "no_scaling",
    "save_state",
    "scale_loss",
    "scale_state",
    "select_tree",
    "skip_nonfinite",
    "static",
    "unscale",
    "value_and_grad",
]
