"""Orbax is the checkpoint path: the whole training state (parameters, optimizer and scaler
state, the structure fingerprint included) round-trips through StandardCheckpointer and
CheckpointManager, and training resumes bit-identically."""

from __future__ import annotations

import functools

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import adaloss_jax as alj
from adaloss_jax.flax import TrainState, linen_train_step

MLP = functools.partial(_models.MLP, depth=1)  # fp16 compute, Dense_0 and Dense_1


def _setup():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, size=16))
    model = MLP()
    state = TrainState.create(apply_fn=model.apply,
                              params=model.init(jax.random.key(0), x)["params"],
                              tx=optax.adamw(1e-2), scaler=alj.adaptive(groups="module"))

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * 2.0**-20

    step = jax.jit(lambda s, x, y: linen_train_step(s, loss_fn, x, y)[0])
    return state, step, x, y


def _same(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for u, v in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _run(state, step, x, y, n):
    for _ in range(n):
        state = step(state, x, y)
    return state


def test_standard_checkpointer_round_trip_resumes_bit_identically(tmp_path):
    state, step, x, y = _setup()
    state = _run(state, step, x, y, 3)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        ckptr.wait_until_finished()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
        restored = ckptr.restore(tmp_path / "ckpt", abstract)
    _same(restored, state)
    _same(_run(restored, step, x, y, 3), _run(state, step, x, y, 3))


def test_checkpoint_manager_round_trip_resumes_bit_identically(tmp_path):
    state, step, x, y = _setup()
    state = _run(state, step, x, y, 2)
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(2, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
    assert alj.diagnostics.scale_summary(restored) == alj.diagnostics.scale_summary(state)
    _same(_run(restored, step, x, y, 3), _run(state, step, x, y, 3))
