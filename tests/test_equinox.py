"""The Equinox front end: unmodified eqx.Module models, scaled per module, exact against
fp32 and never worse than one global scale (the checks of the linen and NNX property
tests), including stacked layers run by ``jax.lax.scan`` and a module applied twice."""

from __future__ import annotations

import _graph
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_stream_property import assert_conformance

import adaloss_jax as alj
from adaloss_jax.equinox import eqx_adaptive_value_and_grad

W, V, T, B = 8, 16, 6, 4


class Dense(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    dtype: object = eqx.field(static=True)

    def __init__(self, din, dout, dtype, key):
        self.weight = jax.random.normal(key, (din, dout)) / din**0.5
        self.bias = jnp.zeros((dout,))
        self.dtype = dtype

    def __call__(self, x, *, gate=1.0):
        y = x.astype(self.dtype) @ self.weight.astype(self.dtype) + self.bias.astype(self.dtype)
        return jnp.tanh(y) * gate


class Net(eqx.Module):
    embed: jax.Array
    shared: Dense
    layers: list
    stack: Dense
    head: Dense
    ops: tuple = eqx.field(static=True)
    dtype: object = eqx.field(static=True)

    def __init__(self, ops, dtype, key):
        keys = jax.random.split(key, len(ops) + 4)
        self.embed = jax.random.normal(keys[0], (V, W))
        self.shared = Dense(W, W, dtype, keys[1])
        self.layers = [Dense(2 * W if op == "concat" else W, W, dtype, k)
                       for op, k in zip(ops, keys[4:])]
        # Two stacked layers (leading axis), run by jax.lax.scan.
        self.stack = eqx.filter_vmap(lambda k: Dense(W, W, dtype, k))(jax.random.split(keys[2], 2))
        self.head = Dense(W, V, dtype, keys[3])
        self.ops, self.dtype = tuple(ops), dtype

    def __call__(self, tokens):
        def scan(_, x):
            params, static = eqx.partition(self.stack, eqx.is_array)
            return jax.lax.scan(lambda c, p: (c + eqx.combine(p, static)(c), None), x,
                                params)[0]

        x = _graph.run(self.ops, self.embed[tokens].astype(self.dtype),
                       layer=lambda i, x, gate=1.0: self.layers[i](x, gate=gate),
                       shared=self.shared, scan=scan)
        return self.head(x) * 4.0


OPS = _graph.OPS


def _loss(tiny):
    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean() * tiny

    return loss_fn


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array)


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@pytest.mark.slow
@given(ops=st.lists(st.sampled_from(OPS), min_size=2, max_size=4))
@example(ops=["scan", "reuse", "concat"])
def test_random_eqx_graphs_exact_and_no_worse_than_global(ops):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(B, T + 1)))
    loss_fn = _loss(2.0**-16)
    m32 = Net(ops, jnp.float32, jax.random.key(0))
    ref = _params(eqx.filter_grad(loss_fn)(m32, tokens))
    results = {}
    for groups in ("module", "global"):
        scaler = alj.adaptive(groups=groups)
        model = Net(ops, jnp.float16, jax.random.key(0))
        tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))
        state = tx.init(_params(model))
        vg = eqx_adaptive_value_and_grad(loss_fn)

        @eqx.filter_jit
        def step(model, state, vg=vg, tx=tx):
            loss, g, stats = vg(state, model, tokens)
            updates, state = tx.update(g, state, _params(model), loss=loss, scale_stats=stats)
            return updates, state, g

        # Every module the loss reaches has its own scale (the scanned stack included).
        reached = {f"layers/{i}" for i, op in enumerate(ops) if op != "scan"} | {"head"}
        reached |= {"stack"} if "scan" in ops else set()
        reached |= {"shared"} if "reuse" in ops else set()
        assert_conformance(lambda s, step=step, model=model: step(model, s), state, results,
                           groups, ref, ops, reached)
    # The user's model is untouched: its modules keep their classes.
    assert type(model.head) is Dense and type(model.stack) is Dense


def test_no_module_call_is_an_error_that_names_the_fix():
    model = Net(("dense",), jnp.float16, jax.random.key(0))
    scaler = alj.adaptive(groups="module")
    state = alj.adaptive_unscale(scaler).init(_params(model))

    def loss_fn(model, x):  # reads an array but calls no module
        return jnp.sum(model.embed * x)

    with pytest.raises(ValueError, match="Equinox"):
        eqx_adaptive_value_and_grad(loss_fn)(state, model, 1.0)


