"""A scale per layer inside scanned stacks (``lax.scan`` over stacked parameters,
``nn.scan``, ``nnx.scan``, Equinox's stacked layers).

A scanned stack and its unrolled twin must give the same scales, statistics and
gradients: the analysis walks the scan's body once per layer, as if unrolled, and each
layer's conversions and statistics enter and leave the one compiled body as values
along the scan."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import assert_fp32_trees_close
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaloss_jax as alj
from adaloss_jax import _groups
from adaloss_jax._layout import GroupVector, layers
from adaloss_jax.bench import _deep, _models
from adaloss_jax.equinox import eqx_adaptive_value_and_grad
from adaloss_jax.flax import nnx_adaptive_value_and_grad

W = 8
SCALER = alj.adaptive(groups="module", max_rise=1000,  # arbitrary scales: never skip
                      compute_dtype="float16",  # scale the fp32 twins too
                      same_step=False)  # every scale the drawn one (test_live: same-step)


def _layer_fn(residual: bool):
    def layer(w, h):
        y = jax.nn.sigmoid(h @ w["kernel"].astype(h.dtype) + w["bias"].astype(h.dtype))
        return h + y * 0.5 if residual else y

    return layer


def _params(depth: int, dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "inp": {"kernel": jax.random.normal(k[0], (W, W)) * 0.5},
        "stack": {"kernel": jax.random.normal(k[1], (depth, W, W)) * 0.7,
                  "bias": jax.random.normal(k[2], (depth, W)) * 0.1},
        "head": {"kernel": jnp.eye(W, 3)},
    }


def _unrolled_params(p):
    depth = p["stack"]["kernel"].shape[0]
    out = {"inp": p["inp"], "head": p["head"]}
    for i in range(depth):
        out[f"layer{i}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], p["stack"])
    return out


@functools.cache
def _losses(depth: int, residual: bool, reverse: bool, emit: bool, dtype, remat=False,
            scaler=SCALER):
    """The scanned stack and its unrolled twin (same layers, same order, same outputs);
    ``remat``: each layer under ``jax.checkpoint``."""
    ck = jax.checkpoint if remat else (lambda f: f)
    dense = alj.scale_group("inp")(lambda w, x: x @ w["kernel"].astype(x.dtype))
    head = alj.scale_group("head")(lambda w, x: x @ w["kernel"].astype(x.dtype))
    stacked = alj.scale_group("stack")(_layer_fn(residual))
    order = range(depth - 1, -1, -1) if reverse else range(depth)

    def finish(p, h, ys):
        out = jnp.sum(head(p["head"], h).astype(jnp.float32) ** 2)
        if emit:  # every layer's output also reaches the loss, stacked along the scan
            out = out + 0.1 * jnp.sum(jnp.sin(ys.astype(jnp.float32)))
        return out * 2.0**-12

    def scanned(p, x):
        h = dense(p["inp"], x.astype(dtype))
        h, ys = jax.lax.scan(ck(lambda c, w: (stacked(w, c), stacked(w, c) if emit else None)),
                             h, p["stack"], reverse=reverse)
        return finish(p, h, ys if emit else None)

    def unrolled(p, x):
        h = dense(p["inp"], x.astype(dtype))
        ys = [None] * depth
        for i in order:  # the scan's body, once per layer
            layer = alj.scale_group(f"layer{i}")(_layer_fn(residual))
            body = ck(lambda w, c, layer=layer: (layer(w, c), layer(w, c) if emit else None))
            h, ys[i] = body(p[f"layer{i}"], h)
        return finish(p, h, jnp.stack(ys) if emit else None)

    def step(loss_fn):
        tx = alj.adaptive_unscale(scaler)

        @jax.jit
        def run(state, p, x):
            loss, g, stats = alj.adaptive_value_and_grad(loss_fn)(state, p, x)
            u, new = tx.update(g, state, p, loss=loss, scale_stats=stats)
            return u, stats, new

        return tx, run

    return step(scanned), step(unrolled), jax.jit(jax.grad(scanned))


def _slots(stats, depth):
    """Per layer of the scanned run: the stack's slots, by the unrolled twin's names."""
    return {f"layer{i}": f"stack[{i}]" for i in range(depth)}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: the profile
@given(depth=st.integers(2, 4), residual=st.booleans(), reverse=st.booleans(),
       emit=st.booleans(), remat=st.booleans(), data=st.data())
def test_scanned_stack_equals_its_unrolled_twin_exactly_in_fp32(depth, residual, reverse,
                                                                 emit, remat, data):
    """Under arbitrary scales per layer (fp32 compute: every conversion exact), the
    scanned stack measures what its unrolled twin measures, group by group and layer by
    layer, and both unscale to the gradient of the unscaled loss."""
    log2 = data.draw(st.lists(st.integers(-8, 15), min_size=depth + 3, max_size=depth + 3))
    _check_twin(depth, residual, reverse, emit, remat, log2)


@pytest.mark.parametrize("reverse,residual,emit", [(True, True, False), (True, False, True),
                                                   (False, True, True)])
def test_scanned_stack_equals_its_unrolled_twin_fixed_examples(reverse, residual, emit):
    """The property above on fixed cases a user relies on, so a break fails on every run:
    a ``reverse=True`` scan (walked last layer first), a residual stack, a scan whose
    every layer's output also reaches the loss; the scales differ by layer."""
    _check_twin(3, residual, reverse, emit, False, [0, 3, -2, 9, 1, 5])


