"""``adaloss_jax.checkpoint``: one ``.npz`` file, restored into a template's structure,
refused with the first differing path when it does not match."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _stacked import STACK, params

import adaloss_jax as alj
from adaloss_jax import _checkpoint
from adaloss_jax._layout import Layer


def _opt_state():
    tx = alj.adaptive_scaled(optax.adam(1e-3), alj.adaptive(groups="module"))
    return tx.init(params())


def test_an_adaptive_state_with_a_stack_comes_back_leaf_for_leaf(tmp_path):
    state = _opt_state()
    st = alj.scale_state(state).with_log2_scales({f"{STACK}[1]": 5, "Dense_0": -2})
    path = tmp_path / "state.ckpt"
    alj.checkpoint.save_state(path, {"opt": state, "scales": st})
    back = alj.checkpoint.load_state(path, {"opt": _opt_state(),
                                            "scales": alj.scale_state(_opt_state())})
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(
            {"opt": state, "scales": st})):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = back["scales"]
    assert float(got.log2_scales[Layer(STACK, 1)]) == 5.0
    assert got.log2_scales.stacked(STACK).tolist() == [15.0, 5.0, 15.0]  # (fp16: 2**15)
    with np.load(path) as data:  # a stack's layers are one entry, named for the stack
        assert any(p.endswith(f"{STACK}[:]") for p in data["__paths__"].tolist())


def test_a_checkpoint_of_another_model_names_the_first_difference(tmp_path):
    path = tmp_path / "state.ckpt"
    alj.checkpoint.save_state(path, {"w": jnp.zeros(3), "b": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"does not match the template.*same optimizer"):
        alj.checkpoint.load_state(path, {"w": jnp.zeros(4), "b": jnp.zeros(2)})
    with pytest.raises(ValueError, match="does not match the template"):
        alj.checkpoint.load_state(path, {"w": jnp.zeros(3)})


def test_a_python_number_in_the_template_matches_its_kind_and_names_it(tmp_path):
    """A Python number in the template (``TrainState.create``'s ``step=0``) matches an
    array of its kind, any width; a checkpoint holding another kind there is refused
    with the number's Python type and the checkpoint's dtype named."""
    path = tmp_path / "state.ckpt"
    alj.checkpoint.save_state(path, {"step": jnp.int32(7), "w": jnp.zeros(2)})
    back = alj.checkpoint.load_state(path, {"step": 0, "w": jnp.zeros(2)})
    assert int(back["step"]) == 7
    with pytest.raises(ValueError, match=r"at /step: dtype differs, expected a Python "
                                         r"float, checkpoint has int32"):
        alj.checkpoint.load_state(path, {"step": 0.0, "w": jnp.zeros(2)})


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "state.ckpt"
    alj.checkpoint.save_state(path, {"w": jnp.arange(3.0)})

    def broken(f, **arrays):  # the disk fills halfway through the write
        f.write(b"PK\x03\x04 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(_checkpoint.np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        alj.checkpoint.save_state(path, {"w": jnp.arange(3.0) + 1})
    monkeypatch.undo()
    assert alj.checkpoint.load_state(path, {"w": jnp.zeros(3)})["w"].tolist() == [0, 1, 2]
    assert [f for f in os.listdir(tmp_path) if f.startswith(".adaloss_ckpt_")] == []
