"""Tests of the float-format table against jnp.finfo and ml_dtypes."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import adaloss_jax as alj

# name, dtype, max, min normal, min subnormal: written out from the formats' bit layouts.
_EXPECTED = [
    ("float16", jnp.float16, 65504.0, 2.0**-14, 2.0**-24),
    ("bfloat16", jnp.bfloat16, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133),
    ("float32", jnp.float32, (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149),
    ("float8_e4m3fn", jnp.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9),
    ("float8_e5m2", jnp.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16),
]


@pytest.mark.parametrize("name,dtype,fmax,fmin_normal,fmin_sub", _EXPECTED,
                         ids=[e[0] for e in _EXPECTED])
def test_range_matches_bit_layout_and_finfo(name, dtype, fmax, fmin_normal, fmin_sub):
    fmt = alj.formats.float_format(dtype)
    assert fmt.name == name
    assert fmt is alj.formats.FORMATS[name]
    assert fmt.max == fmax
    assert fmt.min_normal == fmin_normal
    assert fmt.min_subnormal == fmin_sub
    fi = jnp.finfo(dtype)
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.mantissa_bits == int(fi.nmant)
    mfi = ml_dtypes.finfo(np.dtype(dtype))
    assert fmt.max == float(mfi.max)
    assert fmt.min_subnormal == float(mfi.smallest_subnormal)


@pytest.mark.parametrize("name,dtype,fmax,fmin_normal,fmin_sub", _EXPECTED,
                         ids=[e[0] for e in _EXPECTED])
def test_values_round_trip_at_the_edges(name, dtype, fmax, fmin_normal, fmin_sub):
    del name, fmin_normal
    edges = np.array([fmax, fmin_sub], np.float64)
    assert np.array_equal(np.asarray(jnp.asarray(edges).astype(dtype), np.float64), edges)
    # Below half of the smallest subnormal everything rounds to zero.
    tiny = jnp.asarray(fmin_sub * 0.25, jnp.float32).astype(dtype)
    assert float(tiny) == 0.0


def test_exponents_and_binades():
    fp16 = alj.formats.FLOAT16
    assert (fp16.max_exponent, fp16.min_exponent, fp16.binades) == (15, -24, 40)
    e4m3 = alj.formats.FLOAT8_E4M3
    assert (e4m3.max_exponent, e4m3.min_exponent, e4m3.binades) == (8, -9, 18)
    e5m2 = alj.formats.FLOAT8_E5M2
    assert (e5m2.max_exponent, e5m2.min_exponent, e5m2.binades) == (15, -16, 32)
    for fmt in alj.formats.FORMATS.values():
        assert 2.0**fmt.max_exponent <= fmt.max < 2.0 ** (fmt.max_exponent + 1)
        assert math.log2(fmt.min_subnormal) == fmt.min_exponent


def test_has_inf_and_needs_scaling():
    # e4m3fn has no inf: a cast of a too-large value gives NaN.
    assert not alj.formats.FLOAT8_E4M3.has_inf
    assert np.isnan(float(jnp.asarray(1e4, jnp.float32).astype(jnp.float8_e4m3fn)))
    for fmt in (alj.formats.FLOAT16, alj.formats.BFLOAT16, alj.formats.FLOAT32,
                alj.formats.FLOAT8_E5M2):
        assert fmt.has_inf
        assert np.isinf(float(jnp.asarray(np.inf, jnp.float32).astype(fmt.dtype)))
    assert {f.name for f in alj.formats.FORMATS.values() if f.needs_scaling} == {
        "float16", "float8_e4m3fn", "float8_e5m2"}


@pytest.mark.parametrize("alias,name", [
    ("fp16", "float16"), ("half", "float16"), ("BF16", "bfloat16"), ("fp32", "float32"),
    ("e4m3", "float8_e4m3fn"), ("e5m2", "float8_e5m2"), ("float8_e5m2", "float8_e5m2"),
])
def test_aliases(alias, name):
    assert alj.formats.float_format(alias).name == name


def test_accepts_dtypes_and_formats():
    assert alj.formats.float_format(np.dtype("float16")) is alj.formats.FLOAT16
    assert alj.formats.float_format(jnp.dtype(jnp.bfloat16)) is alj.formats.BFLOAT16
    assert alj.formats.float_format(alj.formats.FLOAT8_E5M2) is alj.formats.FLOAT8_E5M2


@pytest.mark.parametrize("bad", [jnp.int32, jnp.float64, "float64", "int8", jnp.float8_e4m3,
                                 "fp12"], ids=str)
def test_unsupported_format_is_a_value_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"compute_dtype=.*supported"):
        alj.formats.float_format(bad, argname="compute_dtype")


def test_non_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="dtype=.*not a dtype"):
        alj.formats.float_format(object())