def _check_twin(depth, residual, reverse, emit, remat, log2, scaler=SCALER):
    (tx, scanned), (_, unrolled), grad = _losses(depth, residual, reverse, emit, jnp.float32,
                                                 remat, scaler)
    p = _params(depth)
    pu = _unrolled_params(p)
    x = jax.random.normal(jax.random.key(1), (4, W))
    ours = {"": log2[0], "inp": log2[1], "head": log2[2]}
    s_scan = tx.init(p).with_log2_scales(
        {**ours, **{f"stack[{i}]": log2[3 + i] for i in range(depth)}})
    s_unr = tx.init(pu).with_log2_scales(
        {**ours, **{f"layer{i}": log2[3 + i] for i in range(depth)}})
    u_scan, st_scan, _ = scanned(s_scan, p, x)
    u_unr, st_unr, _ = unrolled(s_unr, pu, x)

    names = {**{g: g for g in ("", "inp", "head")}, **_slots(st_scan, depth)}
    assert set(st_scan.amax) == set(names.values())
    for twin, ours_name in names.items():
        for field in ("log2_scales", "amax", "bad"):
            a = np.asarray(getattr(st_scan, field)[ours_name])
            b = np.asarray(getattr(st_unr, field)[twin])
            np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=f"{field} {twin}")
    ref = grad(p, x)
    # (a few ulps of the leaf's largest value: an element that is a near-cancelled sum
    # keeps the rounding of its terms, summed in another order by the scaled program)
    assert_fp32_trees_close(u_scan["stack"]["kernel"], ref["stack"]["kernel"], rtol=1e-5,
                            atol=0.0)
    np.testing.assert_allclose(u_scan["inp"]["kernel"], ref["inp"]["kernel"], rtol=1e-5)
    for i in range(depth):
        np.testing.assert_allclose(u_scan["stack"]["kernel"][i],
                                   u_unr[f"layer{i}"]["kernel"], rtol=1e-5, atol=1e-12)


