"""Adaptive scaling on 8 CPU devices: SPMD jit equals one device; under ``shard_map``
the devices agree on every scale through ``axis_name``, and only through it where
nothing else reduces their statistics."""

from __future__ import annotations

import dataclasses
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
SCALER = alj.adaptive(groups="module", compute_dtype="float16")  # fp32 models scale too
MODEL = MLP(dtype=jnp.float32)


def loss_fn(params, x, y):
    return classification_loss(MODEL, {"params": params}, x, y)[0] * 2.0**-20


TX = alj.adaptive_scaled(optax.adam(1e-2), SCALER)


def _data(steps=4, batch=32):
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(steps, batch, 8)).astype(np.float32)
    ys = rng.integers(0, 4, size=(steps, batch))
    return xs, ys


@jax.jit
def spmd_step(params, state, x, y):
    loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(state, params, x, y)
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
    for t, ((p1, s1), (p8, s8)) in enumerate(zip(single, sharded)):
        a1, a8 = alj.scale_state(s1), alj.scale_state(s8)
        assert {g: float(v) for g, v in a1.log2_scales.items()} == {
            g: float(v) for g, v in a8.log2_scales.items()}
        # Step 0 ran at scale 1, far below its statistics' scales: skipped on both.
        assert bool(a8.last_applied) == bool(a1.last_applied) == (t > 0)
        assert int(a8.total_retries) == int(a1.total_retries) == 0
        for u, v in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p8)):
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-6)
    # The statistics really moved the scales (the loss is 2^-20 small).
    assert all(float(v) > 10 for v in alj.scale_state(sharded[-1][1]).log2_scales.values())


@functools.cache
def mapped_step(mesh, axis_name, check_vma, scaler=SCALER):
    tx = alj.adaptive_scaled(optax.sgd(0.1), scaler, axis_name=axis_name)

    def local(params, state, x, y):
        loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(state, params, x, y)
        _, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        # A leading axis of size 1 so that each device's own state comes back.
        return jax.tree_util.tree_map(lambda a: a[None], state)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                      out_specs=P("data"), check_vma=check_vma)
    return tx, jax.jit(f)


def _per_device_scales(mesh, axis_name, check_vma, scaler=SCALER):
    """Each device's batch shard has a different magnitude (2^d): local statistics differ
    by 7 binades."""
    xs, ys = _data(steps=1, batch=8 * N)
    x = xs[0] * np.repeat(2.0 ** np.arange(N), 8)[:, None].astype(np.float32)
    params = MODEL.init(jax.random.key(0), x)["params"]
    tx, step = mapped_step(mesh, axis_name, check_vma, scaler)
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, state = jax.device_put((params, tx.init(params)), rep)
    out = alj.scale_state(step(params, state, jax.device_put(x, dat),
                               jax.device_put(ys[0], dat)))
    return params, x, ys[0], out


@pytest.mark.parametrize("axis_name,retries", [pytest.param("data", 0, marks=pytest.mark.slow),
                                               (None, 0), (None, 4)],
                         ids=["axis_name", "no-axis_name", "no-axis_name-retries"])
def test_typed_shard_map_devices_agree_and_equal_one_device(mesh, axis_name, retries):
    """With ``check_vma`` (the default) JAX types every cotangent as varying over the
    mapped axis: the scale points reduce their statistics over it and the gradient of a
    replicated parameter is summed over the devices, so the devices agree even without
    ``axis_name``, on the scales one device picks for the whole batch. With retries the
    state carried through the retry loop is typed as varying, and so is each same-step
    choice made from it: it is handed back to its token's primal reduced over the map."""
    scaler = dataclasses.replace(SCALER, retries=retries)
    params, x, y, ad = _per_device_scales(mesh, axis_name, check_vma=True, scaler=scaler)
    for g in ad.groups:
        v = np.asarray(ad.log2_scales[g])
        assert np.all(v == v[0]), g
    # One device on the whole batch, with the loss as shard_map sums it (8 local means).
    summed = lambda p, x, y: loss_fn(p, x, y) * N
    tx = alj.adaptive_scaled(optax.adam(1e-2), scaler)
    state = tx.init(params)
    _, grads, stats = jax.jit(alj.adaptive_value_and_grad(summed))(state, params, x, y)
    single = alj.scale_state(tx.update(grads, state, params, scale_stats=stats)[1])
    for g in ad.groups:
        assert float(np.asarray(ad.log2_scales[g])[0]) == float(single.log2_scales[g]), g


def test_untyped_shard_map_devices_agree_only_with_axis_name(mesh):
    """With ``check_vma=False`` nothing reduces the statistics or the gradients over the
    devices: without ``axis_name`` each device picks scales from its own shard (they
    differ), with it every device picks the same."""
    _, _, _, local = _per_device_scales(mesh, None, check_vma=False)
    _, _, _, agreed = _per_device_scales(mesh, "data", check_vma=False)
    spread = {g: np.ptp(np.asarray(local.log2_scales[g])) for g in local.groups}
    assert max(spread.values()) >= 4, spread  # 7 binades of magnitude between the shards
    for g in agreed.groups:
        v = np.asarray(agreed.log2_scales[g])
        assert np.all(v == v[0]), g
        # The agreed scale is the one the largest shard calls for (the smallest scale).
        assert v[0] == np.min(np.asarray(local.log2_scales[g])), g
