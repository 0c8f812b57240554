"""Flax linen ``TrainState`` with loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax.training import train_state

from adaloss_jax import _adaptive, _transforms
from adaloss_jax._config import AdaptiveScale
from adaloss_jax._state import AdaptiveScaleState


def scaled_tx(tx: optax.GradientTransformation, scaler, axis_name) -> optax.GradientTransformation:
    """``tx`` behind the unscale and exact skip of ``scaler`` (global or adaptive); ``tx``
    itself when ``scaler`` is None (it must then hold an unscale)."""
    if isinstance(scaler, AdaptiveScale):
        return _adaptive.adaptive_scaled(tx, scaler, axis_name=axis_name)
    if scaler is not None:
        return _transforms.loss_scaled(tx, scaler, axis_name=axis_name)
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
    unscale. :func:`train_step` does the whole step.

    ``apply_gradients(grads=scaled_grads, loss=loss)`` unscales, checks finiteness,
    updates the scale and applies the update only when it is finite; ``step`` counts
    every call, ``loss_scale_state.total_applied`` the applied ones.
    """

    @classmethod
    def create(cls, *, apply_fn, params, tx, scaler=None, axis_name=None, **kwargs):
        """Args: as flax's ``TrainState.create``, plus ``scaler`` and ``axis_name`` (see
        :func:`adaloss_jax.unscale`). Raises ``ValueError`` if no scaler state results."""
        state = super().create(apply_fn=apply_fn, params=params,
                               tx=scaled_tx(tx, scaler, axis_name), **kwargs)
        _transforms.scale_state(state.opt_state)  # fail now if tx has no unscale()
        return state

    @property
    def loss_scale_state(self):
        """The scaler's state (:func:`adaloss_jax.scale_state`)."""
        return _transforms.scale_state(self.opt_state)

    def apply_gradients(self, *, grads, loss=None, scale_stats=None, **kwargs):
        """Applies *scaled* gradients; pass the unscaled ``loss`` to tell a forward
        overflow (skip, keep the scale) from a gradient overflow (skip, back off), and,
        with adaptive scaling, the ``scale_stats`` of the backward pass."""
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


def train_step(
    state: TrainState,
    loss_fn: Callable[..., Any],
    *args,
    has_aux: bool = False,
    **kwargs,
) -> tuple[TrainState, dict[str, Any]]:
    """One loss-scaled step: scale -> grad -> unscale -> finite check -> update.

    ``loss_fn(params, *args, **kwargs)`` returns the loss (or ``(loss, aux)`` with
    ``has_aux``). Call it inside your ``jax.jit``::

        @jax.jit
        def step(state, batch):
            return adaloss_jax.flax.train_step(state, loss_fn, batch)

    Returns the new state and metrics: ``loss`` (unscaled), ``applied`` (bool),
    ``loss_scale`` (the scale the loss was multiplied by; the root scale with adaptive
    scaling) and ``aux`` when ``has_aux``.
    """
    scale_used = state.loss_scale_state.loss_scale
    if isinstance(state.loss_scale_state, AdaptiveScaleState):
        value, grads, stats = _adaptive.adaptive_value_and_grad(loss_fn, has_aux=has_aux)(
            state.opt_state, state.params, *args, **kwargs)
    else:
        stats = None
        value, grads = _transforms.value_and_grad(loss_fn, has_aux=has_aux)(
            state.opt_state, state.params, *args, **kwargs)
    loss, aux = value if has_aux else (value, None)
    state = state.apply_gradients(grads=grads, loss=jnp.asarray(loss), scale_stats=stats)
    metrics = {"loss": loss, "applied": state.loss_scale_state.last_applied,
               "loss_scale": scale_used}
    if has_aux:
        metrics["aux"] = aux
    return state, metrics


__all__ = ["TrainState", "train_step"]
