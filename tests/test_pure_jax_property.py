"""Property: the pure-JAX front end (``alj.scale_group``) meets the checks of the linen,
NNX and Equinox property tests on random graphs of plain functions: exact against fp32,
no skipped step after warm-up, never more underflow than one global scale, every group
the loss reaches scaled. Graphs: residuals, a group applied twice with keyword arguments,
concatenation, a tied embedding read by the head, stacked layers under ``lax.scan``."""

from __future__ import annotations

import _graph
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_stream_property import assert_conformance, conformance_step

import adaloss_jax as alj

pytestmark = pytest.mark.slow  # the full suite only (CI)

W, V, T, B = 8, 16, 6, 4
OPS = _graph.OPS


def _dense(p, x, *, gate=1.0):
    return jnp.tanh(x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype)) * gate


def _init(ops):
    keys = iter(jax.random.split(jax.random.key(0), 64))
    layer = lambda din: {"w": jax.random.normal(next(keys), (din, W)) / din**0.5,
                         "b": jnp.zeros((W,))}
    params = {"embed": {"table": jax.random.normal(next(keys), (V, W))},
              "shared": layer(W),
              "stack": {"w": jax.random.normal(next(keys), (2, W, W)) / W**0.5,
                        "b": jnp.zeros((2, W))}}
    for i, op in enumerate(ops):
        params[f"layer{i}"] = layer(2 * W if op == "concat" else W)
    return params


def _model(ops, dtype):
    groups = {name: alj.scale_group(name)(_dense)
              for name in ["shared", "stack"] + [f"layer{i}" for i in range(len(ops))]}
    embed = alj.scale_group("embed")(lambda p, t: p["table"][t].astype(dtype))
    head = alj.scale_group("embed")(lambda p, x: x @ p["table"].astype(dtype).T)  # tied

    def apply(params, tokens):
        x = _graph.run(
            ops, embed(params["embed"], tokens),
            layer=lambda i, x, gate=1.0: groups[f"layer{i}"](params[f"layer{i}"], x, gate=gate),
            shared=lambda x, gate: groups["shared"](params["shared"], x, gate=gate),
            scan=lambda _, x: jax.lax.scan(lambda c, q: (c + groups["stack"](q, c), None), x,
                                        params["stack"])[0])
        return head(params["embed"], x) * 4.0

    return apply


def _loss(ops, dtype, tiny=2.0**-16):
    apply = _model(ops, dtype)

    def loss_fn(params, tokens):
        logits = apply(params, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean() * tiny

    return loss_fn


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.sampled_from(OPS), min_size=2, max_size=4))
@example(ops=["scan", "reuse", "concat"])
def test_random_pure_jax_graphs_exact_and_no_worse_than_global(ops):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(B, T + 1)))
    params = _init(ops)
    ref = jax.jit(jax.grad(_loss(ops, jnp.float32)))(params, tokens)
    loss16 = _loss(ops, jnp.float16)
    results = {}
    for groups in ("module", "global"):
        scaler = alj.adaptive(groups=groups)
        step, state, _ = conformance_step(scaler, loss16, params, tokens)
        reached = {f"layer{i}" for i, op in enumerate(ops) if op not in ("scan", "reuse")}
        reached |= {"embed"} | ({"stack"} if "scan" in ops else set())
        reached |= {"shared"} if "reuse" in ops else set()
        assert_conformance(step, state, results, groups, ref, ops, reached)
