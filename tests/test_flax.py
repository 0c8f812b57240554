"""Flax integrations: linen TrainState + linen_train_step, NNX optimizer + nnx_train_step."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import adaloss_jax as alj
from adaloss_jax.flax import TrainState, linen_train_step, nnx_optimizer, nnx_train_step

STEPS = 6
BAD_STEP = 2
INITIAL = 2.0**10


@jax.custom_vjp
def poison(x, bad):
    """Identity forward; an inf gradient when ``bad`` (the loss stays finite)."""
    return x


poison.defvjp(
    lambda x, bad: (x, bad),
    lambda bad, g: (g * jnp.where(bad, jnp.inf, 1.0).astype(g.dtype), None),
)


def batches():
    kx, ky = jax.random.split(jax.random.key(3))
    return jax.random.normal(kx, (STEPS, 8, 4)), jax.random.normal(ky, (STEPS, 8, 2))


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert la and len(la) == len(lb)
    return all(np.array_equal(x, y) for x, y in zip(la, lb))


# --- linen ----------------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x, bad):
        h = nn.tanh(nn.Dense(8, dtype=jnp.float16)(x))
        return nn.Dense(2, dtype=jnp.float16)(poison(h, bad))


def linen_loss(params, apply_fn, x, y, bad):
    return jnp.mean((apply_fn({"params": params}, x, bad) - y) ** 2)


@jax.jit
def linen_step(state, x, y, bad):
    return linen_train_step(state, linen_loss, state.apply_fn, x, y, bad)


class _RollbackState(TrainState):
    previous: object = None  # an optimizer state to roll back to


def test_a_train_state_stands_for_its_opt_state():
    """``scale_state`` and the diagnostics read a ``TrainState`` (or any object with an
    ``opt_state``) by its ``opt_state``: one that keeps a second optimizer state in
    another field (a copy to roll back to), and a plain holder that is no pytree."""
    state = _RollbackState.create(apply_fn=None, params={"w": jnp.zeros(3)},
                                  tx=optax.sgd(0.1), scaler=alj.dynamic(initial_scale=INITIAL))
    state = state.replace(previous=jax.tree_util.tree_map(jnp.copy, state.opt_state))
    assert alj.scale_state(state) is alj.scale_state(state.opt_state)
    holder = types.SimpleNamespace(opt_state=state.opt_state, step=0)
    assert alj.scale_state(holder) is alj.scale_state(state.opt_state)
    assert alj.diagnostics.status_line(holder).startswith("applied | scale 2^10 |")


def test_linen_train_step_skips_and_counts():
    model = MLP()
    xs, ys = batches()
    params = model.init(jax.random.key(0), xs[0], False)["params"]
    state = TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.adamw(1e-2),
        scaler=alj.dynamic(initial_scale=INITIAL, period=2),
    )
    expected_scale = [INITIAL, INITIAL, 2 * INITIAL, INITIAL, INITIAL, 2 * INITIAL]
    for t in range(STEPS):
        before = state
        state, metrics = linen_step(state, xs[t], ys[t], jnp.asarray(t == BAD_STEP))
        assert bool(metrics["applied"]) == (t != BAD_STEP)
        assert float(metrics["loss_scale"]) == expected_scale[t], t
        assert np.isfinite(float(metrics["loss"]))
        if t == BAD_STEP:
            assert leaves_equal(state.params, before.params)
            assert leaves_equal(state.opt_state[1], before.opt_state[1])
        else:
            assert not leaves_equal(state.params, before.params)
    st = state.scale_state
    assert int(state.step) == STEPS
    assert (int(st.total_applied), int(st.total_skipped)) == (STEPS - 1, 1)
    assert int(st.total_nonfinite_loss) == 0
    # Steps 0,1 grew to 2**11; the overflow at 2 backed off to 2**10; 3,4 grew again.
    assert float(st.loss_scale) == 2 * INITIAL


def test_linen_train_step_adaptive_per_module():
    """scaler=adaptive(): per-module scale points in linen_train_step, one jit, skips visible,
    gradients (hence updates) equal to an fp32 run with the same optimizer."""
    model = MLP()
    xs, ys = batches()
    params = model.init(jax.random.key(0), xs[0], False)["params"]
    state = TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1), scaler=alj.adaptive(groups="module")
    )
    assert sorted(alj.scale_state(state.opt_state).log2_scales) == ["", "Dense_0", "Dense_1"]
    # Step 0 runs at fp16's start, 2**15, each module at its own choice: applied, with
    # fp32's gradients. The bad step's loss is not finite: skipped.
    skipped = (BAD_STEP,)
    for t in range(STEPS):
        before = state
        state, metrics = linen_step(state, xs[t], ys[t], jnp.asarray(t == BAD_STEP))
        assert bool(metrics["applied"]) == (t not in skipped)
        if t in skipped:
            assert leaves_equal(state.params, before.params)
        else:
            ref = jax.grad(linen_loss)(before.params, model.apply, xs[t], ys[t], False)
            got = jax.tree_util.tree_map(lambda a, b: (a - b) / -0.1, state.params,
                                         before.params)
            for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
                np.testing.assert_allclose(g, r, rtol=0.05, atol=1e-4)
    st = state.scale_state
    assert (int(st.total_applied), int(st.total_skipped)) == (STEPS - 1, 1)
    assert int(alj.scale_state(state).total_retries) == 0
    # The statistics moved the scales off their initial 2**15.
    assert any(float(v) != 15 for v in alj.scale_state(state.opt_state).log2_scales.values())


def linen_loss_times(params, apply_fn, x, y, factor):
    return linen_loss(params, apply_fn, x, y, False) * factor


@jax.jit
def linen_step_times(state, x, y, factor):
    return linen_train_step(state, linen_loss_times, state.apply_fn, x, y, factor)


@pytest.mark.parametrize("family", ["dynamic", "adaptive"])
def test_linen_train_step_tells_a_nonfinite_loss_from_a_gradient_overflow(family):
    """linen_train_step hands the loss to the update: an inf loss (a forward overflow, which
    no scale can fix) skips the step, counts in ``total_nonfinite_loss`` and moves no
    scale; a gradient overflow would have backed the scale off."""
    model = MLP()
    xs, ys = batches()
    params = model.init(jax.random.key(0), xs[0], False)["params"]
    scaler = (alj.dynamic(initial_scale=INITIAL, period=2) if family == "dynamic"
              else alj.adaptive(groups="module"))
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1),
                              scaler=scaler)
    for t in range(2):  # (adaptive: step 0 at scale 1 is skipped, step 1 applied)
        state, metrics = linen_step_times(state, xs[t], ys[t], jnp.float32(1.0))
    assert bool(metrics["applied"])
    scales = lambda s: alj.diagnostics.scale_summary(s)["log2_group_scales"]
    before = scales(state)
    skipped = int(state.scale_state.total_skipped)
    state, metrics = linen_step_times(state, xs[2], ys[2], jnp.float32(jnp.inf))
    assert not bool(metrics["applied"])
    st = state.scale_state
    assert (int(st.total_skipped) - skipped, int(st.total_nonfinite_loss)) == (1, 1)
    assert scales(state) == before


def test_linen_create_without_unscale_is_refused():
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 4)), False)["params"]
    with pytest.raises(ValueError, match="exactly one scaler state"):
        TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    with pytest.raises(ValueError, match="axis_name"):
        TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adamw(1e-3), axis_name="data"
        )
    # A tx that already contains unscale is accepted with scaler=None.
    state = TrainState.create(
        apply_fn=model.apply, params=params, tx=alj.loss_scaled(optax.sgd(0.1), alj.static())
    )
    assert float(state.scale_state.loss_scale) == 2.0**15


# --- NNX ------------------------------------------------------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, dtype=jnp.float16, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x, bad):
        return self.l2(poison(jnp.tanh(self.l1(x)), bad))


def nnx_loss(model, x, y, bad):
    return jnp.mean((model(x, bad) - y) ** 2)


@nnx.jit
def nnx_step(model, optimizer, x, y, bad):
    return nnx_train_step(model, optimizer, nnx_loss, x, y, bad)


def test_nnx_train_step_skips_and_counts():
    model = NnxMLP(nnx.Rngs(0))
    optimizer = nnx_optimizer(
        model, optax.adamw(1e-2), alj.dynamic(initial_scale=INITIAL, period=2)
    )
    xs, ys = batches()
    expected_scale = [INITIAL, INITIAL, 2 * INITIAL, INITIAL, INITIAL, 2 * INITIAL]
    for t in range(STEPS):
        params_before = jax.tree_util.tree_map(np.asarray, nnx.state(model, nnx.Param))
        opt_before = jax.tree_util.tree_map(np.asarray, nnx.state(optimizer))
        metrics = nnx_step(model, optimizer, xs[t], ys[t], jnp.asarray(t == BAD_STEP))
        assert bool(metrics["applied"]) == (t != BAD_STEP)
        assert float(metrics["loss_scale"]) == expected_scale[t], t
        params_after = nnx.state(model, nnx.Param)
        if t == BAD_STEP:
            assert leaves_equal(params_after, params_before)
            inner_after = nnx.as_pure(optimizer.opt_state)[1]
            inner_before = nnx.as_pure(opt_before["opt_state"])[1]
            assert leaves_equal(inner_after, inner_before)
        else:
            assert not leaves_equal(params_after, params_before)
    st = alj.scale_state(optimizer)
    assert (int(st.total_applied), int(st.total_skipped)) == (STEPS - 1, 1)
    assert int(st.notfinite_count) == 0
    assert float(st.loss_scale) == 2 * INITIAL


def test_nnx_optimizer_without_unscale_is_refused():
    model = NnxMLP(nnx.Rngs(0))
    with pytest.raises(ValueError, match="exactly one scaler state"):
        nnx_optimizer(model, optax.adamw(1e-3), None)


def test_linen_train_state_checkpoint_continues_identically(tmp_path):
    model = MLP()
    xs, ys = batches()
    params = model.init(jax.random.key(0), xs[0], False)["params"]

    def fresh():
        return TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adamw(1e-2),
            scaler=alj.dynamic(initial_scale=INITIAL, period=2),
        )

    state = fresh()
    states = []
    for t in range(STEPS):
        state, _ = linen_step(state, xs[t], ys[t], jnp.asarray(t == BAD_STEP))
        states.append(state)
    alj.checkpoint.save_state(tmp_path / "ts", states[BAD_STEP])
    restored = alj.checkpoint.load_state(tmp_path / "ts", fresh())
    # The template's step is a Python int; restored as the weakly typed array training
    # made of it, so the jitted step does not recompile.
    assert jax.typeof(restored.step) == jax.typeof(states[BAD_STEP].step)
    assert not bool(restored.scale_state.last_applied)
    for t in range(BAD_STEP + 1, STEPS):
        restored, _ = linen_step(restored, xs[t], ys[t], jnp.asarray(t == BAD_STEP))
        assert leaves_equal(restored, states[t]), t


def test_the_old_linen_names_warn_and_still_work():
    """0.3 renamed ``flax.train_step`` to ``linen_train_step`` and
    ``TrainState.loss_scale_state`` to ``scale_state``; the old names warn for a release."""
    import adaloss_jax.flax as alj_flax

    with pytest.warns(DeprecationWarning, match="linen_train_step"):
        old = alj_flax.train_step
    assert old is alj_flax.linen_train_step
    state = TrainState.create(apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1),
                              scaler=alj.static(8.0))
    with pytest.warns(DeprecationWarning, match="TrainState.scale_state"):
        assert float(state.loss_scale_state.loss_scale) == float(state.scale_state.loss_scale)
    with pytest.raises(AttributeError, match="no_such_name"):
        alj_flax.no_such_name  # noqa: B018
