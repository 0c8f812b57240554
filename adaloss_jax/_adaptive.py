"""The Optax side of adaptive scaling: :func:`adaptive_unscale` unscales each parameter
leaf by the scale its group's gradients were computed at (:mod:`adaloss_jax._decide`),
checks finiteness, and sets the next scales with the pure rule of
:func:`adaloss_jax._rule.adjust` (or applies the verdict the gradient function's retries
reached); :func:`adaptive_scaled` puts it first in a chain with the exact skip. The
gradient function is :mod:`adaloss_jax._grad`'s, the groups :mod:`adaloss_jax._groups`'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from adaloss_jax import (
    _adaptive_scaler,
    _decide,
    _groups,
    _skip,
    _tree,
)
from adaloss_jax._adaptive_scaler import AdaptiveScale
from adaloss_jax._common import check_fingerprint
from adaloss_jax._state import (
    AdaptiveScaleState,
    Health,
    ScaleStats,
    initial_state,
)

OTHER_SCALER = (
    "this adaptive_unscale and the optimizer state were built with different scalers "
    "({diff}): re-run tx.init(params) with this transformation")
OTHER_STATE = (
    "scale_stats were measured with another optimizer state than the one given to update "
    "({diff}): pass the statistics that adaptive_value_and_grad returned for this same "
    "optimizer state, as in loss, grads, stats = adaptive_value_and_grad(loss_fn)("
    "opt_state, params, ...); tx.update(grads, opt_state, params, loss=loss, "
    "scale_stats=stats)")


NO_STATS = (
    "adaptive_unscale needs scale_stats=... (got {got}): the statistics that "
    "adaloss_jax.adaptive_value_and_grad returns with the scaled gradients, as in "
    "tx.update(grads, opt_state, params, loss=loss, scale_stats=stats). Gradients of an "
    "unscaled loss (plain jax.grad) need no adaptive_unscale; for a flax TrainState use "
    "adaloss_jax.flax.TrainState and linen_train_step")


def _short(groups: tuple) -> str:
    shown = ", ".join(repr(g) for g in groups[:5]) + (", ..." if len(groups) > 5 else "")
    return f"[{shown}] ({len(groups)} group{'s' * (len(groups) != 1)})"


def _check_update(state: AdaptiveScaleState, scaler: AdaptiveScale, updates,
                  stats) -> None:
    if not isinstance(stats, ScaleStats):
        raise ValueError(NO_STATS.format(got=type(stats).__name__))
    if state.scaler != scaler:
        raise ValueError(OTHER_SCALER.format(
            diff=_adaptive_scaler.differences(scaler, state.scaler,
                                              names=("transformation", "state"))))
    check_fingerprint(state.fingerprint, updates, "the gradients",
                      "pass the gradients of the parameters tx.init was called with, or "
                      "re-run tx.init(params) for this model")
    if stats.fingerprint:
        check_fingerprint(state.fingerprint, stats.fingerprint, "the scale_stats",
                          "pass the statistics adaptive_value_and_grad returned for this "
                          "model with this optimizer state")
    if stats.origin and stats.origin != (state.groups, state.scaler):
        groups, other = stats.origin
        diff = [] if groups == state.groups else [
            f"groups {_short(groups)} (statistics) vs {_short(state.groups)} (state)"]
        if other != state.scaler:
            diff.append(_adaptive_scaler.differences(other, state.scaler,
                                            names=("statistics", "state")))
        raise ValueError(OTHER_STATE.format(diff="; ".join(diff)))
    unknown = sorted(set(stats.log2_scales) - set(state.groups), key=_tree.natural)
    if unknown:
        raise ValueError(
            f"scale_stats has groups {unknown[:5]} that this optimizer state does not know "
            f"(state groups: {list(state.groups)[:8]}...); the state was built for another "
            f"model: re-run tx.init(params) for this one")


def adaptive_unscale(
    scaler: AdaptiveScale | None = None, *, axis_name: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """Unscales each parameter leaf by its own group's scale and sets the next scales.

    Use as ``optax.chain(adaptive_unscale(scaler), inner)`` (a skipped step hands
    ``inner`` a zero gradient) or, to skip exactly, :func:`adaptive_scaled`. Call
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with the
    outputs of :func:`adaptive_value_and_grad`. Per step::

        updates = fp32(grads) / S_k          # S_k: the scale leaf's group k was computed at
        state   = adjust(state, statistics)  # the rule: adaloss_jax._rule.adjust
        if not state.last_applied: updates = -0.0 everywhere   # the skip signal

    Args:
      scaler: the :class:`~adaloss_jax.AdaptiveScale` (default ``AdaptiveScale()``); the
        state keeps it, and :func:`adaptive_value_and_grad` reads it from there.
      axis_name: a mapped axis (``shard_map``/``pmap``) to reduce statistics and
        finiteness over, so every device picks the same scales and skip decision.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`~adaloss_jax.AdaptiveScaleState`.

    Raises:
      ValueError: at trace time, without ``scale_stats``, or for gradients, statistics
        or a state of another model or scaler.

    >>> import jax.numpy as jnp
    >>> tx = adaptive_unscale(AdaptiveScale(groups="module"))
    >>> state = tx.init({"Dense_0": {"kernel": jnp.ones((2, 2))}})
    >>> state.groups
    ('', 'Dense_0')
    """
    scaler = AdaptiveScale() if scaler is None else scaler
    _check_scaler(scaler)

    def init_fn(params):
        if not jax.tree_util.tree_leaves(params):
            raise ValueError(
                "params has no leaves: adaptive_unscale keys its scale groups by the modules "
                "that own parameters; pass the model's parameters to tx.init")
        return initial_state(params, scaler, _groups.param_groups(params, scaler)).replace(
            axis_name=axis_name)

    def update_fn(updates, state, params=None, *, loss=None, scale_stats=None, **extra):
        del params, extra
        _check_update(state, scaler, updates, scale_stats)
        if scale_stats.verdict is None:
            state, _ = _decide.verdict(state, updates, scale_stats, loss, axis_name)
        else:  # decided inside the gradient function, after its retries
            verdict = dict(scale_stats.verdict)
            retries = _decide.over_devices(verdict.pop("retries"), jax.lax.pmax, axis_name)
            state = state.replace(**verdict, total_retries=state.total_retries + retries)
        handed = scale_stats.handed is not None and scale_stats.handed.same(
            jax.tree_util.tree_leaves(updates))  # the very arrays measured: nothing to check
        updates, received = _decide.unscale(updates, scale_stats, state)
        if scale_stats.grad_amax is not None and not handed:
            foreign = _decide.foreign(received, scale_stats.grad_amax, _decide.bound(axis_name))
            state = state.replace(
                health=state.health | jnp.where(foreign, Health.FOREIGN_GRADS, 0))
        return _skip.signal_skip(updates, state.base.last_applied), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adaptive_scaled(
    inner: optax.GradientTransformation,
    scaler: AdaptiveScale | None = None,
    *,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(adaptive_unscale(scaler), skip_nonfinite(inner))``: the exact skip.

    The literal ``optax.chain(adaptive_unscale(), inner)`` is safe too (a skipped step
    hands ``inner`` a zero gradient, never NaN), but ``inner`` still steps on it: Adam's
    moments decay and its momentum and weight decay move the parameters. Here a skipped
    step leaves the parameters and ``inner``'s state exactly as they were.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      scaler: the :class:`~adaloss_jax.AdaptiveScale` (default ``AdaptiveScale()``).
      axis_name: as for :func:`adaptive_unscale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    >>> import optax, jax.numpy as jnp
    >>> tx = adaptive_scaled(optax.adamw(1e-3), AdaptiveScale())
    >>> adaloss_state = tx.init({"w": jnp.ones(3)})[0]
    >>> float(adaloss_state.loss_scale)  # (fp16's start: 2**15)
    32768.0
    """
    return optax.chain(adaptive_unscale(scaler, axis_name=axis_name),
                       _skip.skip_nonfinite(inner))


def _check_scaler(scaler) -> None:
    if not isinstance(scaler, AdaptiveScale):
        raise TypeError(
            f"scaler must be an AdaptiveScale from adaloss_jax.adaptive(), got {scaler!r} of "
            f"type {type(scaler).__name__}")