def test_scanned_stack_scales_each_layer_like_its_unrolled_twin_in_fp16():
    """Trained scales (fp16 compute, the loss x 2^-12, six steps from scale 1): the
    scanned stack settles on the scales of its unrolled twin, layer by layer."""
    depth = 4
    (tx, scanned), (_, unrolled), _ = _losses(depth, False, False, False, jnp.float16)
    p = _params(depth)
    pu = _unrolled_params(p)
    x = jax.random.normal(jax.random.key(1), (4, W))
    s_scan, s_unr = tx.init(p), tx.init(pu)
    for _ in range(6):
        u_scan, st_scan, s_scan = scanned(s_scan, p, x)
        u_unr, st_unr, s_unr = unrolled(s_unr, pu, x)
    for i in range(depth):
        assert float(s_scan.log2_scales[f"stack[{i}]"]) == float(
            s_unr.log2_scales[f"layer{i}"])
        np.testing.assert_array_equal(u_scan["stack"]["kernel"][i],
                                      u_unr[f"layer{i}"]["kernel"])
    scales = [float(s_scan.log2_scales[f"stack[{i}]"]) for i in range(depth)]
    assert len(set(scales)) > 1, scales  # the layers do differ
    table = alj.diagnostics.scale_table(s_scan)
    assert table.index("stack[0]") < table.index("stack[1]") < table.index("stack[3]")


# --- front ends: nn.scan, nnx.scan, Equinox -------------------------------------------


def _trained(vg, tx, state, model_or_params, x, steps=3):
    for _ in range(steps):
        loss, g, stats = vg(state, model_or_params, x)
        _, state = tx.update(g, state, None, loss=loss, scale_stats=stats)
    return stats


