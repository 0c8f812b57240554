"""Flax linen ``TrainState`` with loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from adaloss_jax import _adaptive, _policies, _transforms


class TrainState(train_state.TrainState):
    """``flax.training.train_state.TrainState`` whose optimizer does loss scaling.

    Build it with ``TrainState.create(apply_fn=..., params=..., tx=optax.adamw(1e-3),
    scaler=adaloss_jax.dynamic())``: ``tx`` is wrapped as
    ``loss_scaled(tx, scaler)``. With ``scaler=adaloss_jax.adaptive(...)`` it is wrapped
    as ``chain(adaptive_unscale(scaler), skip_nonfinite(tx))`` and :func:`train_step`
    inserts the per-module scale points. Pass ``scaler=None`` when ``tx`` already
    contains :func:`adaloss_jax.unscale`.

    ``apply_gradients(grads=scaled_grads, loss=loss)`` unscales, checks finiteness,
    updates the scale and applies the update only when it is finite; ``step`` counts
    every call, ``loss_scale_state.total_applied`` the applied ones.
    """

    adaptive: _adaptive.AdaptiveScale | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, *, apply_fn, params, tx, scaler=None, axis_name=None, policy=None,
               **kwargs):
        scaler = _policies.renamed(scaler, policy, "TrainState.create")
        if isinstance(scaler, _adaptive.AdaptiveScale):
            tx = optax.chain(
                _adaptive.adaptive_unscale(scaler, axis_name=axis_name),
                _transforms.skip_nonfinite(tx),
            )
            return super().create(
                apply_fn=apply_fn, params=params, tx=tx, adaptive=scaler, **kwargs
            )
        if scaler is not None:
            tx = _transforms.loss_scaled(tx, scaler, axis_name=axis_name)
        elif axis_name is not None:
            raise ValueError(
                "axis_name is only used together with scaler=...; when tx already contains "
                "adaloss_jax.unscale, pass axis_name to unscale() instead"
            )
        state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
        _transforms.scale_state(state.opt_state)  # fail now if tx has no unscale()
        return state

    @property
    def loss_scale_state(self) -> _policies.LossScaleState:
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
    if state.adaptive is not None:
        value, grads, stats = _adaptive.adaptive_value_and_grad(
            loss_fn, state.adaptive, has_aux=has_aux
        )(state.opt_state, state.params, *args, **kwargs)
    else:
        stats = None
        value, grads = _transforms.value_and_grad(loss_fn, has_aux=has_aux)(
            state.opt_state, state.params, *args, **kwargs
        )
    loss, aux = value if has_aux else (value, None)
    state = state.apply_gradients(grads=grads, loss=jnp.asarray(loss), scale_stats=stats)
    metrics = {
        "loss": loss,
        "applied": state.loss_scale_state.last_applied,
        "loss_scale": scale_used,
    }
    if has_aux:
        metrics["aux"] = aux
    return state, metrics


__all__ = ["TrainState", "train_step"]
