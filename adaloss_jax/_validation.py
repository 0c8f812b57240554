"""Argument checks run at construction time, so bad input fails before any trace."""

from __future__ import annotations

import math
import numbers


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def check_int(name: str, value, *, minimum: int) -> int:
    """A Python int >= ``minimum`` (bools refused)."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be a Python int >= {minimum}, got {value!r} "
            f"of type {type(value).__name__}; pass e.g. {name}={max(minimum, 1)}"
        )
    if value < minimum:
        raise ValueError(
            f"{name} must be >= {minimum}, got {value!r}; pass {name}={minimum} or more"
        )
    return int(value)


def check_positive_finite(name: str, value) -> float:
    """A real, finite, > 0 Python number."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a positive finite Python number, got {value!r} "
            f"of type {type(value).__name__}; pass a float such as {name}=2.0**15"
        )
    v = float(value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(
            f"{name} must be positive and finite, got {value!r}; pass a power of two "
            f"such as {name}=2.0**15"
        )
    return v


def check_power_of_two(name: str, value) -> float:
    """A positive finite power of two within fp32's normal range."""
    v = check_positive_finite(name, value)
    mantissa, _ = math.frexp(v)
    if mantissa != 0.5:
        nearest = 2.0 ** round(math.log2(v))
        raise ValueError(
            f"{name} must be a power of two (scales are powers of two so that scaling "
            f"is exact), got {value!r}; pass {name}={nearest!r}"
        )
    if not 2.0**-126 <= v <= 2.0**127:
        raise ValueError(
            f"{name}={value!r} is outside fp32's normal range [2**-126, 2**127]; "
            f"pass a power of two inside it"
        )
    return v


def check_growth_factor(name: str, value) -> float:
    """A power of two > 1 (a scale grows or backs off by it)."""
    v = check_positive_finite(name, value)
    if not v > 1:
        raise ValueError(
            f"{name} must be > 1 (a scale grows or backs off by it), got {value!r}; pass "
            f"{name}=2.0"
        )
    return check_power_of_two(name, v)


def check_bool(name: str, value) -> bool:
    if not _is_bool(value):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value
