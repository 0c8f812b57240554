"""Conformance under sharding, for every front end (linen, NNX, Equinox, pure JAX): the
same per-module training step, jitted once with everything on one device and once with
the batch sharded over 8 devices (SPMD ``jit``, ``NamedSharding``), chooses the same
scales and skip decisions at every step, and the parameters agree within fp16
reduction-order rounding. The model has a residual (a fan-in) and a head; the loss is
2^-16 small so that the scales have to move."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adaloss_jax as alj
from adaloss_jax.equinox import eqx_adaptive_value_and_grad
from adaloss_jax.flax import nnx_adaptive_value_and_grad

D, C, BATCH, STEPS, TINY = 8, 4, 16, 3, 2.0**-16
F16 = jnp.float16


def _xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean() * TINY


# ------------------------------------------------------------- one model, four front ends


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(D, dtype=F16)(x))
        h = h + nn.Dense(D, dtype=F16)(h)
        return nn.Dense(C, dtype=F16)(h)


def _linen():
    model = LinenNet()
    params = model.init(jax.random.key(0), jnp.zeros((1, D)))["params"]
    vg = lambda scaler: alj.adaptive_value_and_grad(
        lambda p, x, y: _xent(model.apply({"params": p}, x), y))
    return params, lambda scaler, state, params, x, y: vg(scaler)(state, params, x, y)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(D, D, dtype=F16, rngs=rngs)
        self.b = nnx.Linear(D, D, dtype=F16, rngs=rngs)
        self.head = nnx.Linear(D, C, dtype=F16, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.a(x))
        return self.head(h + self.b(h))


def _nnx():
    graphdef, params = nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param)
    params = nnx.as_pure(params)

    def vg(scaler, state, params, x, y):
        model = nnx.merge(graphdef, params)
        loss, grads, stats = nnx_adaptive_value_and_grad(
            lambda m, x, y: _xent(m(x), y))(state, model, x, y)
        return loss, nnx.as_pure(grads), stats

    return params, vg


class EqxDense(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __init__(self, din, dout, key):
        self.weight = jax.random.normal(key, (din, dout)) / din**0.5
        self.bias = jnp.zeros((dout,))

    def __call__(self, x):
        return x @ self.weight.astype(F16) + self.bias.astype(F16)


class EqxNet(eqx.Module):
    a: EqxDense
    b: EqxDense
    head: EqxDense

    def __init__(self, key):
        ka, kb, kh = jax.random.split(key, 3)
        self.a, self.b, self.head = EqxDense(D, D, ka), EqxDense(D, D, kb), EqxDense(D, C, kh)

    def __call__(self, x):
        h = jnp.tanh(self.a(x.astype(F16)))
        return self.head(h + self.b(h))


def _equinox():
    params, static = eqx.partition(EqxNet(jax.random.key(0)), eqx.is_inexact_array)

    def vg(scaler, state, params, x, y):
        return eqx_adaptive_value_and_grad(lambda m, x, y: _xent(m(x), y))(
            state, eqx.combine(params, static), x, y)

    return params, vg


def _pure():
    keys = jax.random.split(jax.random.key(0), 3)
    layer = lambda k, din, dout: {"w": jax.random.normal(k, (din, dout)) / din**0.5,
                                  "b": jnp.zeros((dout,))}
    params = {"a": layer(keys[0], D, D), "b": layer(keys[1], D, D),
              "head": layer(keys[2], D, C)}
    dense = {n: alj.scale_group(n)(lambda p, x: x @ p["w"].astype(F16) + p["b"].astype(F16))
             for n in params}

    def loss_fn(p, x, y):
        h = jnp.tanh(dense["a"](p["a"], x.astype(F16)))
        return _xent(dense["head"](p["head"], h + dense["b"](p["b"], h)), y)

    return params, lambda scaler, state, params, x, y: alj.adaptive_value_and_grad(
        loss_fn)(state, params, x, y)


FRONT_ENDS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox, "pure-jax": _pure}


@pytest.mark.parametrize("front_end", list(FRONT_ENDS))
def test_sharded_batch_gives_the_single_device_scales(mesh, front_end):
    params, vg = FRONT_ENDS[front_end]()
    scaler = alj.adaptive(groups="module")
    tx = alj.adaptive_scaled(optax.sgd(0.1), scaler)

    @jax.jit
    def step(params, state, x, y):
        loss, grads, stats = vg(scaler, state, params, x, y)
        updates, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, BATCH, D)).astype(np.float32)
    ys = rng.integers(0, C, size=(STEPS, BATCH))

    def run(batch_sharding, replicated):
        p, s = jax.device_put((params, tx.init(params)), replicated)
        out = []
        for x, y in zip(xs, ys):
            p, s = step(p, s, jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))
            ad = alj.scale_state(s)
            out.append((p, {g: float(v) for g, v in ad.log2_scales.items()},
                        bool(ad.base.last_applied)))
        return out

    one = jax.devices()[0]
    single = run(one, one)
    sharded = run(NamedSharding(mesh, P("data")), NamedSharding(mesh, P()))
    for t, ((p1, s1, a1), (p8, s8, a8)) in enumerate(zip(single, sharded)):
        assert s1 == s8, (front_end, t)
        assert a1 == a8, (front_end, t)
        for u, v in zip(jax.tree_util.tree_leaves(p1), jax.tree_util.tree_leaves(p8)):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-3, atol=1e-6)
    # Every module got a scale of its own, moved far above 1 by the 2^-16 loss.
    scales = sharded[-1][1]
    assert len(scales) == 4 and all(v > 8 for g, v in scales.items() if g), scales
    assert all(a for _, _, a in sharded[1:]), "a step after the first was skipped"
