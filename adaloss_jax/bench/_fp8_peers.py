"""The fp8 recipes fp8 users pick today, as dense-layer dot products for ``nn.Dense``'s
``dot_general_cls``: the bench's fp8 peers.

* ``delayed``: flax's ``Fp8DirectDotGeneralOp`` (what flax recommends; its
  ``Fp8DotGeneralOp`` is deprecated): e4m3 inputs and kernels, e5m2 output gradients,
  each tensor scaled by a scale set from a 1024-step history of its past amaxes.
* ``current``: per-tensor *current* scaling, as TransformerEngine's current-scaling
  recipe and torchao's tensorwise recipe do: each tensor is scaled from its own amax in
  the same step (``scale = fp8_max / amax``), e4m3 for the inputs and kernels, e5m2 for
  the output gradient, the product computed in fp32 from the rounded values.

Both run with the model in bfloat16 and no loss scaling. On a CPU the fp8 values are
simulated by casts (:func:`adaloss_jax._formats.round_to`); the numbers are fp8's, the
speed is not.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from adaloss_jax import _formats

# flax keeps Fp8DirectDotGeneralOp's scales and amax histories in this collection; their
# "gradients" are their next values.
FP8_STATE = fp8_ops.OVERWRITE_WITH_GRADIENT
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def current_round(x: jax.Array, fmt) -> jax.Array:
    """``x`` (as fp32) scaled by ``fp8_max / amax(x)``, rounded to ``fmt`` and unscaled:
    a tensor stored in fp8 with a per-tensor scale from its own amax."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    scale = jnp.where(amax > 0, float(jnp.finfo(fmt).max) / amax, 1.0)
    return _formats.round_to(x * scale, fmt) / scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def current_fp8_dot(x, kernel, dimension_numbers):
    """``lax.dot_general`` of e4m3 ``x`` and ``kernel``, its output gradient rounded to
    e5m2, all three scaled from their own amax in this step."""
    return _fwd(x, kernel, dimension_numbers)[0]


def _fwd(x, kernel, dimension_numbers):
    qx, qk = current_round(x, E4M3), current_round(kernel, E4M3)
    out = jax.lax.dot_general(qx, qk, dimension_numbers)
    like = (jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype))  # the operands' dtypes
    return out.astype(x.dtype), (qx, qk, like)


def _bwd(dimension_numbers, res, g):
    qx, qk, (x_like, k_like) = res
    _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), qx, qk)
    dx, dk = vjp(current_round(g, E5M2))
    return dx.astype(x_like.dtype), dk.astype(k_like.dtype)


current_fp8_dot.defvjp(_fwd, _bwd)


class CurrentFp8Dot(nn.Module):
    """Per-tensor current fp8 scaling as an ``nn.Dense`` ``dot_general_cls``."""

    @nn.compact
    def __call__(self, x, kernel, dimension_numbers, precision=None,
                 preferred_element_type=None):
        del precision, preferred_element_type
        return current_fp8_dot(x, kernel, dimension_numbers)


DOT_CLASSES = {"delayed": fp8_ops.Fp8DirectDotGeneralOp, "current": CurrentFp8Dot}
