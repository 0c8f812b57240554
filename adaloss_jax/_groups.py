"""Scale groups of a parameter tree: which modules own parameters, which may be a stack of
layers run by a scan (a scale per layer), and which group each leaf belongs to."""

from __future__ import annotations

from typing import Any

import jax

from adaloss_jax import (
    _record,
    _tree,
)
from adaloss_jax._adaptive_scaler import AdaptiveScale
from adaloss_jax._layout import check_names, layers, order
from adaloss_jax._tree import ROOT


def owner_paths(params, max_depth: int | None = None) -> set[tuple[str, ...]]:
    """The module paths that own leaves directly (the top level's own leaves excluded),
    cut at ``max_depth``."""
    return {p[:-1][:max_depth] for p in _tree.leaf_paths(params) if len(p) > 1}


def marked_above(params, max_depth: int | None = None) -> set[tuple[str, ...]]:
    """The paths marked with :func:`adaloss_jax.scale_group` that hold parameters only
    below them (``params["blk"] = {"a": ..., "b": ...}``): each is a group too, that a
    marked call takes for all the parameters under it (a framework's module at such a
    path is not, so a name marked elsewhere changes nothing for it)."""
    owners = owner_paths(params, max_depth)
    return {m[:max_depth] for m in _record.MARKED
            if m[:max_depth] not in owners
            and any(o[:len(m)] == m and len(o) > len(m) for o in owners)}


def param_groups(params: Any, scaler: AdaptiveScale) -> list[str]:
    """The scale groups of a parameter tree, in model order.

    The root and, with ``groups="module"``, every module that owns parameters directly
    (or through modules deeper than ``max_depth``), every name marked with
    :func:`adaloss_jax.scale_group` that holds parameters nested below it (used where a
    marked call takes them; hidden from the diagnostics until then), and for a group
    that may be a stack of layers run by a scan (docs: concepts, stacks of layers) a slot
    per layer, ``g[0]``, ``g[1]``, ...

    Args:
      params: the parameters (any pytree; a linen ``{"params": ...}`` collection is
        looked through).
      scaler: the :class:`~adaloss_jax.AdaptiveScale`.

    Returns:
      Group names; the root is ``""``.

    >>> import jax.numpy as jnp
    >>> p = {"Dense_0": {"kernel": jnp.ones((2, 2))}, "Dense_1": {"kernel": jnp.ones(2)}}
    >>> param_groups(p, AdaptiveScale(groups="module"))
    ['', 'Dense_0', 'Dense_1']
    """
    groups = {ROOT} | {scaler.group_of(o) for o in owner_paths(params) | marked_above(params)}
    for g, n in stack_lengths(params, scaler).items():
        groups |= set(layers(g, n))
    check_names(list(groups))
    return order(groups)


MAX_STACK = 1024  # the deepest stack of layers that gets a scale per layer


def stack_lengths(params: Any, scaler: AdaptiveScale) -> dict[str, int]:
    """The groups that may be a stack of layers run by a scan, and their depth ``n``:
    every floating leaf of the group has at least two dimensions and the same leading
    one (``2 <= n <= MAX_STACK``), and the group holds a leaf of three or more
    dimensions or several leaves (one matrix alone, a plain layer's weight or an
    embedding, is not taken for a stack). Such a group gets a slot ``g[i]`` per layer
    besides its own scale: the gradient function uses the slots where the trace shows
    the leaves scanned over, and the group's own scale anywhere else."""
    if scaler.groups != "module":
        return {}
    shapes: dict[str, list] = {}
    marked = marked_above(params)
    for path, leaf in zip(_tree.leaf_paths(params), jax.tree_util.tree_leaves(params)):
        if len(path) > 1 and _tree.is_float(leaf):
            for owner in [path[:-1]] + [m for m in marked if path[:len(m)] == m]:
                shapes.setdefault(scaler.group_of(owner), []).append(
                    tuple(getattr(leaf, "shape", ())))
    out = {}
    for g, ss in shapes.items():
        lead = {s[0] if len(s) >= 2 else None for s in ss}
        n = next(iter(lead))
        if (len(lead) == 1 and n is not None and 2 <= n <= MAX_STACK
                and (len(ss) > 1 or len(ss[0]) >= 3)):
            out[g] = n
    return out


def leaf_group(path: tuple[str, ...], active, scaler: AdaptiveScale) -> str:
    """The group a parameter leaf at ``path`` belongs to: its nearest enclosing module
    among the ``active`` groups, else the root."""
    owner = path[:-1]
    for i in range(len(owner), 0, -1):
        g = scaler.group_of(owner[:i])
        if g in active:
            return g
    return ROOT
