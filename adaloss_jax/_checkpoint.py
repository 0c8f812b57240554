"""Plain pytree checkpoints of optimizer states (msgpack via ``flax.serialization``).

A :class:`~adaloss_jax.LossScaleState` is a NamedTuple of arrays, so it round-trips
with the rest of the optimizer state; nothing about the scaler is stored (the scaler
is configuration, rebuilt by the code that loads the checkpoint).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _serialization():
    """flax's serialization module, with the library's own pytree types registered."""
    from flax import serialization  # flax is a dependency; the core imports without it

    from adaloss_jax._adaptive import GroupVector

    # Registered on every call (override: idempotent), without reading flax's registry.
    serialization.register_serialization_state(
        GroupVector,
        lambda v: {"array": v.array},
        lambda v, d: GroupVector(v.names, serialization.from_state_dict(v.array, d["array"])),
        override=True,
    )
    return serialization


def save_state(path: str | os.PathLike, tree: Any) -> None:
    """Writes ``tree`` (params, an optimizer state, a TrainState, ...) to ``path``.

    The file is written to a temporary name first and then renamed, so an interrupted
    save never leaves a truncated checkpoint under ``path``.

    >>> import tempfile, os, adaloss_jax
    >>> state = adaloss_jax.dynamic(initial_scale=2.0**10).init()
    >>> path = os.path.join(tempfile.mkdtemp(), "state.msgpack")
    >>> save_state(path, state)
    >>> float(load_state(path, state).loss_scale)
    1024.0
    """
    data = _serialization().to_bytes(tree)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".adaloss_ckpt_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _describe(x: Any) -> str:
    if isinstance(x, dict):
        return f"a node with keys {sorted(x)}"
    a = np.asarray(x)
    return f"shape {a.shape} dtype {a.dtype}"


def _first_mismatch(expected: Any, found: Any, path: str) -> str | None:
    """Compares two state dicts; returns a description of the first difference."""
    where = path or "<root>"
    if isinstance(expected, dict) or isinstance(found, dict):
        if not (isinstance(expected, dict) and isinstance(found, dict)):
            return f"at {where}: expected {_describe(expected)}, checkpoint has {_describe(found)}"
        for key in expected:
            if key not in found:
                return f"at {path}/{key}: missing from the checkpoint"
        for key in found:
            if key not in expected:
                return f"at {path}/{key}: in the checkpoint but not in the template"
        for key in expected:
            msg = _first_mismatch(expected[key], found[key], f"{path}/{key}")
            if msg is not None:
                return msg
        return None
    if expected is None or found is None:
        if expected is None and found is None:
            return None
        return f"at {where}: expected {expected!r}, checkpoint has {found!r}"
    a, b = np.asarray(expected), np.asarray(found)
    if a.shape != b.shape:
        return f"at {where}: shape differs, expected {a.shape}, checkpoint has {b.shape}"
    if type(expected) in (bool, int, float, complex):
        # A Python scalar (e.g. TrainState.create's step=0) has no fixed width; after a
        # jitted step the same field is an int32/float32 array. Match the kind only.
        kinds = {bool: "b", int: "iu", float: "f", complex: "c"}[type(expected)]
        if b.dtype.kind not in kinds:
            return (
                f"at {where}: dtype differs, expected a Python {type(expected).__name__}, "
                f"checkpoint has {b.dtype}"
            )
        return None
    if a.dtype != b.dtype:
        return f"at {where}: dtype differs, expected {a.dtype}, checkpoint has {b.dtype}"
    return None


def _like(template_leaf: Any, value: Any) -> Any:
    if isinstance(template_leaf, jax.Array):
        if len(template_leaf.sharding.device_set) > 1:
            return jax.device_put(value, template_leaf.sharding)
        return jnp.asarray(value, dtype=template_leaf.dtype)
    if isinstance(template_leaf, bool | int | float):
        # A Python number in the template (TrainState's step=0) became a weakly typed
        # array in training; restoring it as one keeps a jitted step from recompiling.
        return jnp.asarray(np.asarray(value).item())
    return value


def load_state(path: str | os.PathLike, template: Any) -> Any:
    """Reads a checkpoint written by :func:`save_state` into the structure of ``template``.

    ``template`` is a state of the same kind (for example ``tx.init(params)``); its
    values are not used, only its tree structure, shapes and dtypes, which the
    checkpoint must match exactly. Arrays come back as ``jax.Array`` (with the
    template's sharding when it spans several devices).

    Raises:
      ValueError: naming the first path at which the checkpoint's structure, shape or
        dtype differs from ``template``; nothing is restored in that case.
    """
    serialization = _serialization()
    with open(os.fspath(path), "rb") as f:
        raw = serialization.msgpack_restore(f.read())
    expected = serialization.to_state_dict(template)
    msg = _first_mismatch(expected, raw, "")
    if msg is not None:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} does not match the template {msg}; load it into "
            f"a state built with the same optimizer, scaler and parameter shapes/dtypes"
        )
    restored = serialization.from_state_dict(template, raw)
    return jax.tree_util.tree_map(_like, template, restored)


__all__ = ["load_state", "save_state"]
