"""Per-tensor statistics of a low-precision gradient against its fp32 reference."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from adaloss_jax import _formats

STAT_NAMES = (
    "size",
    "ref_nonzero",
    "flushed",
    "underflow_rate",
    "subnormal_share",
    "overflow_count",
    "rel_error",
    "amax",
    "headroom",
    "scale",
)


def tensor_stats(
    ref: jax.Array, stored: jax.Array, scale: Any, fmt: Any = "float16"
) -> dict[str, jax.Array]:
    """Compares one low-precision tensor, as stored (scaled), with its fp32 reference.

    With ``r = fp32(ref)``, ``s = fp32(stored)``, ``n = size`` and ``c = scale``::

        flushed         = count(r != 0 and s == 0)
        underflow_rate  = flushed / max(count(r != 0), 1)   # of the values that should be there
        subnormal_share = count(0 < |s| < fmt.min_normal) / n
        overflow_count  = count(not isfinite(s))
        rel_error       = ||s / c - r||_2 / ||r||_2          # 0 if both are 0, inf if only r is
        amax            = max |s|                             # inf or NaN once it overflowed
        headroom        = log2(fmt.max / amax)                # binades left before overflow

    ``stored`` is what the low-precision computation kept (already multiplied by the
    scale), so ``subnormal_share`` and ``headroom`` describe the format's range as used;
    ``rel_error`` compares the unscaled values. A tensor of zeros has headroom ``inf``;
    an overflowed one ``-inf`` (or NaN when a NaN is in it, as e4m3fn gives on overflow).

    Args:
      ref: the fp32 reference values (unscaled).
      stored: the low-precision values as stored (scaled by ``scale``), same shape.
      scale: the scale the stored values carry (scalar).
      fmt: the format the values were stored in (a name, dtype or FloatFormat); it
        decides the subnormal range and ``max``.

    Returns:
      A dict of fp32 (counts: int32) scalars named as in ``STAT_NAMES``.

    >>> s = tensor_stats(jnp.array([1e-9, 1.0, 0.0]), jnp.array([0.0, 1.0, 0.0]), 1.0)
    >>> float(s["underflow_rate"]), int(s["flushed"]), float(s["headroom"]) > 15.9
    (0.5, 1, True)
    """
    fmt = _formats.float_format(fmt, argname="fmt")
    if ref.shape != stored.shape:
        raise ValueError(
            f"ref and stored must have the same shape, got ref.shape={ref.shape} and "
            f"stored.shape={stored.shape}"
        )
    r = ref.astype(jnp.float32)
    s = stored.astype(jnp.float32)
    c = jnp.asarray(scale, jnp.float32)
    n = r.size
    ref_nonzero = jnp.sum(r != 0, dtype=jnp.int32)
    flushed = jnp.sum((r != 0) & (s == 0), dtype=jnp.int32)
    a = jnp.abs(s)
    subnormal = jnp.sum((a > 0) & (a < fmt.min_normal), dtype=jnp.int32)
    overflow = jnp.sum(~jnp.isfinite(s), dtype=jnp.int32)
    diff = jnp.sqrt(jnp.sum(jnp.square(s / c - r)))
    norm = jnp.sqrt(jnp.sum(jnp.square(r)))
    rel = jnp.where(norm > 0, diff / jnp.where(norm > 0, norm, 1.0),
                    jnp.where(diff > 0, jnp.inf, 0.0))
    if n:
        amax = jnp.max(a)
    else:
        amax = jnp.asarray(0.0, jnp.float32)
    headroom = jnp.log2(jnp.float32(fmt.max)) - jnp.log2(amax)
    return {
        "size": jnp.asarray(n, jnp.int32),
        "ref_nonzero": ref_nonzero,
        "flushed": flushed,
        "underflow_rate": flushed / jnp.maximum(ref_nonzero, 1).astype(jnp.float32),
        "subnormal_share": subnormal / jnp.float32(max(n, 1)),
        "overflow_count": overflow,
        "rel_error": rel.astype(jnp.float32),
        "amax": amax,
        "headroom": headroom.astype(jnp.float32),
        "scale": c,
    }
