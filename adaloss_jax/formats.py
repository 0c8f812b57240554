"""The floating-point formats loss scaling is for, and their ranges.

>>> import adaloss_jax as alj
>>> alj.formats.float_format("e4m3").max
448.0
"""

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

__all__ = ["BFLOAT16", "FLOAT16", "FLOAT32", "FLOAT8_E4M3", "FLOAT8_E5M2", "FORMATS",
           "FloatFormat", "float_format"]
