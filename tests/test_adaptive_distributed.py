"""Adaptive scaling on 8 CPU devices: SPMD jit equals one device; under shard_map an
``axis_name`` makes every device choose the same per-group scales."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import MLP, classification_loss
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adaloss_jax as alj

N = 8
SCALER = alj.adaptive(groups="module")
MODEL = MLP(dtype=jnp.float32)


def loss_fn(params, x, y):
    return classification_loss(MODEL, {"params": params}, x, y)[0] * 2.0**-20


TX = optax.chain(alj.adaptive_unscale(SCALER), alj.skip_nonfinite(optax.adam(1e-2)))


def _data(steps=4, batch=32):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, batch, 8)).astype(np.float32)
    ys = rng.integers(0, 4, size=(steps, batch))
    return xs, ys


@jax.jit
def spmd_step(params, state, x, y):
    loss, grads, stats = alj.adaptive_value_and_grad(loss_fn, SCALER)(state, params, x, y)
    updates, state = TX.update(grads, state, params, loss=loss, scale_stats=stats)
    return optax.apply_updates(params, updates), state


def test_spmd_jit_sharded_batch_equals_single_device(mesh):
    xs, ys = _data()
    params = MODEL.init(jax.random.key(0), xs[0])["params"]

    def run(put_batch, put_state):
        p, s = put_state(params), put_state(TX.init(params))
        out = []
        for x, y in zip(xs, ys):
            p, s = spmd_step(p, s, put_batch(x), put_batch(y))
            out.append((p, s))
        return out

    one = jax.devices()[0]
    single = run(lambda a: jax.device_put(a, one), lambda a: jax.device_put(a, one))
    sharded = run(
        lambda a: jax.device_put(a, NamedSharding(mesh, P("data"))),
        lambda a: jax.device_put(a, NamedSharding(mesh, P())),
    )
    for (p1, s1), (p8, s8) in zip(single, sharded):
        a1, a8 = alj.adaptive_state(s1), alj.adaptive_state(s8)
        assert {g: float(v) for g, v in a1.log2_scales.items()} == {
            g: float(v) for g, v in a8.log2_scales.items()
        }
        assert bool(a8.base.last_applied)
        for u, v in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p8)):
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)
    # The statistics really moved the scales (the loss is 2^-20 small).
    assert all(float(v) > 10 for v in alj.adaptive_state(sharded[-1][1]).log2_scales.values())


@functools.cache
def mapped_step(mesh, axis_name):
    tx = optax.chain(
        alj.adaptive_unscale(SCALER, axis_name=axis_name), alj.skip_nonfinite(optax.sgd(0.1))
    )

    def local(params, state, x, y):
        loss, grads, stats = alj.adaptive_value_and_grad(loss_fn, SCALER)(state, params, x, y)
        _, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        # A leading axis of size 1 so that each device's own state comes back.
        return jax.tree_util.tree_map(lambda a: a[None], state)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                  out_specs=P("data"))
    return tx, jax.jit(f)


@pytest.mark.parametrize("axis_name", ["data", None], ids=["axis_name", "no-axis_name"])
def test_shard_map_devices_agree_on_scales(mesh, axis_name):
    """Each device's batch shard has a different magnitude (2^d), so local statistics
    differ by 7 binades; yet every device picks the same scales. The scale points reduce
    cotangent statistics over the mapped axes (a custom_vjp cotangent must have its
    input's replicated type), and the gradient of a replicated parameter is already
    summed over devices, so this holds even without ``axis_name``; ``axis_name`` adds the
    reduction for parameters that are themselves sharded (and for pmap)."""
    xs, ys = _data(steps=1, batch=8 * N)
    x = xs[0] * np.repeat(2.0 ** np.arange(N), 8)[:, None].astype(np.float32)
    params = MODEL.init(jax.random.key(0), x)["params"]
    tx, step = mapped_step(mesh, axis_name)
    state = tx.init(params)
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, state = jax.device_put((params, state), rep)
    out = step(params, state, jax.device_put(x, dat), jax.device_put(ys[0], dat))
    ad = alj.adaptive_state(out)
    for g, v in ad.log2_scales.items():
        v = np.asarray(v)
        assert np.all(v == v[0]), g
    assert np.all(np.asarray(ad.base.last_applied))
    # And they equal one device's on the whole batch, with the loss as shard_map sums it
    # (the sum of the 8 local means, i.e. 8x the global mean).
    single = spmd_one(params, TX.init(params), x, ys[0])
    for g, v in alj.adaptive_state(single).log2_scales.items():
        assert float(np.asarray(ad.log2_scales[g])[0]) == float(v), g


@jax.jit
def spmd_one(params, state, x, y):
    summed = lambda p, x, y: loss_fn(p, x, y) * N
    loss, grads, stats = alj.adaptive_value_and_grad(summed, SCALER)(state, params, x, y)
    return TX.update(grads, state, params, loss=loss, scale_stats=stats)[1]
