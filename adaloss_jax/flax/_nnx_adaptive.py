"""Adaptive per-layer loss scaling for Flax NNX models.

NNX has no method interceptor, so the scale points are put in by giving every submodule
of a *copy* of the model (``nnx.merge`` of a split, made inside the traced function) a
subclass whose public methods run through the same interceptor the linen integration
uses. The user's model object is never modified. Submodules are keyed by their first
path in the object graph, so a module shared between two places is one scale group,
as its parameters are one set.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flax import nnx

from adaloss_jax import _adaptive

_LOCAL = threading.local()
_SUBCLASSES: dict[type, type] = {}
_BASE_NAMES = set(dir(nnx.Module))


def _active():
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def _scaled_method(cls: type, name: str):
    original = getattr(cls, name)

    def method(self, *args, **kwargs):
        ctx = _active()
        path = None if ctx is None else ctx[1].get(id(self))
        if path is None:
            return original(self, *args, **kwargs)
        return ctx[0].wrap(path, self, lambda *a, **k: original(self, *a, **k), args, kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    return method


def _scaled_class(cls: type) -> type:
    if cls in _SUBCLASSES.values():
        return cls
    if cls not in _SUBCLASSES:
        names = set()
        for klass in cls.__mro__:
            for name, value in vars(klass).items():
                public = name == "__call__" or not name.startswith("_")
                plain = callable(value) and not isinstance(value, staticmethod | classmethod | type)
                if public and plain and name not in _BASE_NAMES:
                    names.add(name)
        attrs = {n: _scaled_method(cls, n) for n in names if hasattr(cls, n)}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), attrs)
    return _SUBCLASSES[cls]


def _install(model: nnx.Module) -> tuple[dict[int, tuple[str, ...]], list]:
    """Swaps the classes of ``model``'s modules (a private copy!) and maps id -> path.

    Returns the map and the ``(module, original class)`` pairs for :func:`_uninstall`.
    """
    paths: dict[int, tuple[str, ...]] = {}
    swapped = []
    for path, sub in nnx.iter_graph(model):
        if isinstance(sub, nnx.Module) and id(sub) not in paths:
            paths[id(sub)] = tuple(str(k) for k in path)
            swapped.append((sub, type(sub)))
            object.__setattr__(sub, "__class__", _scaled_class(type(sub)))
    return paths, swapped


def _uninstall(swapped) -> None:
    for sub, cls in swapped:
        object.__setattr__(sub, "__class__", cls)


def nnx_adaptive_value_and_grad(
    loss_fn: Callable[..., Any],
    scaler: _adaptive.AdaptiveScale,
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, dict]]:
    """NNX counterpart of :func:`adaloss_jax.adaptive_value_and_grad`.

    Returns ``g(opt_state, model, *args, **kwargs) -> (value, grads, stats)`` with
    ``loss_fn(model, *args, **kwargs)``; ``grads`` is an ``nnx.State`` of the ``wrt``
    variables (scaled per group) for ``optimizer.update(model, grads, loss=loss,
    scale_stats=stats)``. Non-parameter state the loss changes (batch statistics, RNG
    counters) is written back to ``model``. Call it inside ``nnx.jit``.
    """
    _adaptive._check_scaler(scaler)

    def wrapped(opt_state, model, *args, **kwargs):
        state = _adaptive.adaptive_state(opt_state)
        log2 = state.log2_scales
        dummies = _adaptive._dummies(nnx.state(model, wrt), scaler)
        used: set[str] = set()

        def scaled(copy, dummies):
            # Inside nnx.value_and_grad ``copy`` is NNX's own merged copy of the model:
            # swapping its classes leaves the user's objects alone, and NNX writes the
            # non-parameter state the loss changes (batch statistics) back to ``model``.
            paths, swapped = _install(copy)
            icpt = _adaptive._Interceptor(scaler, log2, dummies)
            stack = getattr(_LOCAL, "stack", None)
            if stack is None:
                stack = _LOCAL.stack = []
            stack.append((icpt, paths))
            try:
                out = loss_fn(copy, *args, **kwargs)
            finally:
                stack.pop()
                _uninstall(swapped)  # NNX checks the node types on the way out
            icpt.check()
            used.update(icpt.used)
            loss, aux = out if has_aux else (out, None)
            loss32 = jnp.asarray(loss).astype(jnp.float32)
            return loss32 * _adaptive.pow2(log2[_adaptive.ROOT]), (loss, aux)

        grad_fn = nnx.value_and_grad(
            scaled, argnums=(nnx.DiffState(0, wrt), 1), has_aux=True
        )
        (_, (loss, aux)), (grads, stats) = grad_fn(model, dummies)
        stats = _adaptive._used_stats(stats, used)
        return ((loss, aux) if has_aux else loss), grads, stats

    return wrapped
