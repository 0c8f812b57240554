"""Saving and loading a scaler state (or any pytree holding one) without a dependency:
one NumPy ``.npz`` file, static metadata checked on load. Orbax checkpoints work too
(docs: checkpoints)."""

from adaloss_jax._checkpoint import load_state, save_state

__all__ = ["load_state", "save_state"]
