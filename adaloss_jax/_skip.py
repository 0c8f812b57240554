"""The exact skip both families use: the skipped-step signal a scaler's transformation
hands on, and :func:`skip_nonfinite`, which keeps the inner optimizer's state on it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from adaloss_jax._common import all_finite, all_of, check_fingerprint, fingerprint, select_tree


def signal_skip(updates: Any, applied: jax.Array) -> Any:
    """On a skipped step, ``-0.0`` everywhere: a zero gradient for any transformation
    after this one (nothing is poisoned), and a signal :func:`skip_nonfinite` recognises
    (no real gradient is negative zero in every element of every leaf)."""
    return jax.tree_util.tree_map(
        lambda u: jnp.where(applied, u, jnp.asarray(-0.0, u.dtype)), updates
    )


def is_skip_signal(tree: Any) -> jax.Array:
    """True iff ``tree`` is :func:`signal_skip`'s skipped-step signal (all ``-0.0``)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.asarray(False)
    return all_of([jnp.all((x == 0) & jnp.signbit(x)) for x in leaves])


@dataclasses.dataclass(frozen=True)
class SkipNonFiniteState:
    """State of :func:`skip_nonfinite`.

    Attributes:
      inner_state: the wrapped transformation's state.
      fingerprint: the parameter paths and ranks it was built for (static): updates of
        another model are refused with an error, not a broadcasting one deep inside the
        inner optimizer.

    >>> import optax
    >>> st = skip_nonfinite(optax.sgd(0.1)).init({"w": jnp.zeros(3)})
    >>> type(st.inner_state).__name__
    'tuple'
    """

    inner_state: Any
    fingerprint: str = dataclasses.field(default="", metadata={"static": True})


jax.tree_util.register_dataclass(SkipNonFiniteState, data_fields=["inner_state"],
                                 meta_fields=["fingerprint"])


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Applies ``inner`` only when the incoming updates are all finite and are not the
    skipped-step signal of :func:`unscale` / :func:`adaptive_unscale`.

    Otherwise the outgoing updates are zeros and ``inner``'s state is kept as it was
    (selected branch-free, so it is jit- and GPU-friendly): an exact skip. Unlike
    ``optax.apply_if_finite`` it never gives up after a number of failures; the
    counters live in the scaler's state.

    Args:
      inner: the optimizer to apply, e.g. ``optax.adamw(1e-3)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`SkipNonFiniteState`.

    Raises:
      ValueError: at trace time, for updates of another model than the state's.

    >>> import optax
    >>> tx = skip_nonfinite(optax.sgd(1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> tx.update({"w": jnp.array([1.0, jnp.nan])}, state)[0]["w"].tolist()
    [0.0, 0.0]
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(inner.init(params), fingerprint(params))

    def update_fn(updates, state, params=None, **extra_args):
        if state.fingerprint:
            check_fingerprint(state.fingerprint, updates, "the gradients",
                                     "pass the gradients of the parameters tx.init was called "
                                     "with, or re-run tx.init(params) for this model")
        ok = all_finite(updates) & ~is_skip_signal(updates)
        safe = jax.tree_util.tree_map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), updates)
        new_updates, new_inner = inner.update(safe, state.inner_state, params, **extra_args)
        new_updates = jax.tree_util.tree_map(
            lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates
        )
        return new_updates, SkipNonFiniteState(select_tree(ok, new_inner, state.inner_state),
                                               state.fingerprint)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


