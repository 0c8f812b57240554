"""The Equinox front end of adaptive per-layer loss scaling (``pip install adaloss_jax[equinox]``).

Every ``eqx.Module`` inside the model is a potential scale group, keyed by its path in
the model's pytree (``"layers/0"``), and the groups are the modules that own arrays
directly. The model is not changed: inside the traced loss it is split into its inexact
arrays and the rest (``eqx.partition``), rebuilt as a private copy whose modules report
their calls (:mod:`adaloss_jax._swap`), and the flax-free core does the rest. Layers run
under ``jax.vmap``, ``jax.lax.scan`` or ``eqx.filter_vmap`` keep their scale points (the
rebuilt modules keep their class).

>>> import equinox as eqx, jax, jax.numpy as jnp, optax
>>> import adaloss_jax as alj
>>> from adaloss_jax.equinox import eqx_adaptive_value_and_grad
>>> model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0), dtype=jnp.float16)
>>> def loss_fn(model, x):
...     return jnp.mean(jax.vmap(model)(x).astype(jnp.float32) ** 2)
>>> tx = alj.adaptive_scaled(optax.adam(1e-3), alj.adaptive(groups="module"))
>>> opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
>>> @eqx.filter_jit
... def step(model, opt_state, x):
...     loss, grads, stats = eqx_adaptive_value_and_grad(loss_fn)(opt_state, model, x)
...     params = eqx.filter(model, eqx.is_inexact_array)
...     updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
...     return eqx.apply_updates(model, updates), opt_state, loss
>>> model, opt_state, loss = step(model, opt_state, jnp.ones((3, 4), jnp.float16))
>>> alj.scale_state(opt_state).groups
('', 'layers/0', 'layers/1', 'layers/2')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from adaloss_jax import _grad, _record, _swap, _tree

_BASE_NAMES = frozenset(dir(eqx.Module))

__all__ = ["eqx_adaptive_value_and_grad"]


def modules(tree, path=()):
    """``(path, module)`` for every ``eqx.Module`` in ``tree``, outermost first."""
    if isinstance(tree, eqx.Module):
        yield path, tree
    children = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is not tree and isinstance(x, eqx.Module))[0]
    for keys, child in children:
        if isinstance(child, eqx.Module) and child is not tree:
            yield from modules(child, path + tuple(_tree.key_name(k) for k in keys))


def eqx_adaptive_value_and_grad(
    loss_fn: Callable[..., Any], *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, Any]]:
    """Equinox counterpart of :func:`adaloss_jax.adaptive_value_and_grad`.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``g(opt_state, model, *args, **kwargs) -> (value, grads, stats)``; ``grads`` has
      the structure of ``eqx.filter(model, eqx.is_inexact_array)`` (scaled per group),
      for ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with that
      same ``params``. Call it inside ``eqx.filter_jit`` (or ``jax.jit``).

    >>> import jax.numpy as jnp, optax
    >>> import adaloss_jax as alj
    >>> model = eqx.nn.Linear(2, 2, key=jax.random.key(0), dtype=jnp.float16)
    >>> tx = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module"))
    >>> state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    >>> loss_fn = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)
    >>> _, grads, stats = eqx.filter_jit(eqx_adaptive_value_and_grad(loss_fn))(
    ...     state, model, jnp.ones(2, jnp.float16))
    >>> sorted(stats.amax)
    ['']
    """

    def pure(params, static, *args, **kwargs):
        model = eqx.combine(params, static)  # fresh module objects: a private copy
        swapped = (_swap.install(modules(model), _BASE_NAMES)
                   if _record.active() is not None else [])
        try:
            return loss_fn(model, *args, **kwargs)
        finally:
            _swap.uninstall(swapped)

    core = _grad.adaptive_value_and_grad(pure, has_aux=has_aux)

    def wrapped(opt_state, model, *args, **kwargs):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return core(opt_state, params, static, *args, **kwargs)

    return wrapped
