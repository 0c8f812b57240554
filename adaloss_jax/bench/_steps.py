"""One training step for either kind of scaler, so that every benchmark builds it alike.

A global scaler (``alj.dynamic()``, ``alj.no_scaling()``, ...) and an adaptive scaler
(``alj.adaptive()``) differ in the Optax chain and the gradient function; both gradient
functions return ``(value, grads, stats)`` for ``tx.update(..., scale_stats=stats)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

import adaloss_jax as alj


def scaled_tx(inner: optax.GradientTransformation, scaling: Any,
              axis_name: str | None = None) -> optax.GradientTransformation:
    """``inner`` behind the unscale (and skip) of ``scaling``: a scaler or an
    :class:`~adaloss_jax.AdaptiveScale`."""
    if isinstance(scaling, alj.AdaptiveScale):
        return alj.adaptive_scaled(inner, scaling, axis_name=axis_name)
    return alj.loss_scaled(inner, scaling, axis_name=axis_name)


def scaled_value_and_grad(loss_fn: Callable[..., Any], scaling: Any,
                          has_aux: bool = False) -> Callable[..., tuple[Any, Any, dict]]:
    """``g(opt_state, params, *args) -> (value, scaled gradients, update keywords)``;
    pass the keywords (and ``loss=``) to ``tx.update``."""
    make = (alj.adaptive_value_and_grad if isinstance(scaling, alj.AdaptiveScale)
            else alj.value_and_grad)
    vg = make(loss_fn, has_aux=has_aux)

    def grads(opt_state, params, *args):
        value, grads, stats = vg(opt_state, params, *args)
        return value, grads, {"scale_stats": stats}

    return grads


def scaled_step(loss_fn: Callable[..., Any], inner: optax.GradientTransformation,
                scaling: Any, axis_name: str | None = None):
    """``(tx, step)``: ``step(params, opt_state, *args) -> (params, opt_state, loss)``, not
    jitted (wrap it in ``jax.jit`` or ``shard_map``)."""
    tx = scaled_tx(inner, scaling, axis_name)
    vg = scaled_value_and_grad(loss_fn, scaling)

    def step(params, opt_state, *args):
        loss, grads, kw = vg(opt_state, params, *args)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss, **kw)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, step
