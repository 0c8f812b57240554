"""The Equinox front end of adaptive per-layer loss scaling (``pip install adaloss_jax[equinox]``).

Every ``eqx.Module`` inside the model is a potential scale group, keyed by its path in
the model's pytree (``"layers/0"``), and the groups are the modules that own arrays
directly. The model is not changed: inside the traced loss it is split into its inexact
arrays and the rest (``eqx.partition``), rebuilt as a private copy whose modules report
their calls to the scale points (:mod:`adaloss_jax._swap`), and the flax-free core does
the rest. Stacked layers run with ``jax.lax.scan`` or ``eqx.filter_vmap`` keep their
scale points (the rebuilt modules keep their class).

>>> import equinox as eqx, jax, jax.numpy as jnp, optax
>>> import adaloss_jax as alj
>>> from adaloss_jax.equinox import eqx_adaptive_value_and_grad
>>> model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
>>> def loss_fn(model, x):
...     return jnp.mean(jax.vmap(model)(x) ** 2)
>>> scaler = alj.adaptive(groups="module")
>>> tx = alj.adaptive_scaled(optax.adam(1e-3), scaler)
>>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
>>> @eqx.filter_jit
... def step(model, opt_state, x):
...     loss, grads, stats = eqx_adaptive_value_and_grad(loss_fn, scaler)(opt_state, model, x)
...     params = eqx.filter(model, eqx.is_inexact_array)
...     updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
...     return eqx.apply_updates(model, updates), opt_state, loss
>>> model, opt_state, loss = step(model, opt_state, jnp.ones((3, 4)))
>>> sorted(alj.adaptive_state(opt_state).log2_scales)
['', 'layers/0', 'layers/1', 'layers/2']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from adaloss_jax import _adaptive, _points, _swap

_BASE_NAMES = frozenset(dir(eqx.Module))

__all__ = ["eqx_adaptive_value_and_grad"]


def _modules(tree, path=()):
    """``(path, module)`` for every ``eqx.Module`` in ``tree``, outermost first."""
    if isinstance(tree, eqx.Module):
        yield path, tree
    children = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is not tree and isinstance(x, eqx.Module))[0]
    for keys, child in children:
        if isinstance(child, eqx.Module) and child is not tree:
            yield from _modules(child, path + tuple(_adaptive._key_name(k) for k in keys))


def eqx_adaptive_value_and_grad(
    loss_fn: Callable[..., Any],
    scaler: _adaptive.AdaptiveScale | None = None,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Any]]:
    """Equinox counterpart of :func:`adaloss_jax.adaptive_value_and_grad`.

    Returns ``g(opt_state, model, *args, **kwargs) -> (value, grads, stats)`` with
    ``loss_fn(model, *args, **kwargs)``; ``grads`` has the structure of
    ``eqx.filter(model, eqx.is_inexact_array)`` (scaled per group), for
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with that same
    ``params``. Call it inside ``eqx.filter_jit`` (or ``jax.jit``).
    """
    scaler = _adaptive.AdaptiveScale() if scaler is None else scaler
    _adaptive._check_scaler(scaler)

    def pure(params, static, *args, **kwargs):
        model = eqx.combine(params, static)  # fresh module objects: a private copy
        swapped = (_swap.install(_modules(model), _BASE_NAMES)
                   if _points.active() is not None else [])
        try:
            return loss_fn(model, *args, **kwargs)
        finally:
            _swap.uninstall(swapped)

    core = _adaptive.adaptive_value_and_grad(pure, scaler, has_aux=has_aux,
                                             cache_token=("equinox", loss_fn, has_aux))

    def wrapped(opt_state, model, *args, **kwargs):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return core(opt_state, params, static, *args, **kwargs)

    wrapped.plans = core.plans
    return wrapped
