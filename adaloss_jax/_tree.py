"""Names and kinds of pytree leaves: the one place that says how a parameter, a module
or a scale group is named, and which values are floating.

A path is a tuple of strings (``("Block_0", "attn", "kernel")``); its name joins them with
``/`` (``"Block_0/attn"``). The root of a model, and the scale group of the loss, is
:data:`ROOT`, the empty name.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

ROOT = ""

# The anchor of the region holding the loss where its cotangent leaves only through the
# casts of the model's outputs (:func:`adaloss_jax._stream.analyse`): it runs at the
# loss's seed scale, the root group's scale from the state, while the root's own regions
# may choose theirs in the backward pass. No state group has this name.
SEED = "<seed>"


def state_group(anchor: str) -> str:
    """The state group an anchor's statistics count for: :data:`ROOT` for
    :data:`SEED`, else the anchor itself."""
    return ROOT if anchor == SEED else anchor


def key_name(key: Any) -> str:
    """A pytree key as a path component: a dict key, an attribute or an index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_of(keys: tuple) -> tuple[str, ...]:
    """The path of a leaf from its pytree key path.

    A linen variable collection at the top (``"params"``) and the ``.value`` attribute an
    NNX variable flattens to are not part of the name.
    """
    if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
        keys = keys[:-1]
    path = tuple(key_name(k) for k in keys)
    return path[1:] if path and path[0] == "params" else path


def leaf_paths(tree: Any) -> list[tuple[str, ...]]:
    """The path of every leaf of ``tree``, in ``jax.tree_util.tree_leaves`` order.

    >>> leaf_paths({"params": {"Dense_0": {"kernel": 1, "bias": 2}}})
    [('Dense_0', 'bias'), ('Dense_0', 'kernel')]
    """
    return [path_of(keys) for keys, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def name(path: tuple) -> str:
    """``("Block_0", "attn") -> "Block_0/attn"``; the empty path is :data:`ROOT`."""
    return "/".join(str(p) for p in path)


def natural(text: str) -> list:
    """Sort key that puts ``Dense_2`` before ``Dense_10`` (and the root first)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _dtype(x: Any):
    return getattr(getattr(x, "aval", x), "dtype", None)


def is_float(x: Any) -> bool:
    """Whether ``x`` (an array, a tracer, an abstract value or a jaxpr variable) holds
    real floating-point values: what scale points scale and measure."""
    dtype = _dtype(x)
    try:
        return dtype is not None and jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def is_differentiable(x: Any) -> bool:
    """Whether ``x`` carries a cotangent (floating or complex values): what joins the
    regions of the backward stream."""
    dtype = _dtype(x)
    try:
        return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)
    except TypeError:
        return False