class _Residual(eqx.Module):
    """Linear layers with fp16 weights on float32 inputs (so the model computes in
    float32), one residual block."""

    emb: eqx.nn.Linear
    a: eqx.nn.Linear
    b: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        f16 = jnp.float16
        self.emb = eqx.nn.Linear(8, 16, key=k[0], dtype=f16)
        self.a = eqx.nn.Linear(16, 16, key=k[1], dtype=f16)
        self.b = eqx.nn.Linear(16, 16, key=k[2], dtype=f16)
        self.head = eqx.nn.Linear(16, 4, key=k[3], dtype=f16)

    def __call__(self, x):
        h = jax.vmap(self.emb)(x)
        h = h + 0.5 * jax.vmap(self.b)(jnp.tanh(jax.vmap(self.a)(h)))
        return jax.vmap(self.head)(h)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_a_float32_model_simulating_fp8_skips_nothing_after_step_0(fmt):
    """A float32 model with its gradients simulated in fp8 (``simulate=True``) and a
    small loss (x 2^-12): the root's rows are all float32 (no cast narrows the loss),
    where nothing flushes, so its statistics (calling for a far higher scale) refuse no
    step as computed below its scale: nothing is skipped. (Counted, they refused step
    1.)"""
    model = _Residual(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (64, 8))

    def loss_fn(m, x):
        return jnp.mean(m(x).astype(jnp.float32) ** 2) * 2.0**-12

    scaler = alj.adaptive(groups="module", grad_dtype=fmt, simulate=True)
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(0.0)))
    params = eqx.filter(model, eqx.is_inexact_array)
    vg = eqx_adaptive_value_and_grad(loss_fn)

    @jax.jit
    def step(opt_state):
        loss, grads, stats = vg(opt_state, model, x)
        return tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)[1]

    opt_state, skipped = tx.init(params), []
    for i in range(4):
        opt_state = step(opt_state)
        if not bool(alj.scale_state(opt_state).last_applied):
            skipped.append(i)
    assert skipped == []


class _Normed(eqx.Module):
    """Linear -> BatchNorm (Equinox's stateful layer: its running statistics live in an
    ``eqx.nn.State`` keyed by the ``StateIndex`` it holds) -> Linear."""

    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, dtype, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(4, 8, key=k1, dtype=dtype)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch", dtype=dtype)
        self.head = eqx.nn.Linear(8, 3, key=k2, dtype=dtype)

    def __call__(self, x, state):
        h, state = self.bn(self.lin(x), state)
        return self.head(jnp.tanh(h)), state


def test_a_stateful_layer_keeps_its_state_and_its_gradients_are_fp32s():
    """``eqx.nn.BatchNorm`` in a model made with ``eqx.nn.make_with_state``, its state
    passed through the loss and returned in ``aux``: the private copy's
    ``StateIndex`` keeps its class (``eqx.nn.State`` checks it by identity; swapped, it
    raised "Can only use eqx.nn.StateIndex's as state keys"). Each module gets a scale,
    the new running statistics are plain Equinox's, and in fp32 at arbitrary scales
    the gradients are fp32's."""
    x = jax.random.normal(jax.random.key(1), (16, 4))
    y = jnp.arange(16) % 3

    def loss_fn(model, state, x, y):
        out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None),
                              out_axes=(0, None))(x, state)
        ce = optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), y)
        return ce.mean(), state

    model, state = eqx.nn.make_with_state(_Normed)(jnp.float32, jax.random.key(0))
    (_, want_state), want = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
        model, state, x, y)
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=False,
                          max_rise=1000)  # (applied however far below its statistics)
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))
    opt_state = tx.init(_params(model))
    log2 = dict(zip(opt_state[0].groups, [7, -5, 11, 2]))
    opt_state = (opt_state[0].with_log2_scales(log2), opt_state[1])

    @eqx.filter_jit
    def step(opt_state, model, state):
        (loss, new_state), g, stats = eqx_adaptive_value_and_grad(loss_fn, has_aux=True)(
            opt_state, model, state, x, y)
        updates, opt_state = tx.update(g, opt_state, _params(model), loss=loss,
                                       scale_stats=stats)
        return updates, new_state, stats

    got, new_state, stats = step(opt_state, model, state)
    assert set(opt_state[0].groups) == {"", "lin", "bn", "head"}
    assert {g: float(stats.log2_scales[g]) for g in stats.log2_scales.names} == {
        g: log2[g] for g in stats.log2_scales.names}
    for a, b in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(_params(want))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree_util.tree_leaves(new_state),
                    jax.tree_util.tree_leaves(want_state)):
        np.testing.assert_array_equal(a, b)
