"""Flax integrations: a linen TrainState and an NNX optimizer with loss scaling."""

from adaloss_jax.flax._linen import TrainState, train_step
from adaloss_jax.flax._nnx import nnx_optimizer, nnx_scale_state, nnx_train_step

__all__ = ["TrainState", "nnx_optimizer", "nnx_scale_state", "nnx_train_step", "train_step"]
