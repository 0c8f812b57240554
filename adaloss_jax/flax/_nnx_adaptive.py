"""The NNX front end of adaptive per-layer loss scaling.

NNX has no method interceptor, so the scale points are put in by giving every submodule
of a *copy* of the model (``nnx.merge`` of a split, made inside the traced function) a
subclass whose public methods report their calls to the scale points. The user's model
object is never modified. Submodules are keyed by their first path in the object graph,
so a module shared between two places is one scale group, as its parameters are one set.
The model is split into a pure function of its parameters, so the flax-free core does
the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from adaloss_jax import _adaptive, _points, _swap

_BASE_NAMES = frozenset(dir(nnx.Module))


def _modules(model: nnx.Module):
    for path, sub in nnx.iter_graph(model):
        if isinstance(sub, nnx.Module):
            yield tuple(str(k) for k in path), sub


def nnx_adaptive_value_and_grad(
    loss_fn: Callable[..., Any],
    scaler: _adaptive.AdaptiveScale | None = None,
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Any]]:
    """NNX counterpart of :func:`adaloss_jax.adaptive_value_and_grad`.

    Returns ``g(opt_state, model, *args, **kwargs) -> (value, grads, stats)`` with
    ``loss_fn(model, *args, **kwargs)``; ``grads`` is an ``nnx.State`` of the ``wrt``
    variables (scaled per group) for ``optimizer.update(model, grads, loss=loss,
    scale_stats=stats)``. Non-parameter state the loss changes (batch statistics, RNG
    counters) is written back to ``model``. Call it inside ``nnx.jit``.
    """
    scaler = _adaptive.AdaptiveScale() if scaler is None else scaler
    _adaptive._check_scaler(scaler)

    def pure(params, graphdef, rest, *args, **kwargs):
        copy = nnx.merge(graphdef, params, rest, copy=True)
        swapped = _swap.install(_modules(copy), _BASE_NAMES) if _points.active() is not None else []
        try:
            out = loss_fn(copy, *args, **kwargs)
        finally:
            _swap.uninstall(swapped)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, nnx.state(copy, nnx.Not(wrt)))

    core = _adaptive.adaptive_value_and_grad(pure, scaler, has_aux=True,
                                             hooks=_adaptive._front_end_hooks(),
                                             cache_token=("nnx", loss_fn, str(wrt), has_aux))

    def wrapped(opt_state, model, *args, **kwargs):
        graphdef, params, rest = nnx.split(model, wrt, ...)
        (loss, (aux, new_rest)), grads, stats = core(opt_state, params, graphdef, rest,
                                                       *args, **kwargs)
        nnx.update(model, new_rest)
        return ((loss, aux) if has_aux else loss), grads, stats

    wrapped.plans = core.plans
    return wrapped
