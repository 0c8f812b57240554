"""The NNX front end of adaptive per-layer loss scaling.

NNX has no method interceptor, so the scale points are put in by giving every submodule
of a *copy* of the model (``nnx.merge`` of a split, made inside the traced function) a
subclass whose public methods report their calls (:mod:`adaloss_jax._swap`). The user's
model object is never modified. Submodules are keyed by their first path in the object
graph, so a module shared between two places is one scale group, as its parameters are
one set. The model is split into a pure function of its parameters, so the flax-free
core does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from adaloss_jax import _grad, _record, _swap

_BASE_NAMES = frozenset(dir(nnx.Module))


def modules(model: nnx.Module):
    """``(path, module)`` for every module in ``model``'s object graph, itself first."""
    for path, sub in nnx.iter_graph(model):
        if isinstance(sub, nnx.Module):
            yield tuple(str(k) for k in path), sub


def nnx_adaptive_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Any]]:
    """NNX counterpart of :func:`adaloss_jax.adaptive_value_and_grad`.

    Args:
      loss_fn: ``loss_fn(model, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
      wrt: the variables to differentiate.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      ``g(opt_state, model, *args, **kwargs) -> (value, grads, stats)``; ``grads`` is an
      ``nnx.State`` of the ``wrt`` variables (scaled per group) for
      ``optimizer.update(model, grads, loss=loss, scale_stats=stats)``. Non-parameter
      state the loss changes (batch statistics, RNG counters) is written back to
      ``model``. Call it inside ``nnx.jit``.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import adaloss_jax as alj
    >>> model = nnx.Linear(2, 2, dtype=jnp.float16, rngs=nnx.Rngs(0))
    >>> tx = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module"))
    >>> state = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))
    >>> loss_fn = lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)
    >>> loss, grads, stats = nnx.jit(nnx_adaptive_value_and_grad(loss_fn))(
    ...     state, model, jnp.ones((1, 2), jnp.float16))
    >>> sorted(stats.amax)
    ['']
    """

    def pure(params, graphdef, rest, *args, **kwargs):
        copy = nnx.merge(graphdef, params, rest, copy=True)
        swapped = (_swap.install(modules(copy), _BASE_NAMES)
                   if _record.active() is not None else [])
        try:
            out = loss_fn(copy, *args, **kwargs)
        finally:
            _swap.uninstall(swapped)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, nnx.state(copy, nnx.Not(wrt)))

    core = _grad.adaptive_value_and_grad(pure, has_aux=True)

    def wrapped(opt_state, model, *args, **kwargs):
        graphdef, params, rest = nnx.split(model, wrt, ...)
        (loss, (aux, new_rest)), grads, stats = core(opt_state, params, graphdef, rest,
                                                       *args, **kwargs)
        nnx.update(model, new_rest)
        return ((loss, aux) if has_aux else loss), grads, stats

    return wrapped
