"""Floating-point formats: the range facts every scaler and probe works from.

A scaler needs three numbers of the format its gradients are stored in:
``max`` (overflow above), ``min_normal`` (precision degrades below) and
``min_subnormal`` (``u_min`` in Zhao et al.: values below half of it flush to zero).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """Range of a floating-point format.

    Attributes:
      name: canonical short name (``"float16"``, ``"bfloat16"``, ``"float32"``,
        ``"float8_e4m3fn"``, ``"float8_e5m2"``).
      dtype: the numpy/JAX dtype.
      max: largest finite value (``u_max``).
      min_normal: smallest positive normal value.
      min_subnormal: smallest positive subnormal value (``u_min``).
      mantissa_bits: explicit mantissa bits.
      has_inf: whether overflow gives inf (``False`` for e4m3fn, where it gives NaN).
      needs_scaling: whether gradients in this format need loss scaling (fp16 and
        fp8 do; bf16 and fp32 have fp32's exponent range and do not).

    >>> FLOAT8_E4M3.max, FLOAT8_E4M3.binades, FLOAT8_E4M3.has_inf
    (448.0, 18, False)
    """

    name: str
    dtype: Any
    max: float
    min_normal: float
    min_subnormal: float
    mantissa_bits: int
    has_inf: bool
    needs_scaling: bool

    @property
    def max_exponent(self) -> int:
        """``floor(log2(max))``: the largest power of two the format holds."""
        return math.floor(math.log2(self.max))

    @property
    def min_exponent(self) -> int:
        """``log2(min_subnormal)``: the smallest power of two the format holds."""
        return round(math.log2(self.min_subnormal))

    @property
    def binades(self) -> int:
        """Number of powers of two representable (subnormals included)."""
        return self.max_exponent - self.min_exponent + 1


def _make(name: str, dtype: Any, needs_scaling: bool) -> FloatFormat:
    fi = jnp.finfo(dtype)
    return FloatFormat(
        name=name,
        dtype=np.dtype(dtype),
        max=float(fi.max),
        min_normal=float(fi.smallest_normal),
        min_subnormal=float(fi.smallest_subnormal),
        mantissa_bits=int(fi.nmant),
        has_inf=name != "float8_e4m3fn",
        needs_scaling=needs_scaling,
    )


FLOAT16 = _make("float16", jnp.float16, True)
BFLOAT16 = _make("bfloat16", jnp.bfloat16, False)
FLOAT32 = _make("float32", jnp.float32, False)
FLOAT8_E4M3 = _make("float8_e4m3fn", jnp.float8_e4m3fn, True)
FLOAT8_E5M2 = _make("float8_e5m2", jnp.float8_e5m2, True)

FORMATS: dict[str, FloatFormat] = {
    f.name: f for f in (FLOAT16, BFLOAT16, FLOAT32, FLOAT8_E4M3, FLOAT8_E5M2)
}
_ALIASES = {
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "f32": "float32",
    "e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
}


def float_format(dtype_or_name: Any, *, argname: str = "dtype") -> FloatFormat:
    """Returns the :class:`FloatFormat` of a dtype, a dtype name or a format.

    Args:
      dtype_or_name: a dtype, a name (``"float16"``, ``"fp16"``, ``"e4m3"``, ...) or a
        :class:`FloatFormat`.
      argname: the argument's name, for the error message.

    Returns:
      The :class:`FloatFormat`.

    >>> float_format("fp16").max
    65504.0
    >>> float_format(jnp.bfloat16).needs_scaling
    False

    Raises:
      TypeError: naming ``argname`` for something that is not a dtype.
      ValueError: naming ``argname`` for a dtype that is not one of the supported
        formats (float16, bfloat16, float32, float8_e4m3fn, float8_e5m2).
    """
    if isinstance(dtype_or_name, FloatFormat):
        return dtype_or_name
    supported = ", ".join(FORMATS)
    if isinstance(dtype_or_name, str):
        key = _ALIASES.get(dtype_or_name.lower(), dtype_or_name.lower())
    else:
        try:
            key = np.dtype(dtype_or_name).name
        except TypeError as e:
            raise TypeError(
                f"{argname}={dtype_or_name!r} is not a dtype; pass one of: {supported}"
            ) from e
    if key not in FORMATS:
        raise ValueError(
            f"{argname}={dtype_or_name!r} is not a supported floating-point format; "
            f"pass one of: {supported}"
        )
    return FORMATS[key]


def pow2(n) -> jax.Array:
    """``2.0 ** n`` in fp32, exactly, for integer-valued ``n`` (``jnp.exp2`` is not exact on
    CPU); inf above 2**127 and 0 below 2**-126.

    Written as the exponent bits (4 scalar ops, against ~50 for ``jnp.ldexp``): every
    converting scale point uses it.

    >>> pow2(jnp.array([-3.0, 0.0, 10.0])).tolist()
    [0.125, 1.0, 1024.0]
    """
    n = jax.lax.clamp(-127.0, jnp.asarray(n, jnp.float32), 128.0).astype(jnp.int32)
    # Biased exponent n + 127 and a zero mantissa; n = -127 gives 0.0 and n = 128 inf.
    return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def round_to(x: jax.Array, fmt: Any) -> jax.Array:
    """``x`` stored in ``fmt`` and read back, in ``x``'s dtype: the one simulation of a
    narrow format (fp8 cotangents) in this library, used by the scale points
    (``simulate=True``) and by :func:`adaloss_jax.numerics.quantize_cotangent`.

    Round to nearest even, with the cast's overflow behaviour (inf for e5m2 and fp16,
    NaN for e4m3fn, which has no inf); subnormals kept, smaller values flushed to zero.

    >>> round_to(jnp.array([0.3, 1e-9, 1e6]), "float8_e5m2").tolist()
    [0.3125, 0.0, inf]
    """
    fmt = float_format(fmt, argname="fmt")
    return x.astype(fmt.dtype).astype(x.dtype)


def pow2_repr(value: Any) -> str:
    """``repr(value)``, except that a float power of two ``2**k`` with ``|k| >= 5`` is
    written ``2**k``: how scales are shown by the scalers' reprs, their error messages
    and the API reference's signatures.

    >>> pow2_repr(2.0**64), pow2_repr(2.0**-24), pow2_repr(2.0**15)
    ('2**64', '2**-24', '2**15')
    >>> pow2_repr(16.0), pow2_repr(1.0), pow2_repr(1e-3), pow2_repr(2000)
    ('16.0', '1.0', '0.001', '2000')
    """
    if isinstance(value, float) and math.isfinite(value) and value > 0:
        mantissa, exponent = math.frexp(value)
        if mantissa == 0.5 and abs(exponent - 1) >= 5:
            return f"2**{exponent - 1}"
    return repr(value)


def dataclass_repr(obj: Any) -> str:
    """The ``repr`` a dataclass generates (its ``repr=True`` fields, in order), with
    every value written by :func:`pow2_repr`.

    >>> dataclass_repr(FLOAT16).split(", ")[3:5]
    ['min_normal=2**-14', 'min_subnormal=2**-24']
    """
    shown = ", ".join(f"{f.name}={pow2_repr(getattr(obj, f.name))}"
                      for f in dataclasses.fields(obj) if f.repr)
    return f"{type(obj).__qualname__}({shown})"
