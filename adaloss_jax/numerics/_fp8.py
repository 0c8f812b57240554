"""Simulated fp8 cotangents: a scale point that rounds the backward pass to fp8.

SIMULATION: the forward pass and all arithmetic stay in the model's dtype; only the
cotangent crossing the scale point is scaled, stored in an fp8 format and read back
(:func:`adaloss_jax._formats.round_to`, the simulation the adaptive scale points use
too) and unscaled. This is the numerical effect of storing
that cotangent in fp8 with a per-tensor scale, not fp8 speed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from adaloss_jax import _formats
from adaloss_jax.numerics import _taps

_FP8 = ("float8_e5m2", "float8_e4m3fn")


def _fp8_format(dtype: Any) -> _formats.FloatFormat:
    fmt = _formats.float_format(dtype, argname="dtype")
    if fmt.name not in _FP8:
        raise ValueError(
            f"dtype={dtype!r} is not an fp8 format; pass 'float8_e5m2' (the usual format "
            f"for gradients) or 'float8_e4m3fn'"
        )
    return fmt


def _round_trip(g: jax.Array, scale: jax.Array, name: str) -> jax.Array:
    s = jnp.asarray(scale, jnp.float32)
    return (_formats.round_to(g.astype(jnp.float32) * s, name) / s).astype(g.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _quantize(x, scale, name):
    del scale, name
    return x


def _quantize_fwd(x, scale, name):
    del name
    return x, scale


def _quantize_bwd(name, scale, g):
    return _round_trip(g, scale, name), jnp.zeros_like(scale)


_quantize.defvjp(_quantize_fwd, _quantize_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _quantize_amax(x, name, margin):
    del name, margin
    return x


def _quantize_amax_fwd(x, name, margin):
    del name, margin
    return x, None


def amax_scale(g: jax.Array, fmt: Any, margin: int = 0) -> jax.Array:
    """The largest power of two putting ``amax(|g|)`` at least ``margin`` binades below
    ``fmt.max``: ``2 ** (floor(log2(fmt.max / amax)) - margin)``; 1 when ``g`` is all
    zero or not finite.

    Args:
      g: the tensor.
      fmt: the format (``"float8_e5m2"``, ...).
      margin: binades kept free below the format's max.

    Returns:
      An fp32 scalar power of two.

    >>> float(amax_scale(jnp.array([0.5, -3.0]), "float8_e5m2"))
    16384.0
    """
    fmt = _formats.float_format(fmt, argname="fmt")
    amax = jnp.max(jnp.abs(g.astype(jnp.float32)))
    ok = (amax > 0) & jnp.isfinite(amax)
    e = jnp.floor(jnp.log2(fmt.max) - jnp.log2(jnp.where(ok, amax, 1.0))) - margin
    # Keep the scale itself a finite fp32 power of two.
    e = jnp.clip(e, -126, 127)
    return jnp.where(ok, jnp.exp2(e), 1.0).astype(jnp.float32)


def _quantize_amax_bwd(name, margin, res, g):
    del res
    return (_round_trip(g, amax_scale(g, name, margin), name),)


_quantize_amax.defvjp(_quantize_amax_fwd, _quantize_amax_bwd)


def quantize_cotangent(
    x: jax.Array, scale: Any = None, dtype: Any = "float8_e5m2", *, margin: int = 0
) -> jax.Array:
    """Identity whose backward pass rounds the cotangent to fp8 (SIMULATED fp8).

    Forward: ``x`` unchanged. Backward, for the incoming cotangent ``g``::

        s = scale                                   # given: global or per-tensor
        s = 2 ** (floor(log2(max / amax|g|)) - margin)   # scale=None: from g itself
        g = dtype(fp32(g) * s) -> fp32 / s -> g.dtype

    The scale receives a zero cotangent.

    Args:
      x: any floating array.
      scale: the scale applied before the cast (a scalar, may be traced), or None for
        a per-tensor power-of-two scale from the cotangent's own amax (what Transformer
        Engine and torchao do for fp8 operands).
      dtype: ``"float8_e5m2"`` (default) or ``"float8_e4m3fn"``.
      margin: binades kept free below the format's max when ``scale=None``.

    Returns:
      ``x``, unchanged (the rounding happens to its cotangent).

    >>> g = jax.grad(lambda x: jnp.sum(quantize_cotangent(x, 1.0) * 0.3))(jnp.ones(2))
    >>> g.tolist()  # 0.3 in e5m2 is 0.3125
    [0.3125, 0.3125]
    """
    fmt = _fp8_format(dtype)
    if scale is None:
        return _quantize_amax(x, fmt.name, int(margin))
    return _quantize(x, jnp.asarray(scale, jnp.float32), fmt.name)


@contextlib.contextmanager
def fp8_cotangents(
    dtype: Any = "float8_e5m2",
    scale: Any = None,
    *,
    filter: _taps.ModuleFilter | None = None,
    margin: int = 0,
) -> Iterator[None]:
    """Within the context, module outputs get :func:`quantize_cotangent` (SIMULATED).

    Every selected linen module call's output and every :func:`~adaloss_jax.scale_group`
    function's output (the same taps, and keys, a probe reports) has its cotangent
    rounded to fp8. Use it inside the function you
    differentiate, around ``model.apply``::

        def loss_fn(params, batch):
            with fp8_cotangents("float8_e5m2", scale=loss_scale):
                logits = model.apply({"params": params}, batch["x"])
            return xent(logits, batch["y"])

    Args:
      dtype: ``"float8_e5m2"`` or ``"float8_e4m3fn"``.
      scale: None (per-tensor amax scale), one scale for all taps (a scalar), or a
        mapping from tap key (``"block_0/mlp"``) to scale; keys missing from it use 1.
      filter: ``(module_path, module) -> bool``; all modules when None.
      margin: binades kept free when scales come from amax.

    Returns:
      A context manager.

    >>> import adaloss_jax as alj
    >>> f = alj.scale_group("f")(lambda x: x * 1.0)
    >>> def loss(x):
    ...     with fp8_cotangents("float8_e5m2", scale=1.0):
    ...         return jnp.sum(f(x) * 0.3)
    >>> jax.grad(loss)(jnp.ones(2)).tolist()  # 0.3 in e5m2 is 0.3125
    [0.3125, 0.3125]
    """
    _fp8_format(dtype)

    def leaf_tap(key, leaf):
        if isinstance(scale, Mapping):
            return quantize_cotangent(leaf, scale.get(key, 1.0), dtype)
        return quantize_cotangent(leaf, scale, dtype, margin=margin)

    with _taps.taps(leaf_tap, filter):
        yield
