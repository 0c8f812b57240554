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

import threading
from collections.abc import Callable
from typing import Any

from flax import nnx

from adaloss_jax import _adaptive

_LOCAL = threading.local()
_SUBCLASSES: dict[tuple[type, tuple[str, ...]], type] = {}
_BASE_NAMES = set(dir(nnx.Module))


def _active():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _scaled_method(cls: type, name: str):
    original = getattr(cls, name)

    def method(self, *args, **kwargs):
        points = _active()
        if points is None:
            return original(self, *args, **kwargs)
        return points.wrap(type(self)._adaloss_path, self,
                           lambda *a, **k: original(self, *a, **k), args, kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    return method


def _scaled_class(cls: type, path: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose public methods report their calls as ``path``. The
    path lives in the class, so it survives NNX's own split/merge inside ``nnx.scan``,
    ``nnx.remat``, ``nnx.vmap`` and friends (a graphdef records the class)."""
    key = (cls, path)
    if key not in _SUBCLASSES:
        names = set()
        for klass in cls.__mro__:
            for name, value in vars(klass).items():
                public = name == "__call__" or not name.startswith("_")
                plain = callable(value) and not isinstance(value, staticmethod | classmethod | type)
                if public and plain and name not in _BASE_NAMES:
                    names.add(name)
        attrs = {n: _scaled_method(cls, n) for n in names if hasattr(cls, n)}
        attrs["_adaloss_path"] = path
        _SUBCLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _SUBCLASSES[key]


def _install(model: nnx.Module) -> list:
    """Swaps the classes of ``model``'s modules (a private copy!) for subclasses that know
    their path (a module shared between two places: its first path); returns the
    ``(module, original class)`` pairs for :func:`_uninstall`."""
    swapped, seen = [], set()
    for path, sub in nnx.iter_graph(model):
        if isinstance(sub, nnx.Module) and id(sub) not in seen:
            seen.add(id(sub))
            swapped.append((sub, type(sub)))
            cls = _scaled_class(type(sub), tuple(str(k) for k in path))
            object.__setattr__(sub, "__class__", cls)
    return swapped


def _uninstall(swapped) -> None:
    for sub, cls in swapped:
        object.__setattr__(sub, "__class__", cls)


class _Hook:
    """Context under which the copies made by the pure loss report to ``points``."""

    def __init__(self, points):
        self.ctx = points

    def __enter__(self):
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(self.ctx)

    def __exit__(self, *exc):
        _LOCAL.stack.pop()


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
        swapped = _install(copy) if _active() is not None else []
        try:
            out = loss_fn(copy, *args, **kwargs)
        finally:
            _uninstall(swapped)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, nnx.state(copy, nnx.Not(wrt)))

    core = _adaptive.adaptive_value_and_grad(pure, scaler, has_aux=True,
                                             hooks=[_Hook] + _adaptive._front_end_hooks(),
                                             cache_token=("nnx", loss_fn, str(wrt), has_aux))

    def wrapped(opt_state, model, *args, **kwargs):
        graphdef, params, rest = nnx.split(model, wrt, ...)
        (loss, (aux, new_rest)), grads, stats = core(opt_state, params, graphdef, rest,
                                                       *args, **kwargs)
        nnx.update(model, new_rest)
        return ((loss, aux) if has_aux else loss), grads, stats

    wrapped.plans = core.plans
    return wrapped
