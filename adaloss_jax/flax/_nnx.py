"""Flax NNX: an ``nnx.Optimizer`` with loss scaling and a one-call train step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx

from adaloss_jax import _policies, _transforms


def nnx_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    policy: _policies.LossScalePolicy | None,
    *,
    wrt: Any = nnx.Param,
    axis_name: str | None = None,
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, loss_scaled(tx, policy), wrt=wrt)``.

    With ``policy=None``, ``tx`` must already contain :func:`adaloss_jax.unscale`.
    """
    if policy is not None:
        tx = _transforms.loss_scaled(tx, policy, axis_name=axis_name)
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    nnx_scale_state(optimizer)  # fail now if tx has no unscale()
    return optimizer


def nnx_scale_state(optimizer: nnx.Optimizer) -> _policies.LossScaleState:
    """The :class:`LossScaleState` held by an ``nnx.Optimizer``, as plain arrays."""
    return _transforms.scale_state(nnx.as_pure(optimizer.opt_state))


def nnx_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[..., Any],
    *args,
    has_aux: bool = False,
    **kwargs,
) -> dict[str, Any]:
    """One loss-scaled step on an NNX model, updating ``model`` and ``optimizer`` in place.

    ``loss_fn(model, *args, **kwargs)`` returns the loss (or ``(loss, aux)``). Call it
    inside ``nnx.jit``. Returns metrics as :func:`adaloss_jax.flax.train_step` does.
    """
    scale_used = nnx_scale_state(optimizer).loss_scale

    def scaled(m):
        out = loss_fn(m, *args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return jnp.asarray(loss).astype(jnp.float32) * scale_used, (loss, aux)

    grad_fn = nnx.value_and_grad(scaled, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
    (_, (loss, aux)), grads = grad_fn(model)
    optimizer.update(model, grads, loss=jnp.asarray(loss))
    metrics = {
        "loss": loss,
        "applied": nnx_scale_state(optimizer).last_applied,
        "loss_scale": scale_used,
    }
    if has_aux:
        metrics["aux"] = aux
    return metrics
