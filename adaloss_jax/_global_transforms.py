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

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adaloss_jax import _global_scalers, _lookup
from adaloss_jax._common import LossScaleState, all_finite, to_fp32
from adaloss_jax._skip import signal_skip, skip_nonfinite

_lookup.register(LossScaleState, unscale="unscale", scaled="loss_scaled")


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
    scaler: _global_scalers.GlobalScaler, *, axis_name: str | None = None
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
    >>> tx = optax.chain(unscale(_global_scalers.static(4.0)), skip_nonfinite(optax.sgd(1.0)))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> stats = LossScaleStats(loss_scale=jnp.float32(4.0))
    >>> updates, state = tx.update({"w": jnp.array([4.0, 8.0])}, state, loss=jnp.array(1.0),
    ...                            scale_stats=stats)
    >>> updates["w"].tolist(), bool(_lookup.scale_state(state).last_applied)
    ([-1.0, -2.0], True)
    """
    if not isinstance(scaler, _global_scalers.GlobalScaler):
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
        updates = jax.tree_util.tree_map(lambda g: to_fp32(g) * inv, updates)
        grads_finite = all_finite(updates, axis_name=axis_name)
        if loss is None:
            loss_finite = jnp.asarray(True)
        else:
            loss_finite = all_finite(loss, axis_name=axis_name)
        new_state = scaler.adjust(state, grads_finite, loss_finite)
        return signal_skip(updates, new_state.last_applied), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def loss_scaled(
    inner: optax.GradientTransformation,
    scaler: _global_scalers.GlobalScaler,
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
    >>> tx = loss_scaled(optax.sgd(0.5), _global_scalers.dynamic(initial_scale=2.0**10))
    >>> float(_lookup.scale_state(tx.init({"w": jnp.zeros(2)})).loss_scale)
    1024.0
    """
    return optax.chain(unscale(scaler, axis_name=axis_name), skip_nonfinite(inner))


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
    >>> state = loss_scaled(optax.sgd(0.1), _global_scalers.static(8.0)).init({"w": jnp.zeros(2)})
    >>> float(scale_loss(jnp.float16(0.5), state))
    4.0
    """
    return to_fp32(jnp.asarray(loss)) * _lookup.scale_state(opt_state).loss_scale


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
    >>> tx = loss_scaled(optax.sgd(1.0), _global_scalers.static(4.0))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> loss, grads, stats = value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
    >>> grads["w"].tolist(), tx.update(grads, state, params, scale_stats=stats)[0]["w"].tolist()
    ([8.0, 8.0], [-2.0, -2.0])
    """

    def wrapped(opt_state, *args, **kwargs):
        state = _lookup.training_state(opt_state)
        if not isinstance(state, LossScaleState):
            raise TypeError(
                "value_and_grad scales the loss by one global scale, and this optimizer "
                "state holds per-group adaptive scales; use "
                "adaloss_jax.adaptive_value_and_grad(fun) with adaptive_unscale")
        scale = state.loss_scale

        def scaled(*a, **k):
            out = fun(*a, **k)
            loss, aux = out if has_aux else (out, None)
            return to_fp32(jnp.asarray(loss)) * scale, (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(
            *args, **kwargs
        )
        return ((loss, aux) if has_aux else loss), grads, LossScaleStats(loss_scale=scale)

    return wrapped
