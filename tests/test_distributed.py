"""Distributed skips on 8 CPU devices (tests/conftest.py sets XLA_FLAGS).

* ``shard_map``: each device holds its own shard of the parameters and gradients, so a
  device sees only its own infs; ``unscale(axis_name=...)`` reduces the finiteness
  check so every device skips and backs off together.
* SPMD ``jit``: arrays are global, the check is global by construction; the sharded
  run equals the single-device run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adaloss_jax as alj

N = 8
INITIAL = 2.0**10
POLICY = alj.dynamic(initial_scale=INITIAL, period=2)

def _stack(tree):
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (N,) + a.shape), tree)


@functools.cache
def sharded_step(mesh, axis_name):
    tx = alj.loss_scaled(optax.sgd(0.1), POLICY, axis_name=axis_name)

    def local(w, opt_state, x, bad_device):
        # Everything but bad_device carries a leading device axis of local size 1.
        w, opt_state, x = jax.tree_util.tree_map(lambda a: a[0], (w, opt_state, x))
        loss_fn = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)
        loss, grads, stats = alj.value_and_grad(loss_fn)(opt_state, w)
        mine = jax.lax.axis_index("data") == bad_device
        grads = grads.at[0, 0].set(jnp.where(mine, jnp.inf, grads[0, 0]))
        updates, opt_state = tx.update(grads, opt_state, w, loss=loss, scale_stats=stats)
        w = optax.apply_updates(w, updates)
        return jax.tree_util.tree_map(lambda a: a[None], (w, opt_state))

    f = jax.shard_map(
        local, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P()), out_specs=P("data")
    )
    return tx, jax.jit(f)


@pytest.mark.parametrize("axis_name", ["data", None], ids=["axis_name", "no-axis_name"])
def test_shard_map_one_device_inf_makes_all_skip(mesh, axis_name):
    tx, step = sharded_step(mesh, axis_name)
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, (N, 4, 3))  # a different parameter shard per device
    x = jax.random.normal(k2, (N, 5, 4))
    opt_state = _stack(tx.init(w[0]))
    w, opt_state, x = jax.device_put((w, opt_state, x), NamedSharding(mesh, P("data")))

    w1, s1 = step(w, opt_state, x, jnp.int32(-1))  # all finite
    st1 = alj.scale_state(s1)
    assert np.all(np.asarray(st1.last_applied))
    assert np.all(np.asarray(st1.loss_scale) == INITIAL)

    w2, s2 = step(w1, s1, x, jnp.int32(3))  # inf on device 3 only
    st2 = alj.scale_state(s2)
    applied = np.asarray(st2.last_applied)
    scales = np.asarray(st2.loss_scale)
    changed = np.asarray(jnp.any(w2 != w1, axis=(1, 2)))
    if axis_name is not None:
        # Every device skipped and backed off identically; no shard moved.
        assert not applied.any()
        assert np.all(scales == INITIAL / 2)
        assert not changed.any()
        for field in alj.LossScaleState._fields:
            values = np.asarray(getattr(st2, field))
            assert np.all(values == values[0]), field
    else:
        # The contrast: without the reduction only device 3 skips, scales disagree.
        assert applied.tolist() == [d != 3 for d in range(N)]
        assert scales[3] == INITIAL / 2 and np.all(np.delete(scales, 3) == 2 * INITIAL)
        assert changed.tolist() == [d != 3 for d in range(N)]


# --- SPMD jit -------------------------------------------------------------------


@jax.custom_vjp
def poison_rows(h, bad_rows):
    """Identity forward; the gradient flowing through rows in ``bad_rows`` becomes inf."""
    return h


poison_rows.defvjp(
    lambda h, bad_rows: (h, bad_rows),
    lambda bad_rows, g: (g * jnp.where(bad_rows[:, None], jnp.inf, 1.0).astype(g.dtype), None),
)


def loss_fn(params, x, y, bad_rows):
    # fp32 compute: the comparison below is about sharding, not about fp16 rounding
    # (which would make the 8-way reordered batch sums differ by fp16 ulps).
    h = poison_rows(jnp.tanh(x @ params["w1"]), bad_rows)
    return jnp.mean((h @ params["w2"] - y) ** 2)


SPMD_TX = alj.loss_scaled(optax.adamw(1e-2), POLICY)


@jax.jit
def spmd_step(params, opt_state, x, y, bad_rows):
    loss, grads, stats = alj.value_and_grad(loss_fn)(opt_state, params, x, y, bad_rows)
    updates, opt_state = SPMD_TX.update(grads, opt_state, params, loss=loss, scale_stats=stats)
    return optax.apply_updates(params, updates), opt_state


def test_spmd_jit_sharded_batch_equals_single_device(mesh):
    steps, batch = 5, 64
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    params = {"w1": jax.random.normal(k1, (6, 16)) * 0.5, "w2": jax.random.normal(k2, (16, 2))}
    xs = jax.random.normal(k3, (steps, batch, 6))
    ys = jax.random.normal(k4, (steps, batch, 2))
    # Step 2: one example on device 5's shard (rows 40..47) gives an inf gradient.
    bad = np.zeros((steps, batch), bool)
    bad[2, 42] = True

    def run(put_batch, put_state):
        p, s = put_state(params), put_state(SPMD_TX.init(params))
        out = []
        for t in range(steps):
            p, s = spmd_step(p, s, put_batch(xs[t]), put_batch(ys[t]), put_batch(bad[t]))
            out.append((p, s))
        return out

    one = jax.devices()[0]
    single = run(lambda a: jax.device_put(a, one), lambda a: jax.device_put(a, one))
    sharded = run(
        lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))),
        lambda a: jax.device_put(a, NamedSharding(mesh, P())),
    )
    assert len(sharded[0][0]["w1"].sharding.device_set) == N
    for t, ((p1, s1), (p8, s8)) in enumerate(zip(single, sharded)):
        a1, a8 = alj.scale_state(s1), alj.scale_state(s8)
        for field in alj.LossScaleState._fields:
            assert np.asarray(getattr(a1, field)) == np.asarray(getattr(a8, field)), (t, field)
        assert bool(a8.last_applied) == (t != 2)
        # The batch mean is reduced in a different order across 8 shards: fp32 rounding.
        for k in params:
            np.testing.assert_allclose(p8[k], p1[k], rtol=1e-5, atol=1e-6)
    st = alj.scale_state(sharded[-1][1])
    assert (int(st.total_skipped), float(st.loss_scale)) == (1, 2 * INITIAL)
    # The skipped step left the sharded run's parameters exactly as they were.
    for k in params:
        np.testing.assert_array_equal(sharded[2][0][k], sharded[1][0][k])


# --- tensor-parallel shard_map: a state built on the full parameters -----------------


@pytest.mark.parametrize("make_tx", [
    lambda axis: alj.loss_scaled(optax.sgd(0.1), POLICY, axis_name=axis),
    lambda axis: alj.adaptive_scaled(  # an fp32 model, scaled all the same
        optax.sgd(0.1), alj.adaptive(groups="module", compute_dtype="float16"),
        axis_name=axis),
], ids=["loss_scaled", "adaptive_scaled"])
def test_state_of_full_parameters_accepts_their_shards(mesh, make_tx):
    """``tx.init`` on the full parameters, the step under ``shard_map`` with a parameter
    sharded along its first axis: each device's gradient is its shard (smaller than the
    parameter the state was built for), and the state takes it. The update equals the
    one of the same step on one device."""
    tx, one_tx = make_tx("data"), make_tx(None)
    adaptive = isinstance(alj.scale_state(tx.init({"w": jnp.zeros(1)})),
                          alj.AdaptiveScaleState)
    dense = alj.scale_group("d")(lambda w, x: x @ w)
    params = {"d": jax.random.normal(jax.random.key(0), (N * 2, 3))}
    x = jax.random.normal(jax.random.key(1), (5, N * 2))

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(jax.lax.psum(dense(p["d"], x), "data")) ** 2)

    def step(p, opt_state, x, vg):
        loss, grads, stats = vg(loss_fn)(opt_state, p, x)
        updates, opt_state = tx.update(grads, opt_state, p, loss=loss, scale_stats=stats)
        return optax.apply_updates(p, updates), opt_state

    vg = alj.adaptive_value_and_grad if adaptive else alj.value_and_grad
    opt_state = tx.init(params)
    sharded = jax.jit(jax.shard_map(
        functools.partial(step, vg=vg), mesh=mesh, in_specs=(P("data"), P(), P(None, "data")),
        out_specs=(P("data"), P())))
    new, _ = sharded(jax.device_put(params, NamedSharding(mesh, P("data"))), opt_state,
                     jax.device_put(x, NamedSharding(mesh, P(None, "data"))))

    def one_loss(p, x):
        return jnp.mean(jnp.tanh(dense(p["d"], x)) ** 2)

    loss, grads, stats = jax.jit(vg(one_loss))(opt_state, params, x)
    updates, _ = one_tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
    np.testing.assert_allclose(new["d"], optax.apply_updates(params, updates)["d"],
                               rtol=1e-5, atol=1e-7)
