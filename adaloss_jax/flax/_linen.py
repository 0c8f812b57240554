"""Flax linen ``TrainState`` with loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax.training import train_state

from adaloss_jax import _adaptive, _common, _global_transforms, _grad, _lookup
from adaloss_jax._adaptive_scaler import AdaptiveScale
from adaloss_jax._state import AdaptiveScaleState


def scaled_tx(tx: optax.GradientTransformation, scaler, axis_name) -> optax.GradientTransformation:
    """``tx`` behind the unscale and exact skip of ``scaler`` (global or adaptive); ``tx``
    itself when ``scaler`` is None (it must then hold an unscale)."""
    if isinstance(scaler, AdaptiveScale):
        return _adaptive.adaptive_scaled(tx, scaler, axis_name=axis_name)
    if scaler is not None:
        return _global_transforms.loss_scaled(tx, scaler, axis_name=axis_name)
    if axis_name is not None:
        raise ValueError(
            "axis_name is only used together with scaler=...; when tx already contains "
            "adaloss_jax.unscale (or adaptive_unscale), pass axis_name to it instead")
    return tx


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` whose optimizer does loss scaling.

    Build it with ``TrainState.create(apply_fn=..., params=..., tx=optax.adamw(1e-3),
    scaler=...)``: ``tx`` is wrapped as ``loss_scaled(tx, scaler)`` for a global scaler
    (``adaloss_jax.dynamic()``) and as ``adaptive_scaled(tx, scaler)`` for an adaptive one
    (``adaloss_jax.adaptive(...)``). Pass ``scaler=None`` when ``tx`` already holds an
    unscale. :func:`linen_train_step` does the whole step.

    ``apply_gradients(grads=..., loss=..., scale_stats=...)`` unscales, checks
    finiteness, updates the scale and applies the update only when it is finite; ``step``
    counts every call, ``scale_state.total_applied`` the applied ones.

    Attributes:
      step, apply_fn, params, tx, opt_state: as flax's ``TrainState``; ``opt_state``
        holds the scaler's state (``scale_state``).

    >>> import jax, jax.numpy as jnp, optax
    >>> import adaloss_jax as alj
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)},
    ...                           tx=optax.sgd(0.1), scaler=alj.dynamic(initial_scale=8.0))
    >>> float(state.scale_state.loss_scale)
    8.0
    """

    @classmethod
    def create(cls, *, apply_fn, params, tx, scaler=None, axis_name=None, **kwargs):
        """Args: as flax's ``TrainState.create``, plus ``scaler`` and ``axis_name`` (see
        :func:`adaloss_jax.unscale`). Raises ``ValueError`` if no scaler state results."""
        state = super().create(apply_fn=apply_fn, params=params,
                               tx=scaled_tx(tx, scaler, axis_name), **kwargs)
        _lookup.training_state(state.opt_state)  # fail now: no unscale(), or not first
        return state

    @property
    def scale_state(self):
        """The scaler's state (:func:`adaloss_jax.scale_state`)."""
        return _lookup.scale_state(self.opt_state)

    @property
    def loss_scale_state(self):
        """Deprecated name of :attr:`scale_state` (until 0.4)."""
        _common.warn_renamed("TrainState.loss_scale_state", "TrainState.scale_state")
        return self.scale_state

    def apply_gradients(self, *, grads, loss=None, scale_stats=None, **kwargs):
        """Applies *scaled* gradients with the ``scale_stats`` the gradient function
        returned with them; pass the unscaled ``loss`` to tell a forward overflow (skip,
        keep the scale) from a gradient overflow (skip, back off)."""
        extra = {} if scale_stats is None else {"scale_stats": scale_stats}
        updates, new_opt_state = self.tx.update(
            grads, self.opt_state, self.params, loss=loss, **extra
        )
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=new_opt_state,
            **kwargs,
        )


def linen_train_step(
    state: TrainState,
    loss_fn: Callable[..., Any],
    *args,
    has_aux: bool = False,
    **kwargs,
) -> tuple[TrainState, dict[str, Any]]:
    """One loss-scaled step: scale -> grad -> unscale -> finite check -> update.

    Call it inside your ``jax.jit``; a global or an adaptive scaler alike (whichever the
    state's optimizer holds).

    Args:
      state: a :class:`TrainState`.
      loss_fn: ``loss_fn(params, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
      *args: the batch.
      **kwargs: keyword arguments of ``loss_fn``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      The new state and metrics: ``loss`` (unscaled), ``applied`` (bool),
      ``loss_scale`` (the scale the loss was multiplied by; the root scale with adaptive
      scaling) and ``aux`` when ``has_aux``.

    >>> import jax, jax.numpy as jnp, optax
    >>> import adaloss_jax as alj
    >>> loss_fn = lambda p, x: jnp.sum((x @ p["w"]) ** 2)
    >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones((2, 1))},
    ...                           tx=optax.sgd(0.1), scaler=alj.dynamic())
    >>> step = jax.jit(lambda s, x: linen_train_step(s, loss_fn, x))
    >>> state, metrics = step(state, jnp.ones((1, 2)))
    >>> float(metrics["loss"]), bool(metrics["applied"])
    (4.0, True)
    """
    scale_used = state.scale_state.loss_scale
    if isinstance(state.scale_state, AdaptiveScaleState):
        value, grads, stats = _grad.adaptive_value_and_grad(loss_fn, has_aux=has_aux)(
            state.opt_state, state.params, *args, **kwargs)
    else:
        value, grads, stats = _global_transforms.value_and_grad(loss_fn, has_aux=has_aux)(
            state.opt_state, state.params, *args, **kwargs)
    loss, aux = value if has_aux else (value, None)
    state = state.apply_gradients(grads=grads, loss=jnp.asarray(loss), scale_stats=stats)
    metrics = {"loss": loss, "applied": state.scale_state.last_applied,
               "loss_scale": scale_used}
    if has_aux:
        metrics["aux"] = aux
    return state, metrics


__all__ = ["TrainState", "linen_train_step"]
