"""Flax NNX: an ``nnx.Optimizer`` with loss scaling and a one-call train step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx

from adaloss_jax import _adaptive, _policies, _transforms
from adaloss_jax.flax._nnx_adaptive import nnx_adaptive_value_and_grad


def nnx_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    scaler: _policies.GlobalScaler | _adaptive.AdaptiveScale | None = None,
    *,
    wrt: Any = nnx.Param,
    axis_name: str | None = None,
    policy: Any = None,
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, loss_scaled(tx, scaler), wrt=wrt)``.

    With ``scaler=adaloss_jax.adaptive(...)`` the optimizer is
    ``chain(adaptive_unscale(scaler), skip_nonfinite(tx))`` and :func:`nnx_train_step`
    inserts per-module scale points (on a copy of the model; the model is not changed).
    With ``scaler=None``, ``tx`` must already contain :func:`adaloss_jax.unscale`.
    """
    scaler = _policies.renamed(scaler, policy, "nnx_optimizer")
    adaptive = isinstance(scaler, _adaptive.AdaptiveScale)
    if adaptive:
        tx = optax.chain(
            _adaptive.adaptive_unscale(scaler, axis_name=axis_name),
            _transforms.skip_nonfinite(tx),
        )
    elif scaler is not None:
        tx = _transforms.loss_scaled(tx, scaler, axis_name=axis_name)
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    optimizer.adaptive = scaler if adaptive else None
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
    scaler = getattr(optimizer, "adaptive", None)
    if scaler is not None:
        value, grads, stats = nnx_adaptive_value_and_grad(
            loss_fn, scaler, wrt=optimizer.wrt, has_aux=has_aux
        )(nnx.as_pure(optimizer.opt_state), model, *args, **kwargs)
        loss, aux = value if has_aux else (value, None)
        optimizer.update(model, grads, loss=jnp.asarray(loss), scale_stats=stats)
        return _metrics(optimizer, loss, aux, scale_used, has_aux)

    def scaled(m):
        out = loss_fn(m, *args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return jnp.asarray(loss).astype(jnp.float32) * scale_used, (loss, aux)

    grad_fn = nnx.value_and_grad(scaled, argnums=nnx.DiffState(0, optimizer.wrt), has_aux=True)
    (_, (loss, aux)), grads = grad_fn(model)
    optimizer.update(model, grads, loss=jnp.asarray(loss))
    return _metrics(optimizer, loss, aux, scale_used, has_aux)


def _metrics(optimizer, loss, aux, scale_used, has_aux) -> dict[str, Any]:
    metrics = {
        "loss": loss,
        "applied": nnx_scale_state(optimizer).last_applied,
        "loss_scale": scale_used,
    }
    if has_aux:
        metrics["aux"] = aux
    return metrics
