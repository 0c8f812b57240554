"""Taps on module outputs: the mechanism that reaches activation cotangents.

A tap sees every floating-point output leaf of every selected module call and may
replace it (add a zero perturbation, wrap it in a ``custom_vjp`` identity). Nothing in
the user's model changes. Taps are a receiver of the calls the adaptive front ends
report (:func:`adaloss_jax._record.report`): linen calls through the same method
interceptor, NNX submodules of a *merged copy* (made inside the traced function)
through the same class swap, and pure-JAX functions marked with
:func:`adaloss_jax.scale_group`.

Keys name the module by its path, as scale groups are named (``"block_0/attn/qkv"``;
the root, the model itself, is ``""``); the n-th further call of the same module gets
``"#n"`` appended, and a module returning a pytree gets the leaf's path appended
(``"block_0[0]"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from adaloss_jax import _record, _swap, _tree

ROOT = _tree.ROOT

# A leaf tap: (key, output leaf) -> new leaf of the same shape and dtype.
LeafTap = Callable[[str, jax.Array], jax.Array]
# A module filter: (path as a tuple of names, module) -> bool.
ModuleFilter = Callable[[tuple, Any], bool]


class Taps(_record.Receiver):
    """Applies a leaf tap to the outputs of the selected calls and numbers repeats."""

    def __init__(self, leaf_tap: LeafTap, filter: ModuleFilter | None = None):
        self.leaf_tap = leaf_tap
        self.filter = filter
        self.calls: dict[str, int] = {}

    def wrap(self, path, module, next_fun, args, kwargs):
        out = next_fun(*args, **kwargs)
        if self.filter is not None and not self.filter(tuple(path), module):
            return out
        base = _tree.name(path)
        n = self.calls.get(base, 0)
        self.calls[base] = n + 1
        if n:
            base = f"{base}#{n}"
        leaves, treedef = jax.tree_util.tree_flatten_with_path(out)
        new = []
        for kp, leaf in leaves:
            if isinstance(leaf, jax.Array) and _tree.is_float(leaf):
                leaf = self.leaf_tap(base + jax.tree_util.keystr(kp), leaf)
            new.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, new)


@contextlib.contextmanager
def taps(leaf_tap: LeafTap, filter: ModuleFilter | None = None) -> Iterator[None]:
    """Within the context, the output of every selected linen module method call and of
    every :func:`~adaloss_jax.scale_group` function goes through ``leaf_tap``.

    Args:
      leaf_tap: ``(key, leaf) -> leaf``, called while tracing.
      filter: ``(module_path, module) -> bool`` (``module`` is None for a
        ``scale_group`` function); all calls when None.

    Returns:
      A context manager.

    >>> import jax.numpy as jnp, adaloss_jax as alj
    >>> seen = []
    >>> f = alj.scale_group("double")(lambda x: 2 * x)
    >>> with taps(lambda key, leaf: seen.append(key) or leaf):
    ...     _ = f(jnp.ones(2))
    >>> seen
    ['double']
    """
    with Taps(leaf_tap, filter), _record.hooks():
        yield


@contextlib.contextmanager
def nnx_taps(
    model: Any, leaf_tap: LeafTap, filter: ModuleFilter | None = None
) -> Iterator[None]:
    """Taps the outputs of ``model``'s submodules (and its own) within the context.

    Call it only on a copy made inside the traced function (``nnx.merge`` of a split),
    never on the user's live model: within the context the copy's modules have the
    reporting subclass of :mod:`adaloss_jax._swap` (their classes are restored on exit).

    Args:
      model: a private copy of the NNX model.
      leaf_tap: ``(key, leaf) -> leaf``, called while tracing.
      filter: ``(module_path, module) -> bool``; all modules when None.

    Returns:
      A context manager.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> graphdef, state = nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    >>> copy, seen = nnx.merge(graphdef, state), []
    >>> with nnx_taps(copy, lambda key, leaf: seen.append(key) or leaf):
    ...     _ = copy(jnp.ones((1, 2)))
    >>> seen
    ['']
    """
    from adaloss_jax.flax import _nnx_adaptive

    swapped = _swap.install(_nnx_adaptive.modules(model), _nnx_adaptive._BASE_NAMES)
    try:
        with Taps(leaf_tap, filter):
            yield
    finally:
        _swap.uninstall(swapped)
