"""Optax transformations for global loss scaling: unscale, skip, and the loss side.

Intended usage (all in one ``jax.jit``)::

    tx = optax.chain(adaloss_jax.unscale(adaloss_jax.dynamic()),
                     adaloss_jax.skip_nonfinite(optax.adamw(1e-3)))
    loss, grads, stats = adaloss_jax.value_and_grad(loss_fn)(opt_state, params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
    params = optax.apply_updates(params, updates)

Why two pieces and not ``optax.chain(unscale(...), optax.adamw(...))``: a transformation
in a chain cannot stop the ones after it from updating their state, and AdamW fed zeros
still decays its moments and counts the step. So ``unscale`` decides (finiteness of the
unscaled gradients and of the loss, reduced across ``axis_name``), updates the scale
state, and on a skipped step hands on NaN updates; ``skip_nonfinite`` around the inner
optimizer sees them and keeps the inner state and the parameters unchanged. Because the
decision travels in the updates, every device makes the same one without a second
collective. Forgetting ``skip_nonfinite`` is loud (NaN parameters), never silent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaloss_jax import _policies, _state
from adaloss_jax._policies import LossScaleState
from adaloss_jax._state import AdaptiveScaleState


def min_once(values: Sequence[jax.Array]) -> jax.Array:
    """The min of scalars, computed once in the compiled program.

    Not ``minimum(v0, minimum(v1, ...))`` (nor a reduction of their stack, which XLA
    rewrites into that chain): XLA copies a chain of scalar ops into every fusion that
    reads its result, so a value read in many places (a skip decision, read once per
    parameter leaf; a scale read by every conversion along a residual stream) grew the
    program quadratically, and the fusions, each with its own copy, could no longer
    share compiled kernels. A scatter into one slot is computed once and read as a
    scalar.
    """
    v = jnp.stack([jnp.asarray(x) for x in values])
    if v.shape[0] == 1:
        return v[0]
    return jax.ops.segment_min(v, jnp.zeros(v.shape, jnp.int32), 1, indices_are_sorted=True)[0]


def all_of(flags: Sequence[jax.Array]) -> jax.Array:
    """The AND of boolean scalars, computed once in the compiled program
    (:func:`min_once`)."""
    if not flags:
        return jnp.asarray(True)
    if len(flags) == 1:
        return jnp.asarray(flags[0], jnp.bool_)
    return min_once([jnp.asarray(f, jnp.bool_).astype(jnp.int32) for f in flags]) > 0


def all_finite(tree: Any, *, axis_name: str | None = None) -> jax.Array:
    """True iff every element of every leaf is finite (on every device of ``axis_name``).

    Under ``shard_map``/``pmap`` pass ``axis_name`` so all devices agree; under SPMD
    ``jit`` the arrays are global and nothing extra is needed.

    Args:
      tree: any pytree of arrays.
      axis_name: a mapped axis to agree across.

    Returns:
      A bool scalar.

    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = jax.tree_util.tree_leaves(tree)
    ok = all_of([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])
    if axis_name is not None:
        ok = jax.lax.pmin(ok.astype(jnp.int32), axis_name) > 0
    return ok


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Branch-free ``on_true if pred else on_false`` over matching pytrees.

    Args:
      pred: a bool scalar.
      on_true: a pytree, taken where ``pred`` holds.
      on_false: a pytree of the same structure, taken where it does not.

    Returns:
      The selected pytree (each leaf through ``jnp.where``).

    >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
    [0.0, 0.0]
    """
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


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


def _to_fp32(g: jax.Array) -> jax.Array:
    # Unscaling in fp16 would flush exactly the small values scaling protected.
    return g.astype(jnp.promote_types(g.dtype, jnp.float32))


class LossScaleStats(NamedTuple):
    """What :func:`value_and_grad` hands to :func:`unscale` with the scaled gradients.

    Attributes:
      loss_scale: the scale the loss was multiplied by (the gradients are unscaled by it).

    Passing it is what tells :func:`unscale` the gradients were scaled: gradients of an
    unscaled loss (plain ``jax.grad``) would otherwise be divided by the loss scale once
    too often, silently. To scale a loss by hand, differentiate :func:`scale_loss` and
    pass ``LossScaleStats(loss_scale=scale_state(opt_state).loss_scale)``.

    >>> LossScaleStats(loss_scale=jnp.float32(1024.0)).loss_scale.item()
    1024.0
    """

    loss_scale: jax.Array


def unscale(
    scaler: _policies.GlobalScaler, *, axis_name: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """Unscales gradients, checks finiteness and updates the loss scale.

    Call ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with the
    outputs of :func:`value_and_grad`. Per step, with ``s = stats.loss_scale`` (the scale
    the gradients were computed at)::

        updates = fp32(grads) / s
        loss_finite = isfinite(loss)            # True when no loss= is passed
        applied = all_finite(updates) and loss_finite   # reduced over axis_name
        state = scaler.adjust(state, all_finite(updates), loss_finite)
        if not applied: updates = -0.0 everywhere (the skip signal for skip_nonfinite)

    Pass the unscaled loss as ``loss=``: a non-finite loss (the forward pass overflowed)
    then skips the step without backing the scale off, since a smaller scale cannot fix
    the forward pass. Without ``loss=`` such a step is treated as a gradient overflow.

    On a skipped step the updates are ``-0.0`` (:func:`signal_skip`): the transformations
    after this one see a zero gradient, so nothing is poisoned, but a stateful optimizer
    still takes a step (Adam's moments decay and its momentum moves the parameters).
    Wrap them in :func:`skip_nonfinite` (or use :func:`loss_scaled`) to skip exactly.

    Args:
      scaler: a scaler from :func:`dynamic`, :func:`static` or :func:`no_scaling`.
      axis_name: mapped axis to agree on finiteness across (``shard_map``/``pmap``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LossScaleState`.

    Raises:
      TypeError: for an adaptive scaler (it goes with ``adaptive_unscale``).
      ValueError: at trace time, without ``scale_stats`` (the gradients may be of an
        unscaled loss).

    >>> import optax
    >>> tx = optax.chain(unscale(_policies.static(4.0)), skip_nonfinite(optax.sgd(1.0)))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> stats = LossScaleStats(loss_scale=jnp.float32(4.0))
    >>> updates, state = tx.update({"w": jnp.array([4.0, 8.0])}, state, loss=jnp.array(1.0),
    ...                            scale_stats=stats)
    >>> updates["w"].tolist(), bool(scale_state(state).last_applied)
    ([-1.0, -2.0], True)
    """
    if not isinstance(scaler, _policies.GlobalScaler):
        raise TypeError(
            f"scaler must be a global scaler from adaloss_jax.dynamic(), static() or "
            f"no_scaling(), got {scaler!r} of type {type(scaler).__name__} (an "
            f"adaloss_jax.adaptive() scaler goes with adaptive_unscale)"
        )

    def init_fn(params):
        del params
        return scaler.init()

    def update_fn(updates, state, params=None, *, loss=None, scale_stats=None, **extra_args):
        del params, extra_args
        if not isinstance(scale_stats, LossScaleStats):
            raise ValueError(
                f"unscale needs scale_stats=... (got {type(scale_stats).__name__}): the "
                f"statistics adaloss_jax.value_and_grad returns with the scaled gradients, as "
                f"in tx.update(grads, opt_state, params, loss=loss, scale_stats=stats). "
                f"Gradients of an unscaled loss (plain jax.grad) would be divided by the loss "
                f"scale all the same; to scale a loss by hand, differentiate "
                f"adaloss_jax.scale_loss and pass adaloss_jax.LossScaleStats(loss_scale=...)")
        inv = 1.0 / scale_stats.loss_scale
        updates = jax.tree_util.tree_map(lambda g: _to_fp32(g) * inv, updates)
        grads_finite = all_finite(updates, axis_name=axis_name)
        if loss is None:
            loss_finite = jnp.asarray(True)
        else:
            loss_finite = all_finite(loss, axis_name=axis_name)
        new_state = scaler.adjust(state, grads_finite, loss_finite)
        return signal_skip(updates, new_state.last_applied), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
        return SkipNonFiniteState(inner.init(params), _state.fingerprint(params))

    def update_fn(updates, state, params=None, **extra_args):
        if state.fingerprint:
            _state.check_fingerprint(state.fingerprint, updates, "the gradients",
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


def loss_scaled(
    inner: optax.GradientTransformation,
    scaler: _policies.GlobalScaler,
    *,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(unscale(scaler, axis_name=...), skip_nonfinite(inner))``: global loss
    scaling with the exact skip.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      scaler: ``dynamic(...)``, ``static(...)`` or ``no_scaling()``.
      axis_name: as for :func:`unscale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; use it with :func:`value_and_grad`.

    >>> import optax
    >>> tx = loss_scaled(optax.sgd(0.5), _policies.dynamic(initial_scale=2.0**10))
    >>> float(scale_state(tx.init({"w": jnp.zeros(2)})).loss_scale)
    1024.0
    """
    return optax.chain(unscale(scaler, axis_name=axis_name), skip_nonfinite(inner))


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

    >>> import optax
    >>> tx = loss_scaled(optax.sgd(0.1), _policies.static(8.0))
    >>> float(scale_state(tx.init({"w": jnp.zeros(2)})).loss_scale)
    8.0
    """
    kinds = (LossScaleState, AdaptiveScaleState)
    found = [x for x in jax.tree_util.tree_leaves(_plain(tree),
                                                  is_leaf=lambda x: isinstance(x, kinds))
             if isinstance(x, kinds)]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one scaler state in the optimizer state, found {len(found)}; "
            f"build the optimizer with adaloss_jax.loss_scaled(inner, scaler) (global) or "
            f"adaloss_jax.adaptive_scaled(inner, adaloss_jax.adaptive(...)) and pass its state")
    return found[0]


REVERSED_CHAIN = (
    "the scaler's transformation is not first in the optimizer chain: {before} before "
    "it see the scaled gradients, and it unscales their output instead of the gradients, "
    "so every step is wrong (with the optimizer first, training stays stuck). Put the "
    "scaler first: optax.chain(adaloss_jax.{unscale}(...), inner), or "
    "adaloss_jax.{scaled}(inner, scaler)")


ACCUMULATED_OUTSIDE = (
    "optax.MultiSteps wraps the scaler's transformation: it would accumulate *scaled* "
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
    kinds = (LossScaleState, _state.AdaptiveScaleState)
    node = _plain(tree)
    paths = [p for p, x in jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: isinstance(x, kinds))[0] if isinstance(x, kinds)]
    adaptive = isinstance(found, _state.AdaptiveScaleState)
    for key in paths[0] if paths else ():
        if isinstance(node, optax.MultiStepsState):
            raise ValueError(ACCUMULATED_OUTSIDE.format(
                scaled="adaptive_scaled" if adaptive else "loss_scaled"))
        if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey) and key.idx:
            raise ValueError(REVERSED_CHAIN.format(
                before=f"{key.idx} transformation(s) (states: {_state_names(node[:key.idx])})",
                unscale="adaptive_unscale" if adaptive else "unscale",
                scaled="adaptive_scaled" if adaptive else "loss_scaled"))
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


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``fp32(loss) * loss_scale``: what to differentiate instead of the loss, for code
    that takes its own gradients (:func:`value_and_grad` does this for you).

    Args:
      loss: the unscaled loss.
      opt_state: the optimizer state holding the scaler's state.

    Returns:
      The scaled loss, fp32. Pass ``LossScaleStats(loss_scale=scale_state(opt_state)
      .loss_scale)`` to ``tx.update`` with its gradients.

    >>> import optax
    >>> state = loss_scaled(optax.sgd(0.1), _policies.static(8.0)).init({"w": jnp.zeros(2)})
    >>> float(scale_loss(jnp.float16(0.5), state))
    4.0
    """
    return _to_fp32(jnp.asarray(loss)) * scale_state(opt_state).loss_scale


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, LossScaleStats]]:
    """``jax.value_and_grad`` with the loss scaled by the optimizer state's scale.

    Args:
      fun: the loss, ``fun(*args) -> loss`` (or ``(loss, aux)``).
      argnums: the arguments to differentiate, as in ``jax.value_and_grad``.
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      ``g(opt_state, *args) -> (value, grads, stats)``: the *unscaled* loss (or
      ``(loss, aux)``), the *scaled* gradients and the :class:`LossScaleStats` that
      :func:`unscale` needs: ``tx.update(grads, opt_state, params, loss=loss,
      scale_stats=stats)``.

    Raises:
      TypeError: (from ``g``) for the state of an adaptive scaler, whose gradients
        :func:`adaloss_jax.adaptive_value_and_grad` computes.

    >>> import optax
    >>> tx = loss_scaled(optax.sgd(1.0), _policies.static(4.0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss, grads, stats = value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
    >>> grads["w"].tolist(), tx.update(grads, state, params, scale_stats=stats)[0]["w"].tolist()
    ([8.0, 8.0], [-2.0, -2.0])
    """

    def wrapped(opt_state, *args, **kwargs):
        state = training_state(opt_state)
        if isinstance(state, _state.AdaptiveScaleState):
            raise TypeError(
                "value_and_grad scales the loss by one global scale, and this optimizer "
                "state holds per-group adaptive scales; use "
                "adaloss_jax.adaptive_value_and_grad(fun) with adaptive_unscale")
        scale = state.loss_scale

        def scaled(*a, **k):
            out = fun(*a, **k)
            loss, aux = out if has_aux else (out, None)
            return _to_fp32(jnp.asarray(loss)) * scale, (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(
            *args, **kwargs
        )
        return ((loss, aux) if has_aux else loss), grads, LossScaleStats(loss_scale=scale)

    return wrapped
