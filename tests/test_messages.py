"""Error messages no other test checks (issue 31): each raise site below is triggered
once, and its message is matched on a distinctive part of its text. Tiny inputs; most
raise at construction or at trace time, before anything compiles."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import adaloss_jax as alj
from adaloss_jax import _record, numerics

F16 = "float16"


@functools.cache
def _one_group():
    """A one-module parameter tree and the state of an adaptive scaler built for it."""
    params = {"msg_d": {"w": jnp.ones((2, 2))}}
    tx = alj.adaptive_unscale(alj.adaptive(groups="module", compute_dtype=F16))
    return params, tx, tx.init(params)


# ------------------------------------------------------------------ scaler options


def test_dynamic_min_above_max_is_named_before_the_initial_scale():
    with pytest.raises(ValueError, match=r"min_loss_scale=32\.0 is larger than "
                                         r"max_loss_scale=16\.0; swap them"):
        alj.dynamic(initial_scale=2.0**4, min_loss_scale=2.0**5, max_loss_scale=2.0**4)


@pytest.mark.parametrize("decay", [0, -1.0, True, "slow"])
def test_adaptive_decay_must_be_positive(decay):
    with pytest.raises(ValueError, match="decay must be a positive number of binades"):
        alj.adaptive(decay=decay)


def test_adaptive_initial_scale_outside_its_bounds():
    with pytest.raises(ValueError, match=r"initial_scale=.* must lie in \[min_loss_scale, "
                                         r"max_loss_scale\] = \[2\*\*-24, 2\*\*64\]"):
        alj.adaptive(initial_scale=2.0**-30)


def test_scale_group_needs_a_name():
    with pytest.raises(ValueError, match="scale_group needs a non-empty name"):
        alj.scale_group("")


# ------------------------------------------------------------------ state reads


def test_group_vector_names_the_missing_group():
    v = alj.GroupVector(("", "a"), jnp.array([1.0, 2.0]))
    with pytest.raises(KeyError, match="'msg_missing'"):
        v["msg_missing"]
    split = alj.GroupVector(("", "a"), jnp.array([1.0, 2.0]), split=True)
    with pytest.raises(KeyError, match="'msg_missing'"):
        split["msg_missing"]


def test_warm_start_of_unknown_groups_is_refused():
    _, _, state = _one_group()
    with pytest.raises(KeyError, match=r"no scale groups \['nope'\] in this state "
                                       r"\(groups: \['', 'msg_d'\]\)"):
        state.with_log2_scales({"msg_d": 3, "nope": 1})


def test_state_attribute_typo_is_named():
    _, _, state = _one_group()
    with pytest.raises(AttributeError, match="AdaptiveScaleState has no attribute 'los_scale'"):
        state.los_scale  # noqa: B018


# ------------------------------------------------------------------ adaptive gradients


def test_adaptive_value_and_grad_needs_a_callable():
    with pytest.raises(TypeError, match="fun must be the loss function, got 42"):
        alj.adaptive_value_and_grad(42)


def test_a_parameter_leaf_that_is_no_array_is_refused():
    params = {"msg_d": {"w": jnp.ones(2)}, "temperature": 1.0}
    state = alj.adaptive_unscale(alj.adaptive(compute_dtype=F16)).init(params)
    loss = lambda p, x: jnp.sum(p["msg_d"]["w"] * x) * p["temperature"]
    with pytest.raises(TypeError, match="every parameter leaf must be an array"):
        alj.adaptive_value_and_grad(loss)(state, params, jnp.ones(2))


def test_a_group_marked_after_init_is_unknown_to_the_state(monkeypatch):
    """A marked block holding its modules' parameters below it is a group of its own only
    if it was marked when the state was built."""
    monkeypatch.setattr(_record, "MARKED", set())  # marked here, not by another test
    params = {"msg_blk": {"a": {"w": jnp.eye(2)}, "b": {"w": jnp.eye(2)}}}
    state = alj.adaptive_unscale(alj.adaptive(groups="module", compute_dtype=F16)).init(params)
    assert "msg_blk" not in state.groups
    blk = alj.scale_group("msg_blk")(lambda p, x: x @ p["a"]["w"] @ p["b"]["w"])
    loss = lambda p, x: jnp.sum(blk(p["msg_blk"], x))
    with pytest.raises(ValueError, match=r"the loss calls scale groups \['msg_blk'\] that the "
                                         r"optimizer state does not know"):
        alj.adaptive_value_and_grad(loss)(state, params, jnp.ones((1, 2)))


def test_hand_built_statistics_of_unknown_groups_are_refused():
    params, tx, state = _one_group()
    names = ("", "msg_other")
    zeros = alj.GroupVector(names, jnp.zeros(2), split=True)
    stats = alj.ScaleStats(log2_scales=zeros, amax=zeros, bad=zeros,
                           nonfinite=jnp.bool_(False))
    with pytest.raises(ValueError, match=r"scale_stats has groups \['msg_other'\] that this "
                                         r"optimizer state does not know"):
        tx.update(jax.tree_util.tree_map(jnp.zeros_like, params), state, params,
                  scale_stats=stats)


def test_check_gradients_refuses_a_scaler_in_place_of_the_state():
    params, _, _ = _one_group()
    loss = lambda p: jnp.sum(p["msg_d"]["w"])
    with pytest.raises(TypeError, match="reads the scaler from opt_state: drop the scaler"):
        alj.diagnostics.check_gradients(loss, loss, alj.adaptive(), params)


# ------------------------------------------------------------------ numerics


@pytest.mark.parametrize("scale", [jnp.ones(2), jnp.array(True)], ids=["vector", "bool"])
def test_loss_scale_of_refuses_an_array_that_is_no_scalar_number(scale):
    with pytest.raises(ValueError, match="scale must be a scalar number, got an array"):
        numerics.loss_scale_of(scale)


def test_compare_refuses_runs_of_other_structures():
    x = jnp.ones(2)
    with pytest.raises(ValueError, match="parameter gradients differ in structure"):
        numerics.compare(numerics.ProbeGrads({"a": x}, {}), numerics.ProbeGrads({"b": x}, {}))


def test_compare_refuses_scales_unlike_the_gradients():
    x = jnp.ones(2)
    ref = numerics.ProbeGrads({"a": x}, {"t": x})
    with pytest.raises(ValueError, match="param_scales must be a scalar or a pytree like"):
        numerics.compare(ref, numerics.ProbeGrads({"a": x}, {"t": x}, {"zz": 1.0}))
    with pytest.raises(ValueError, match="cotangent_scales must be a scalar or a pytree like"):
        numerics.compare(ref, numerics.ProbeGrads({"a": x}, {"t": x}, 1.0, {"u": 1.0}))


def test_linen_probe_refuses_integer_parameters():
    probe = numerics.linen_probe(nn.Dense(2, dtype=jnp.float16),
                                 lambda m, p, b: jnp.sum(m.apply({"params": p}, b)))
    params = {"kernel": jnp.ones((2, 2), jnp.int32), "bias": jnp.zeros(2)}
    with pytest.raises(TypeError, match="params holds a leaf of dtype int32; every parameter "
                                        "must be a floating-point array"):
        probe(params, jnp.ones((1, 2)))


def test_nnx_probe_without_a_dtype_to_override_asks_for_a_reference():
    class NoDtype(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    with pytest.raises(ValueError, match="NoDtype has no submodule with a dtype attribute "
                                         "to override.*pass ref_model="):
        numerics.nnx_probe(NoDtype(), lambda m, b: jnp.sum(m.w * b), fmt=F16)



# ------------------------------------------------------------------ and no other warning


@pytest.mark.parametrize("statistic", ["amax", "gaussian", "quantile"])
def test_an_adaptive_step_warns_of_nothing(statistic):
    """Tracing and running a step (per module, fp16, an overflow retried) gives no warning
    at all: no implicit dtype cast, no deprecation, nothing a user would have to filter."""
    params = {"msg_w1": {"w": jnp.full((4, 4), 0.5, jnp.float16)},
              "msg_w2": {"w": jnp.full((4, 4), 0.5, jnp.float16)}}
    one = alj.scale_group("msg_w1")(lambda w, x: jnp.tanh(x @ w["w"]))
    two = alj.scale_group("msg_w2")(lambda w, x: x @ w["w"])
    tx = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module",
                                                          statistic=statistic))
    state = tx.init(params)

    def loss(p, x):
        return jnp.sum(two(p["msg_w2"], one(p["msg_w1"], x)).astype(jnp.float32))

    @jax.jit
    def step(state, p, x):
        value, grads, stats = alj.adaptive_value_and_grad(loss)(state, p, x)
        return tx.update(grads, state, p, loss=value, scale_stats=stats)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # step 0 at scale 1 is skipped, step 1 applied
            updates, state = step(state, params, jnp.ones((2, 4), jnp.float16))
        jax.block_until_ready(updates)
    assert bool(alj.scale_state(state).last_applied)