def test_nn_scan_stack_gets_a_scale_per_layer_equal_to_its_python_loop_twin():
    x = jax.random.normal(jax.random.key(1), (16, 12))
    scan = _models.sigmoid_mlp(jnp.float16, depth=5, scan=True)
    loop = _models.sigmoid_mlp(jnp.float16, depth=5)
    p_scan = scan.init(jax.random.key(0), x)["params"]
    layers = _models.layer_kernels(p_scan)
    stacked = p_scan["layers"]["layer"]["Dense_0"]
    p_loop = {"Dense_0": p_scan["Dense_0"], "Dense_5": p_scan["head"]}
    for i in range(4):
        p_loop[f"Dense_{i + 1}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
    assert len(layers) == 6
    tx = alj.adaptive_unscale(alj.adaptive(groups="module"))

    def run(model, params):
        loss = lambda p, x: jnp.sum(model.apply({"params": p}, x).astype(jnp.float32)) * 2.0**-14
        state = tx.init(params)
        vg = jax.jit(alj.adaptive_value_and_grad(loss))
        for _ in range(4):
            loss_value, g, stats = vg(state, params, x)
            u, state = tx.update(g, state, params, loss=loss_value, scale_stats=stats)
        return u, state

    u_scan, s_scan = run(scan, p_scan)
    u_loop, s_loop = run(loop, p_loop)
    for i in range(4):
        assert float(s_scan.log2_scales[f"layers/layer/Dense_0[{i}]"]) == float(
            s_loop.log2_scales[f"Dense_{i + 1}"])
        np.testing.assert_array_equal(u_scan["layers"]["layer"]["Dense_0"]["kernel"][i],
                                      u_loop[f"Dense_{i + 1}"]["kernel"])


@pytest.mark.slow
def test_nnx_scan_and_equinox_stacks_get_a_scale_per_layer():
    """nnx.scan over nnx.vmap-made layers, and an Equinox stack (filter_vmap) run by
    lax.scan: each layer has a slot, and the fp32 gradients are those of the loss."""
    depth = 4
    x = jax.random.normal(jax.random.key(1), (3, W)).astype(jnp.float16)
    tx = alj.adaptive_unscale(alj.adaptive(groups="module"))

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(W, W, rngs=rngs, dtype=jnp.float16)

        def __call__(self, h):
            return jax.nn.sigmoid(self.lin(h))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.stack = nnx.split_rngs(splits=depth)(nnx.vmap(Layer))(rngs)

        def __call__(self, h):
            return nnx.scan(lambda c, m: m(c), in_axes=(nnx.Carry, 0),
                            out_axes=nnx.Carry)(h, self.stack)

    class ELayer(eqx.Module):
        w: jax.Array

        def __init__(self, key):
            self.w = jax.random.normal(key, (W, W))

        def __call__(self, h):
            return jax.nn.sigmoid(h @ self.w.astype(h.dtype))

    class ENet(eqx.Module):
        stack: ELayer

        def __init__(self, key):
            self.stack = eqx.filter_vmap(ELayer)(jax.random.split(key, depth))

        def __call__(self, h):
            params, static = eqx.partition(self.stack, eqx.is_array)
            return jax.lax.scan(lambda c, q: (eqx.combine(q, static)(c), None), h, params)[0]

    loss = lambda m, x: jnp.sum(m(x).astype(jnp.float32)) * 2.0**-10
    for name, model, vg, params_of, group in [
        ("nnx", Net(nnx.Rngs(0)), nnx_adaptive_value_and_grad(loss),
         lambda m: nnx.state(m, nnx.Param), "stack/lin"),
        ("eqx", ENet(jax.random.key(3)), eqx_adaptive_value_and_grad(loss),
         lambda m: eqx.filter(m, eqx.is_array), "stack"),
    ]:
        state = tx.init(params_of(model))
        stats = _trained(vg, tx, state, model, x)
        slots = [f"{group}[{i}]" for i in range(depth)]
        assert [g for g in stats.amax if g.startswith(group)] == slots, name
        assert all(float(stats.amax[s]) > 0 for s in slots), name


# --- the case: 8 x (Dense(128) + sigmoid) with nn.scan, e4m3 ------------------


@pytest.mark.slow
def test_scanned_sigmoid_stack_in_e4m3_flushes_under_one_percent_per_layer():
    """The issue's case: 8 x (Dense(128) + sigmoid) in one nn.scan, e4m3 cotangents,
    per module, a random batch, scales settled over 6 steps. The layers' ranges spread
    wider than e4m3's, and one scale for the whole scan flushed the first scanned
    layer's kernel gradient entirely; with a scale per layer every layer flushes < 1% of
    the elements that one e4m3 scale per tensor can hold."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(128, 64)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, size=128))
    scaler = alj.adaptive(groups="module", grad_dtype="float8_e4m3fn", simulate=True)
    m16, m32 = (_models.sigmoid_mlp(d, depth=8, scan=True) for d in (jnp.float16,
                                                                     jnp.float32))
    scaled, ref, state = _deep.settle_and_probe(m16, m32, scaler, x, y)
    held = [u[2] for u in _deep.layer_underflow(scaled, ref, _deep.guaranteed_span(scaler))]
    assert len(held) == 9 and "layers/layer/Dense_0[6]" in state.groups
    assert max(held) < 0.01, held


# --- which groups get slots, and where a stack keeps one scale ---------------------------


def test_which_groups_may_be_stacks():
    """A slot per layer for groups whose leaves share a leading axis and are not one
    plain matrix; none for plain layers, embeddings, norms or global scaling."""
    f = jnp.zeros
    params = {
        "scanned_dense": {"kernel": f((3, 4, 4)), "bias": f((3, 4))},
        "scanned_norm": {"scale": f((5, 4)), "bias": f((5, 4))},
        "dense": {"kernel": f((4, 4)), "bias": f((4,))},
        "square": {"w": f((4, 4))},
        "embed": {"embedding": f((256, 8))},
        "norm": {"scale": f((4,)), "bias": f((4,))},
        "mixed": {"a": f((3, 4, 4)), "b": f((2, 4))},
    }
    module = alj.adaptive(groups="module")
    assert _groups.stack_lengths(params, module) == {"scanned_dense": 3, "scanned_norm": 5}
    assert _groups.stack_lengths(params, alj.adaptive()) == {}
    groups = alj.adaptive_unscale(module).init(params).groups
    assert [g for g in groups if g.startswith("scanned_dense")] == [
        "scanned_dense", "scanned_dense[0]", "scanned_dense[1]", "scanned_dense[2]"]


def test_slots_are_stored_as_one_vector_per_stack():
    names = ("", "a", "s", *layers("s", 3), "t")
    v = GroupVector(names, jnp.arange(7.0), split=True)
    assert len(jax.tree_util.tree_leaves(v)) == 5  # "", a, s, s[0..2] as one, t
    assert float(v["s[1]"]) == 4.0 and v.stacked("s").tolist() == [3.0, 4.0, 5.0]
    assert v.array.tolist() == list(range(7))
    back = jax.tree_util.tree_map(lambda x: x + 1, v)
    assert back.names == names and back.array.tolist() == list(range(1, 8))


def test_a_stack_scanned_over_otherwise_keeps_one_scale():
    """Parameters transformed before the scan (here scaled), or read elsewhere too: the
    stack keeps one scale for all its layers, and the gradients are right."""
    depth = 3
    p = _params(depth)
    stacked = alj.scale_group("stack")(_layer_fn(False))
    head = alj.scale_group("head")(lambda w, x: x @ w["kernel"].astype(x.dtype))

    def transformed(p, x):
        w = jax.tree_util.tree_map(lambda a: a * 0.5, p["stack"])
        h, _ = jax.lax.scan(lambda c, w: (stacked(w, c), None), x, w)
        return jnp.sum(head(p["head"], h) ** 2) * 2.0**-8

    def read_twice(p, x):
        h, _ = jax.lax.scan(lambda c, w: (stacked(w, c), None), x, p["stack"])
        return jnp.sum(head(p["head"], h) ** 2) * 2.0**-8 + jnp.sum(p["stack"]["bias"])

    x = jax.random.normal(jax.random.key(1), (4, W))
    tx = alj.adaptive_unscale(SCALER)
    params = {"stack": p["stack"], "head": p["head"]}
    state = tx.init(params).with_log2_scales({"stack": 6, "head": 3, "": 2})
    for loss_fn in (transformed, read_twice):
        _, g, stats = jax.jit(alj.adaptive_value_and_grad(loss_fn))(state, params, x)
        assert "stack" in stats.amax and "stack[0]" not in stats.amax
        u, _ = tx.update(g, state, params, scale_stats=stats)
        ref = jax.jit(jax.grad(loss_fn))(params, x)
        np.testing.assert_allclose(u["stack"]["kernel"], ref["stack"]["kernel"], rtol=1e-5)


def test_per_example_vmap_around_a_scanned_stack_measures_the_batched_loss():
    """``jax.vmap`` of a per-example loss around the scanned stack: the stack still gets
    its slots, measures what the batched loss measures, and unscales exactly (fp32)."""
    p = _params(3)
    params = {"stack": p["stack"], "head": p["head"]}
    stacked = alj.scale_group("stack")(_layer_fn(False))
    head = alj.scale_group("head")(lambda w, x: x @ w["kernel"].astype(x.dtype))

    def batched(p, x):
        h, _ = jax.lax.scan(lambda c, w: (stacked(w, c), None), x, p["stack"])
        return jnp.sum(head(p["head"], h) ** 2) * 2.0**-8

    per_example = lambda p, x: jnp.sum(jax.vmap(batched, in_axes=(None, 0))(p, x))
    x = jax.random.normal(jax.random.key(1), (4, W))
    tx = alj.adaptive_unscale(SCALER)
    state = tx.init(params).with_log2_scales(
        {"stack[0]": 3, "stack[1]": 7, "stack[2]": -2, "head": 4, "": 1})
    _, g, stats = jax.jit(alj.adaptive_value_and_grad(per_example))(state, params, x)
    _, _, whole = jax.jit(alj.adaptive_value_and_grad(batched))(state, params, x)
    assert sorted(stats.amax) == ["", "head", "stack[0]", "stack[1]", "stack[2]"]
    np.testing.assert_allclose(stats.amax.array, whole.amax.array, rtol=1e-6)
    u, _ = tx.update(g, state, params, scale_stats=stats)
    ref = jax.jit(jax.grad(per_example))(params, x)
    np.testing.assert_allclose(u["stack"]["kernel"], ref["stack"]["kernel"], rtol=1e-5)
