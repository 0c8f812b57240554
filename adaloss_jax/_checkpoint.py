"""Single-file checkpoints of any pytree of arrays (parameters, optimizer states, a
``TrainState``), with no dependency: a NumPy ``.npz`` archive keyed by leaf path.

For training runs use Orbax, as Flax does: every state of this library is a pytree of
arrays and round-trips through ``orbax.checkpoint``. A scaler's configuration is static
metadata of its state's tree structure: the template the checkpoint is loaded into
(built by the same optimizer) supplies it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaloss_jax import _tree


def _entries(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` with paths as ``a/b/0`` (``/`` alone for a bare leaf)."""
    out = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/" + "/".join(_tree.key_name(k) for k in keys)] = leaf
    return out


def save_state(path: str | os.PathLike, tree: Any) -> None:
    """Writes ``tree``'s leaves to ``path``.

    The file is written under a temporary name first and then renamed, so an
    interrupted save never leaves a truncated checkpoint under ``path``.

    Args:
      path: the file to write.
      tree: a pytree of arrays (or Python numbers).

    Returns:
      None.

    >>> import tempfile, os, adaloss_jax
    >>> state = adaloss_jax.dynamic(initial_scale=2.0**10).init()
    >>> path = os.path.join(tempfile.mkdtemp(), "state.ckpt")
    >>> save_state(path, state)
    >>> float(load_state(path, state).loss_scale)
    1024.0
    """
    arrays = {k: np.asarray(jax.device_get(v)) for k, v in _entries(tree).items()}
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".adaloss_ckpt_")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{f"leaf{i}": a for i, a in enumerate(arrays.values())},
                     __paths__=np.asarray(list(arrays), dtype=str))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _mismatch(expected: dict, found: dict) -> str | None:
    """The first difference between the template's leaves and the checkpoint's."""
    for key in expected:
        if key not in found:
            return f"at {key}: missing from the checkpoint"
    for key in found:
        if key not in expected:
            return f"at {key}: in the checkpoint but not in the template"
    for key, want in expected.items():
        a, b = np.asarray(want), found[key]
        if a.shape != b.shape:
            return f"at {key}: shape differs, expected {a.shape}, checkpoint has {b.shape}"
        if type(want) in (bool, int, float, complex):
            # A Python number (TrainState.create's step=0) has no fixed width; after a
            # jitted step the same field is an int32/float32 array. Match the kind only.
            kinds = {bool: "b", int: "iu", float: "f", complex: "c"}[type(want)]
            if b.dtype.kind not in kinds:
                return (f"at {key}: dtype differs, expected a Python {type(want).__name__}, "
                        f"checkpoint has {b.dtype}")
        elif a.dtype != b.dtype:
            return f"at {key}: dtype differs, expected {a.dtype}, checkpoint has {b.dtype}"
    return None


def _like(template_leaf: Any, value: np.ndarray) -> Any:
    if isinstance(template_leaf, jax.Array):
        if len(template_leaf.sharding.device_set) > 1:
            return jax.device_put(value, template_leaf.sharding)
        return jnp.asarray(value, dtype=template_leaf.dtype)
    if isinstance(template_leaf, bool | int | float):
        # A Python number in the template became a weakly typed array in training;
        # restoring it as one keeps a jitted step from recompiling.
        return jnp.asarray(value.item())
    return value


def load_state(path: str | os.PathLike, template: Any) -> Any:
    """Reads a checkpoint written by :func:`save_state` into the structure of ``template``.

    Args:
      path: the file.
      template: a state of the same kind (``tx.init(params)``); only its tree structure,
        shapes and dtypes are used, and the checkpoint must match them exactly.

    Returns:
      The restored tree; arrays come back as ``jax.Array`` (with the template's sharding
      when it spans several devices).

    Raises:
      ValueError: naming the first path at which the checkpoint differs from
        ``template``; nothing is restored then.

    >>> import tempfile, os, jax.numpy as jnp
    >>> path = os.path.join(tempfile.mkdtemp(), "w.ckpt")
    >>> save_state(path, {"w": jnp.arange(3.0)})
    >>> load_state(path, {"w": jnp.zeros(3)})["w"].tolist()
    [0.0, 1.0, 2.0]
    """
    with np.load(os.fspath(path)) as data:
        keys = [str(k) for k in data["__paths__"]]
        found = {k: data[f"leaf{i}"] for i, k in enumerate(keys)}
    expected = _entries(template)
    msg = _mismatch(expected, found)
    if msg is not None:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} does not match the template {msg}; load it into "
            f"a state built with the same optimizer, scaler and parameter shapes/dtypes")
    leaves, treedef = jax.tree_util.tree_flatten(template)
    restored = [_like(t, found[k]) for t, k in zip(leaves, expected)]
    return jax.tree_util.tree_unflatten(treedef, restored)


__all__ = ["load_state", "save_state"]
