"""Flax integrations: a linen TrainState and an NNX optimizer with loss scaling."""

from adaloss_jax.flax import _linen_hook  # noqa: F401  (registers linen's hook)
from adaloss_jax.flax._linen import TrainState, train_step
from adaloss_jax.flax._nnx import nnx_optimizer, nnx_train_step
from adaloss_jax.flax._nnx_adaptive import nnx_adaptive_value_and_grad

__all__ = [
    "TrainState",
    "nnx_adaptive_value_and_grad",
    "nnx_optimizer",
    "nnx_train_step",
    "train_step",
]
