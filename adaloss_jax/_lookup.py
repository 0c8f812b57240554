"""Finding the scaler's state inside an optimizer state, for either family.

Each family registers the class of its state (with the names of its transformations,
for the messages) where it defines that state; this module knows neither family, so
both can ask it for their state without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import optax


class _Kind(NamedTuple):
    unscale: str  # the transformation that holds the state
    scaled: str  # the one-call wrapper around an inner optimizer


_KINDS: dict[type, _Kind] = {}


def register(kind: type, *, unscale: str, scaled: str) -> None:
    """Makes ``kind`` a scaler state :func:`scale_state` finds; ``unscale`` and
    ``scaled`` name its family's transformations in the messages."""
    _KINDS[kind] = _Kind(unscale, scaled)


def _plain(tree: Any) -> Any:
    """An optimizer state as a user may hold it, as plain arrays: a ``TrainState`` (or any
    object with an ``opt_state``) stands for its ``opt_state``; variables that wrap an
    array (NNX's, which have ``get_value``) for their values."""
    if not isinstance(tree, tuple | list | dict) and hasattr(tree, "opt_state"):
        tree = tree.opt_state
    wrapped = lambda x: hasattr(x, "get_value") and not isinstance(x, jax.Array)
    if not any(wrapped(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=wrapped)):
        return tree
    return jax.tree_util.tree_map(lambda x: x.get_value() if wrapped(x) else x, tree,
                                  is_leaf=wrapped)


def _is_state(x: Any) -> bool:
    return isinstance(x, tuple(_KINDS))


NO_STATE = (
    "expected exactly one scaler state in the optimizer state, found {n}; build the "
    "optimizer with adaloss_jax.loss_scaled(inner, scaler) (global) or "
    "adaloss_jax.adaptive_scaled(inner, adaloss_jax.adaptive(...)) and pass its state")


def scale_state(tree: Any) -> Any:
    """The scaler's state inside an optimizer state: the one
    :class:`~adaloss_jax.LossScaleState` of a global scaler or
    :class:`~adaloss_jax.AdaptiveScaleState` of an adaptive one.

    Args:
      tree: an optimizer state, a flax ``TrainState``, an ``nnx.Optimizer`` (or its
        ``opt_state``), or a scaler state itself.

    Returns:
      The scaler state, as plain arrays. Both kinds read alike: ``loss_scale``,
      ``last_applied``, ``total_applied``, ``total_skipped``, ``notfinite_count``.

    Raises:
      ValueError: if there is no scaler state, or more than one.

    >>> import optax, jax.numpy as jnp, adaloss_jax as alj
    >>> tx = alj.loss_scaled(optax.sgd(0.1), alj.static(8.0))
    >>> float(scale_state(tx.init({"w": jnp.zeros(2)})).loss_scale)
    8.0
    """
    found = [x for x in jax.tree_util.tree_leaves(_plain(tree), is_leaf=_is_state)
             if _is_state(x)]
    if len(found) != 1:
        raise ValueError(NO_STATE.format(n=len(found)))
    return found[0]


REVERSED_CHAIN = (
    "the scaler's transformation is not first in the optimizer chain: {before} before "
    "it see the scaled gradients, and it unscales their output instead of the gradients, "
    "so every step is wrong (with the optimizer first, training stays stuck). Put the "
    "scaler first: optax.chain(adaloss_jax.{unscale}(...), inner), or "
    "adaloss_jax.{scaled}(inner, scaler)")


ACCUMULATED_OUTSIDE = (
    "optax.MultiSteps wraps the scaler's transformation: it would accumulate scaled "
    "gradients of microbatches computed at different scales and unscale their mean at the "
    "last one's (an overflow's inf would stay in its accumulator and skip every later "
    "window). Put the accumulation inside the scaling: "
    "adaloss_jax.{scaled}(optax.MultiSteps(inner, k).gradient_transformation(), scaler)")


def training_state(tree: Any) -> Any:
    """:func:`scale_state` for a training step: also an error when the scaler's
    transformation is not the first of the chain that holds it (what a transformation
    before it sees are the *scaled* gradients; ``optax.chain(inner, unscale)`` hands the
    unscale ``inner``'s updates). A chain's state is a plain ``tuple``; the check looks at
    the elements before the scaler's along its path (named containers are not chains).
    An ``optax.MultiSteps`` around the scaler is refused too (docs: gradient
    accumulation)."""
    found = scale_state(tree)
    names = _KINDS[next(k for k in _KINDS if isinstance(found, k))]
    node = _plain(tree)
    paths = [p for p, x in jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_state)[0]
             if _is_state(x)]
    for key in paths[0] if paths else ():
        if isinstance(node, optax.MultiStepsState):
            raise ValueError(ACCUMULATED_OUTSIDE.format(scaled=names.scaled))
        if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey) and key.idx:
            raise ValueError(REVERSED_CHAIN.format(
                before=f"{key.idx} transformation(s) (states: {_state_names(node[:key.idx])})",
                unscale=names.unscale, scaled=names.scaled))
        node = _child(node, key)
        if node is None:  # a container whose children the check cannot read: no chain
            break
    return found


def _state_names(states: tuple) -> str:
    named = lambda x: hasattr(x, "_fields") or dataclasses.is_dataclass(x)
    nodes = jax.tree_util.tree_leaves(states, is_leaf=named)
    names = list(dict.fromkeys(type(x).__name__ for x in nodes if named(x)))
    return ", ".join(names[:4]) or "none"


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    return None
