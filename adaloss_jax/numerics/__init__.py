"""Numerics toolkit: underflow/overflow probes and simulated fp8 cotangents.

The quantities measured here are defined in :func:`tensor_stats` (underflow rate, subnormal
share, overflow count, relative error, amax, headroom).
"""

from adaloss_jax.numerics._fp8 import amax_scale, fp8_cotangents, quantize_cotangent
from adaloss_jax.numerics._probe import (
    Probe,
    ProbeGrads,
    compare,
    linen_grads,
    linen_probe,
    loss_scale_of,
    make_probe,
    nnx_probe,
)
from adaloss_jax.numerics._stats import STAT_NAMES, tensor_stats
from adaloss_jax.numerics._table import (
    DEFAULT_COLUMNS,
    ProbeRow,
    display_name,
    format_table,
    rows_as_dicts,
)
from adaloss_jax.numerics._taps import nnx_taps, taps

__all__ = [
    "DEFAULT_COLUMNS",
    "STAT_NAMES",
    "Probe",
    "ProbeGrads",
    "ProbeRow",
    "amax_scale",
    "compare",
    "display_name",
    "format_table",
    "fp8_cotangents",
    "linen_grads",
    "linen_probe",
    "loss_scale_of",
    "make_probe",
    "nnx_probe",
    "nnx_taps",
    "quantize_cotangent",
    "rows_as_dicts",
    "taps",
    "tensor_stats",
]
