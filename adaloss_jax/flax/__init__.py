"""Flax integrations: a linen TrainState and an NNX optimizer with loss scaling."""

from adaloss_jax import _common
from adaloss_jax.flax import _linen_hook  # noqa: F401  (registers linen's hook)
from adaloss_jax.flax._linen import TrainState, linen_train_step
from adaloss_jax.flax._nnx import nnx_optimizer, nnx_train_step
from adaloss_jax.flax._nnx_adaptive import nnx_adaptive_value_and_grad

# Old names kept one release (CHANGELOG.md lists the renames): they warn, then work.
DEPRECATED = {"train_step": "linen_train_step"}


def __getattr__(name):
    if name in DEPRECATED:
        _common.warn_renamed(f"adaloss_jax.flax.{name}", f"adaloss_jax.flax.{DEPRECATED[name]}")
        return globals()[DEPRECATED[name]]
    raise AttributeError(f"module 'adaloss_jax.flax' has no attribute {name!r}")


__all__ = [
    "TrainState",
    "linen_train_step",
    "nnx_adaptive_value_and_grad",
    "nnx_optimizer",
    "nnx_train_step",
]
