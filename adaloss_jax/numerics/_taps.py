"""Taps on module outputs: the mechanism that reaches activation cotangents.

A tap sees every floating-point output leaf of every selected module call and may
replace it (add a zero perturbation, wrap it in a ``custom_vjp`` identity). Nothing in
the user's model changes: linen calls are reached with ``nn.intercept_methods``; NNX
modules by giving the submodules of a *merged copy* (made inside the traced function)
a subclass whose ``__call__`` taps the output.

Keys name the module by its path (``"block_0/attn/qkv"``, ``"<root>"`` for the top
module); the n-th further call of the same module gets ``"#n"`` appended, and a module
returning a pytree gets the leaf's path appended (``"block_0[0]"``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

ROOT = "<root>"

# A leaf tap: (key, output leaf) -> new leaf of the same shape and dtype.
LeafTap = Callable[[str, jax.Array], jax.Array]
# A module filter: (path as a tuple of names, module) -> bool.
ModuleFilter = Callable[[tuple, Any], bool]


def path_name(path: tuple) -> str:
    """``("block_0", "attn")`` -> ``"block_0/attn"``; the empty path is ``"<root>"``."""
    return "/".join(str(p) for p in path) if path else ROOT


def keypath_name(keypath: tuple) -> str:
    """A pytree key path as ``a/b/0`` (dict keys, attributes and indices joined by ``/``)."""
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


def _is_float_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


class _Tapper:
    """Applies a leaf tap to a module's output and numbers repeated calls."""

    def __init__(self, leaf_tap: LeafTap):
        self.leaf_tap = leaf_tap
        self.calls: dict[str, int] = {}

    def __call__(self, path: tuple, out: Any) -> Any:
        base = path_name(path)
        n = self.calls.get(base, 0)
        self.calls[base] = n + 1
        if n:
            base = f"{base}#{n}"
        leaves, treedef = jax.tree_util.tree_flatten_with_path(out)
        new = []
        for kp, leaf in leaves:
            if _is_float_array(leaf):
                leaf = self.leaf_tap(base + jax.tree_util.keystr(kp), leaf)
            new.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, new)


@contextlib.contextmanager
def linen_taps(leaf_tap: LeafTap, filter: ModuleFilter | None = None) -> Iterator[None]:
    """Within the context, every selected linen ``__call__`` output goes through ``leaf_tap``.

    Args:
      leaf_tap: ``(key, leaf) -> leaf``, called while tracing.
      filter: ``(module_path, module) -> bool``; all modules when None.
    """
    tapper = _Tapper(leaf_tap)

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        module = context.module
        path = tuple(module.path)
        if filter is not None and not filter(path, module):
            return out
        return tapper(path, out)

    with nn.intercept_methods(interceptor):
        yield


# NNX: the tapped subclass of each module class, made once.
_TAPPED: dict[type, type] = {}
_ACTIVE = threading.local()


def _tapped_class(cls: type) -> type:
    if cls in _TAPPED:
        return _TAPPED[cls]

    def __call__(self, *args, **kwargs):
        out = cls.__call__(self, *args, **kwargs)
        stack = getattr(_ACTIVE, "stack", [])
        for tapper, keys in reversed(stack):
            if id(self) in keys:
                return tapper(keys[id(self)], out)
        return out

    tapped = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    _TAPPED[cls] = tapped
    return tapped


@contextlib.contextmanager
def nnx_taps(
    model: nnx.Module, leaf_tap: LeafTap, filter: ModuleFilter | None = None
) -> Iterator[None]:
    """Taps the outputs of ``model``'s submodules (and its own) within the context.

    Warning: this changes the class of ``model``'s submodules for good; call it only on
    a copy made inside the traced function (``nnx.merge`` of a split), never on the
    user's live model.
    """
    keys: dict[int, tuple] = {}
    for path, sub in nnx.iter_graph(model):
        if not isinstance(sub, nnx.Module):
            continue
        path = tuple(path)
        if filter is not None and not filter(path, sub):
            continue
        if id(sub) in keys:  # a module reachable by two paths keeps its first name
            continue
        keys[id(sub)] = path
        if type(sub) not in _TAPPED.values():
            object.__setattr__(sub, "__class__", _tapped_class(type(sub)))
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    entry = (_Tapper(leaf_tap), keys)
    stack.append(entry)
    try:
        yield
    finally:
        stack.remove(entry)
