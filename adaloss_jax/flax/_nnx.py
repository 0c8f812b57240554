"""Flax NNX: an ``nnx.Optimizer`` with loss scaling and a one-call train step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx

from adaloss_jax import _global_transforms, _lookup
from adaloss_jax._state import AdaptiveScaleState
from adaloss_jax.flax._linen import scaled_tx
from adaloss_jax.flax._nnx_adaptive import nnx_adaptive_value_and_grad


def nnx_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    scaler: Any = None,
    *,
    wrt: Any = nnx.Param,
    axis_name: str | None = None,
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, scaled tx, wrt=wrt)``.

    Args:
      model: the NNX model.
      tx: the optimizer, e.g. ``optax.adamw(1e-3)``.
      scaler: a global scaler (``tx`` becomes ``loss_scaled(tx, scaler)``), an
        ``adaloss_jax.adaptive(...)`` (``adaptive_scaled(tx, scaler)``), or None when
        ``tx`` already holds an unscale.
      wrt: the variables to train.
      axis_name: as for :func:`adaloss_jax.unscale`.

    Returns:
      An ``nnx.Optimizer``; :func:`nnx_train_step` does the whole step with it.

    Raises:
      ValueError: if the optimizer holds no scaler state.

    >>> import optax
    >>> from flax import nnx
    >>> import adaloss_jax as alj
    >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    >>> optimizer = nnx_optimizer(model, optax.sgd(0.1), alj.dynamic(initial_scale=4.0))
    >>> float(alj.scale_state(optimizer).loss_scale)
    4.0
    """
    optimizer = nnx.Optimizer(model, scaled_tx(tx, scaler, axis_name), wrt=wrt)
    _lookup.training_state(optimizer)  # fail now: no unscale(), or not first
    return optimizer


def nnx_train_step(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[..., Any],
    *args,
    has_aux: bool = False,
    **kwargs,
) -> dict[str, Any]:
    """One loss-scaled step on an NNX model, updating ``model`` and ``optimizer`` in place.

    Call it inside ``nnx.jit``.

    Args:
      model: the NNX model.
      optimizer: its :func:`nnx_optimizer`.
      loss_fn: ``loss_fn(model, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
      *args: the batch.
      **kwargs: keyword arguments of ``loss_fn``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

    Returns:
      Metrics as :func:`adaloss_jax.flax.linen_train_step` returns them.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import adaloss_jax as alj
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx_optimizer(model, optax.sgd(0.1), alj.dynamic())
    >>> step = nnx.jit(lambda m, o, x: nnx_train_step(m, o, lambda m, x: jnp.sum(m(x) ** 2), x))
    >>> bool(step(model, optimizer, jnp.ones((1, 2)))["applied"])
    True
    """
    scale_used = _lookup.scale_state(optimizer).loss_scale
    if isinstance(_lookup.scale_state(optimizer), AdaptiveScaleState):
        value, grads, stats = nnx_adaptive_value_and_grad(
            loss_fn, wrt=optimizer.wrt, has_aux=has_aux
        )(nnx.as_pure(optimizer.opt_state), model, *args, **kwargs)
        loss, aux = value if has_aux else (value, None)
        optimizer.update(model, grads, loss=jnp.asarray(loss), scale_stats=stats)
    else:
        def scaled(m):
            out = loss_fn(m, *args, **kwargs)
            loss, aux = out if has_aux else (out, None)
            return jnp.asarray(loss).astype(jnp.float32) * scale_used, (loss, aux)

        grad_fn = nnx.value_and_grad(scaled, argnums=nnx.DiffState(0, optimizer.wrt),
                                     has_aux=True)
        (_, (loss, aux)), grads = grad_fn(model)
        optimizer.update(model, grads, loss=jnp.asarray(loss),
                         scale_stats=_global_transforms.LossScaleStats(loss_scale=scale_used))
    metrics = {"loss": loss, "applied": _lookup.scale_state(optimizer).last_applied,
               "loss_scale": scale_used}
    if has_aux:
        metrics["aux"] = aux
    return metrics
