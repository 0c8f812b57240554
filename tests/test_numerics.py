"""Tests of adaloss_jax.numerics: statistics, probes (linen and NNX), fp8 simulation, table."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import adaloss_jax as alj
from adaloss_jax import numerics

FP16_SUB = 2.0**-24  # fp16's smallest subnormal: values below half of it flush to zero


# ---------------------------------------------------------------- tensor_stats


def _designed_tensor():
    """64 values: 10 flush in fp16, 6 are subnormal, 3 overflow, 5 zeros, 40 normal."""
    ref = np.concatenate([
        np.full(10, 2.0**-27),          # < 2^-25: rounds to 0 in fp16
        np.full(6, 2.0**-20),           # fp16 subnormal, exact
        np.full(3, 1.0e5),              # > 65504: inf in fp16
        np.zeros(5),
        np.linspace(0.5, 2.0, 40),
    ]).astype(np.float32)
    np.random.shuffle(ref)
    return ref


def test_tensor_stats_counts_a_designed_tensor_exactly():
    ref = _designed_tensor()
    stats = jax.jit(lambda r: numerics.tensor_stats(r, r.astype(jnp.float16), 1.0))(ref)
    assert int(stats["size"]) == 64
    assert int(stats["ref_nonzero"]) == 59
    assert int(stats["flushed"]) == 10
    assert float(stats["underflow_rate"]) == pytest.approx(10 / 59, rel=1e-6)
    assert float(stats["subnormal_share"]) == pytest.approx(6 / 64, rel=1e-6)
    assert int(stats["overflow_count"]) == 3
    assert float(stats["amax"]) == np.inf
    assert float(stats["headroom"]) == -np.inf
    assert float(stats["rel_error"]) == np.inf


def test_tensor_stats_scaled_tensor():
    ref = _designed_tensor()
    ref = ref[np.abs(ref) < 1e4]  # drop the overflowing values
    scale = 2.0**4
    stats = jax.jit(
        lambda r, s: numerics.tensor_stats(r, (r * s).astype(jnp.float16), s)
    )(ref, jnp.float32(scale))
    # 2^-27 * 2^4 = 2^-23 is now a representable subnormal: nothing flushes.
    assert int(stats["flushed"]) == 0
    assert float(stats["subnormal_share"]) == pytest.approx(16 / 61, rel=1e-6)
    assert int(stats["overflow_count"]) == 0
    assert float(stats["amax"]) == 32.0
    assert float(stats["headroom"]) == pytest.approx(math.log2(65504 / 32.0), abs=1e-5)
    assert float(stats["scale"]) == scale
    low = (ref * scale).astype(np.float16).astype(np.float32) / scale
    expected = np.linalg.norm(low - ref) / np.linalg.norm(ref)
    assert float(stats["rel_error"]) == pytest.approx(expected, rel=1e-4)


def test_tensor_stats_zero_tensor_and_fp8_format():
    z = jnp.zeros(4)
    s = numerics.tensor_stats(z, z, 1.0, "fp16")
    assert float(s["rel_error"]) == 0.0 and float(s["headroom"]) == np.inf
    x = jnp.array([2.0**-8, 1.0], jnp.float32)  # 2^-8 is subnormal in e4m3fn (min normal 2^-6)
    s = numerics.tensor_stats(x, x.astype(jnp.float8_e4m3fn), 1.0, "e4m3")
    assert float(s["subnormal_share"]) == 0.5
    assert float(s["headroom"]) == pytest.approx(math.log2(448.0))


def test_tensor_stats_errors():
    with pytest.raises(ValueError, match="same shape"):
        numerics.tensor_stats(jnp.zeros(3), jnp.zeros(4), 1.0)
    with pytest.raises(ValueError, match="fmt="):
        numerics.tensor_stats(jnp.zeros(3), jnp.zeros(3), 1.0, "int8")


# ---------------------------------------------------------------- linen probes


class OneDense(nn.Module):
    """out = x @ W + b; with x the identity, the kernel's gradient is the cotangent."""

    features: int = 8
    dtype: jnp.dtype = jnp.float16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, dtype=self.dtype)(x)


def _weighted_loss(c):
    # d loss / d out = c exactly (the fp32 product is differentiated, then cast to fp16).
    return lambda m, p, b: jnp.sum(m.apply({"params": p}, b).astype(jnp.float32) * c)


def _designed_cotangent(tiny):
    """4x8 values: ``tiny`` of them 2^-30 (flush in fp16 unless scaled by >= 2^6)."""
    c = np.full((4, 8), 0.25, np.float32)
    c.flat[np.random.permutation(32)[:tiny]] = 2.0**-30
    return c


@pytest.fixture
def one_dense():
    model = OneDense()
    params = model.init(jax.random.key(0), jnp.ones((4, 4)))["params"]
    return model, params


@pytest.mark.parametrize("log2_scale", [0, 8], ids=["unscaled", "scale2^8"])
def test_linen_probe_underflow_rate_is_exact(one_dense, log2_scale):
    model, params = one_dense
    c = _designed_cotangent(tiny=12)
    probe = numerics.linen_probe(model, _weighted_loss(c))
    rows = {(r.kind, r.name): r for r in probe(params, jnp.eye(4), 2.0**log2_scale)}
    assert set(rows) == {("param", "Dense_0/kernel"), ("param", "Dense_0/bias"),
                         ("cotangent", "Dense_0"), ("cotangent", "")}
    for key in [("param", "Dense_0/kernel"), ("cotangent", "Dense_0"), ("cotangent", "")]:
        r = rows[key]
        assert r.fmt == "float16" and r.size == 32 and r.ref_nonzero == 32
        assert r.scale == 2.0**log2_scale
        assert r.overflow_count == 0
        if log2_scale == 0:
            assert r.flushed == 12 and r.underflow_rate == pytest.approx(12 / 32)
            assert r.subnormal_share == 0.0
        else:  # 2^-22 is an fp16 subnormal: kept, not flushed
            assert r.flushed == 0 and r.underflow_rate == 0.0
            assert r.subnormal_share == pytest.approx(12 / 32)
            assert r.rel_error == pytest.approx(0.0, abs=1e-7)
        assert r.headroom == pytest.approx(math.log2(65504 / (0.25 * 2.0**log2_scale)), abs=1e-5)
    assert rows[("cotangent", "")].shape == (4, 8)
    assert rows[("cotangent", "")].dtype == "float16"
    assert rows[("param", "Dense_0/bias")].flushed == 0  # sums of columns stay normal


def test_linen_probe_rel_error_without_scaling(one_dense):
    model, params = one_dense
    c = _designed_cotangent(tiny=12)
    rows = numerics.linen_probe(model, _weighted_loss(c))(params, jnp.eye(4))
    kernel = next(r for r in rows if r.name == "Dense_0/kernel")
    low = np.where(c < 1e-8, 0.0, c)
    assert kernel.rel_error == pytest.approx(np.linalg.norm(low - c) / np.linalg.norm(c), rel=1e-5)


def test_linen_grads_cotangents_match_manual_vjp(one_dense):
    model, params = one_dense
    c = np.random.randn(4, 8).astype(np.float32) * 1e-3
    x = jnp.asarray(np.random.randn(4, 4), jnp.float16)
    grads = jax.jit(numerics.linen_grads(model, _weighted_loss(c)))(params, x, 2.0**10)
    out, vjp = jax.vjp(lambda p: model.apply({"params": p}, x), params)
    ct = (jnp.asarray(c) * 2.0**10).astype(jnp.float16)
    (manual,) = vjp(ct)
    np.testing.assert_array_equal(np.asarray(grads.cotangents[""]), np.asarray(ct))
    np.testing.assert_array_equal(np.asarray(grads.cotangents["Dense_0"]), np.asarray(ct))
    for k in ("kernel", "bias"):
        np.testing.assert_array_equal(grads.params["Dense_0"][k], manual["Dense_0"][k])
    assert float(grads.param_scales) == 2.0**10


class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
        d = nn.Dense(4, dtype=jnp.float16)
        return d(nn.relu(d(x)))


def test_a_module_called_twice_gets_two_taps():
    model = Twice()
    params = model.init(jax.random.key(1), jnp.ones((2, 4)))["params"]
    loss = lambda m, p, b: jnp.mean(m.apply({"params": p}, b).astype(jnp.float32) ** 2)
    grads = numerics.linen_grads(model, loss)(params, jnp.ones((2, 4)), 1.0)
    assert set(grads.cotangents) == {"Dense_0", "Dense_0#1", ""}
    filtered = numerics.linen_grads(model, loss, filter=lambda path, m: path != ())
    assert set(filtered(params, jnp.ones((2, 4)), 1.0).cotangents) == {"Dense_0", "Dense_0#1"}


def test_probe_is_jitted_once_and_leaves_states_untouched(one_dense):
    model, params = one_dense
    tx = alj.loss_scaled(optax.adamw(1e-3), alj.dynamic(initial_scale=2.0**12))
    opt_state = tx.init(params)
    traces = []

    def loss(m, p, b):
        traces.append(1)
        return jnp.mean(m.apply({"params": p}, b).astype(jnp.float32) ** 2)

    before = jax.tree_util.tree_map(np.array, (params, opt_state))
    probe = numerics.linen_probe(model, loss)
    rows = probe(params, jnp.eye(4), opt_state)
    n = len(traces)
    rows2 = probe(params, jnp.eye(4), alj.scale_state(opt_state))
    assert len(traces) == n  # second call: compiled code reused
    assert rows == rows2
    assert {r.scale for r in rows} == {2.0**12}
    after = jax.tree_util.tree_map(np.array, (params, opt_state))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)
    assert all(not x.is_deleted() for x in jax.tree_util.tree_leaves((params, opt_state)))


def test_probe_stats_inside_jit(one_dense):
    model, params = one_dense
    probe = numerics.linen_probe(model, _weighted_loss(_designed_cotangent(4)))
    stats = jax.jit(lambda p: probe.stats(p, jnp.eye(4), 1.0))(params)
    assert int(stats["param"]["Dense_0/kernel"]["flushed"]) == 4


def test_linen_probe_errors(one_dense):
    model, params = one_dense
    loss = _weighted_loss(np.ones((4, 8), np.float32))
    probe = numerics.linen_probe(model, loss)
    with pytest.raises(ValueError, match="no parameters"):
        probe({}, jnp.eye(4))
    with pytest.raises(ValueError, match=r"batch does not fit.*\(4, 5\)"):
        probe(params, jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="scalar loss"):
        numerics.linen_probe(model, lambda m, p, b: m.apply({"params": p}, b))(params, jnp.eye(4))
    with pytest.raises(ValueError, match="fmt="):
        numerics.linen_probe(model, loss, fmt="int8")
    with pytest.raises(ValueError, match="fmt="):
        numerics.linen_probe(model, loss, fmt=jnp.float64)
    with pytest.raises(ValueError, match="model.dtype"):
        numerics.linen_probe(OneDense(dtype=jnp.int8), loss)
    with pytest.raises(ValueError, match="pass the format"):
        numerics.linen_probe(nn.Dense(3), loss)
    with pytest.raises(ValueError, match="no dtype field.*ref_model"):
        numerics.linen_probe(Twice(), loss, fmt="float16")
    with pytest.raises(ValueError, match="ref_model"):  # a "reference" that is still fp16
        numerics.linen_probe(model, loss, ref_model=model)(params, jnp.eye(4))
    with pytest.raises(ValueError, match="scale"):
        probe(params, jnp.eye(4), -1.0)
    with pytest.raises(TypeError, match="scale"):
        probe(params, jnp.eye(4), "big")


def test_linen_probe_with_explicit_ref_model():
    model = nn.Dense(8, dtype=jnp.float16)
    params = model.init(jax.random.key(0), jnp.ones((4, 4)))["params"]
    c = _designed_cotangent(tiny=5)
    probe = numerics.linen_probe(model, _weighted_loss(c), ref_model=nn.Dense(8))
    rows = {(r.kind, r.name): r for r in probe(params, jnp.eye(4))}
    assert rows[("param", "kernel")].flushed == 5


# ---------------------------------------------------------------- make_probe (per-layer)


def test_make_probe_takes_per_tensor_scales():
    def ref(x):
        return numerics.ProbeGrads({"a": x, "b": x}, {"t": x})

    def low(x):
        scales = {"a": jnp.float32(2.0**10), "b": jnp.float32(1.0)}
        params = {k: (x * s).astype(jnp.float16) for k, s in scales.items()}
        return numerics.ProbeGrads(params, {"t": (x * 4).astype(jnp.float16)}, scales,
                                   {"t": jnp.float32(4.0)})

    x = jnp.asarray(np.r_[np.full(3, 2.0**-30), np.ones(5)], jnp.float32)
    rows = {r.name: r for r in numerics.make_probe(ref, low)(x)}
    # a: 2^-30 * 2^10 = 2^-20 is an fp16 subnormal; b and t (2^-28): below 2^-25, flushed.
    assert rows["a"].scale == 2.0**10 and rows["a"].flushed == 0
    assert rows["a"].subnormal_share == 3 / 8 and rows["a"].rel_error == 0.0
    assert rows["b"].scale == 1.0 and rows["b"].flushed == 3
    assert rows["t"].kind == "cotangent" and rows["t"].scale == 4.0 and rows["t"].flushed == 3


def test_compare_rejects_mismatched_taps():
    ref = numerics.ProbeGrads({"a": jnp.ones(2)}, {"t": jnp.ones(2)})
    low = numerics.ProbeGrads({"a": jnp.ones(2)}, {"u": jnp.ones(2)})
    with pytest.raises(ValueError, match="different module outputs"):
        numerics.compare(ref, low)


# ---------------------------------------------------------------- NNX probes


class NNXOne(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float16):
        self.lin = nnx.Linear(4, 8, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def _nnx_loss(c):
    return lambda m, b: jnp.sum(m(b).astype(jnp.float32) * c)


@pytest.mark.parametrize("log2_scale", [0, 8], ids=["unscaled", "scale2^8"])
def test_nnx_probe_underflow_rate_is_exact(log2_scale):
    model = NNXOne(nnx.Rngs(0))
    c = _designed_cotangent(tiny=7)
    before = jax.tree_util.tree_map(np.array, nnx.state(model))
    rows = numerics.nnx_probe(model, _nnx_loss(c))(model, jnp.eye(4), 2.0**log2_scale)
    rows = {(r.kind, r.name): r for r in rows}
    assert set(rows) == {("param", "lin/kernel"), ("param", "lin/bias"),
                         ("cotangent", "lin"), ("cotangent", "")}
    for key in [("param", "lin/kernel"), ("cotangent", "lin"), ("cotangent", "")]:
        assert rows[key].flushed == (7 if log2_scale == 0 else 0)
        assert rows[key].scale == 2.0**log2_scale
    # The live model is untouched: same values, same classes.
    after = jax.tree_util.tree_map(np.array, nnx.state(model))
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)
    assert type(model.lin) is nnx.Linear and type(model) is NNXOne


def test_nnx_probe_errors():
    model = NNXOne(nnx.Rngs(0))
    probe = numerics.nnx_probe(model, _nnx_loss(np.ones((4, 8), np.float32)))
    with pytest.raises(ValueError, match="batch does not fit"):
        probe(model, jnp.ones((4, 3)))

    class Empty(nnx.Module):
        def __init__(self):
            self.dtype = jnp.float16

        def __call__(self, x):
            return jnp.sum(x)

    with pytest.raises(ValueError, match="no parameters"):
        numerics.nnx_probe(Empty(), lambda m, b: m(b))(Empty(), jnp.ones(3))
    with pytest.raises(ValueError, match="fmt="):
        numerics.nnx_probe(model, _nnx_loss(1.0), fmt="float64")


# ---------------------------------------------------------------- fp8 simulation


def _manual_round_trip(g, s, dtype):
    q = (np.asarray(g, np.float32) * np.float32(s)).astype(dtype)
    return q.astype(np.float32) / np.float32(s)


@pytest.mark.parametrize("dtype", [jnp.float8_e5m2, jnp.float8_e4m3fn], ids=["e5m2", "e4m3fn"])
def test_quantize_cotangent_matches_manual_quantization(dtype):
    g = (np.random.randn(64) * np.exp2(np.random.uniform(-20, 0, 64))).astype(np.float32)
    x = jnp.asarray(np.random.randn(64), jnp.float32)
    s = 2.0**12

    def f(x, s):
        return jnp.sum(numerics.quantize_cotangent(x, s, dtype) * g)

    y = jax.jit(lambda x: numerics.quantize_cotangent(x, s, dtype))(x)
    np.testing.assert_array_equal(y, x)  # forward: identity
    gx, gs = jax.jit(jax.grad(f, argnums=(0, 1)))(x, jnp.float32(s))
    np.testing.assert_array_equal(gx, _manual_round_trip(g, s, dtype))
    assert float(gs) == 0.0
    # Scaling matters: unscaled, the small values flush.
    g1 = jax.jit(jax.grad(lambda x: jnp.sum(numerics.quantize_cotangent(x, 1.0, dtype) * g)))(x)
    assert int(jnp.sum(g1 == 0)) > int(jnp.sum(gx == 0))


def test_quantize_cotangent_amax_scale_and_overflow():
    g = jnp.asarray([3.0, 1e-6, -0.5, 0.0], jnp.float32)
    fn = jax.jit(jax.grad(lambda x: jnp.sum(numerics.quantize_cotangent(x, None) * g)))
    s = float(numerics.amax_scale(g, "e5m2"))
    assert s == 2.0**14  # floor(log2(57344 / 3)) = 14
    np.testing.assert_array_equal(fn(jnp.ones(4)), _manual_round_trip(g, s, jnp.float8_e5m2))
    big = jnp.asarray([1e5, 1.0], jnp.float32)
    e5 = jax.grad(lambda x: jnp.sum(numerics.quantize_cotangent(x, 1.0, "e5m2") * big))
    assert np.isinf(float(e5(jnp.ones(2))[0]))
    e4 = jax.grad(lambda x: jnp.sum(numerics.quantize_cotangent(x, 1.0, "e4m3") * big))
    assert np.isnan(float(e4(jnp.ones(2))[0]))  # e4m3fn has no inf
    with pytest.raises(ValueError, match="not an fp8 format"):
        numerics.quantize_cotangent(jnp.ones(2), 1.0, "float16")


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="second")(nn.Dense(6, name="first")(x))


@pytest.mark.parametrize("scale", [2.0**16, None], ids=["given", "amax"])
def test_fp8_cotangents_at_module_boundaries(scale):
    model = TwoDense()
    x = jnp.asarray(np.random.randn(3, 4), jnp.float32)
    params = model.init(jax.random.key(2), x)["params"]
    c = jnp.asarray(np.random.randn(3, 8) * 1e-4, jnp.float32)

    def loss(p):
        only_second = lambda path, m: path == ("second",)
        with numerics.fp8_cotangents("float8_e5m2", scale, filter=only_second):
            return jnp.sum(model.apply({"params": p}, x) * c)

    grads = jax.jit(jax.grad(loss))(params)
    h = x @ params["first"]["kernel"] + params["first"]["bias"]
    s = 2.0**16 if scale is not None else float(numerics.amax_scale(c, "e5m2"))
    q = _manual_round_trip(c, s, jnp.float8_e5m2)
    # fp32 sums over the batch in XLA's order and numpy's: a few ulps (2**-23) apart
    np.testing.assert_allclose(grads["second"]["kernel"], np.asarray(h).T @ q, rtol=1e-5)
    np.testing.assert_allclose(grads["second"]["bias"], q.sum(0), rtol=1e-5)


def test_fp8_cotangents_per_tap_scales():
    model = TwoDense()
    x = jnp.ones((3, 4))
    params = model.init(jax.random.key(2), x)["params"]
    c = jnp.full((3, 8), 2.0**-20, jnp.float32)  # below e5m2's range unless scaled

    def loss(p, scales):
        with numerics.fp8_cotangents("e5m2", scales):
            return jnp.sum(model.apply({"params": p}, x) * c)

    flushed = jax.grad(loss)(params, {})
    kept = jax.grad(loss)(params, {"": 2.0**10, "second": 2.0**10})
    assert float(jnp.abs(flushed["second"]["bias"]).max()) == 0.0
    np.testing.assert_array_equal(kept["second"]["bias"], np.full(8, 3 * 2.0**-20))


# ---------------------------------------------------------------- table


def test_format_table_and_dicts(one_dense):
    model, params = one_dense
    rows = numerics.linen_probe(model, _weighted_loss(_designed_cotangent(8)))(
        params, jnp.eye(4), 1.0)
    text = numerics.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["kind", "name", "shape", "underflow", "subnormal", "overflow",
                                "rel_err", "headroom", "scale"]
    kernel = next(line for line in lines if "Dense_0/kernel" in line).split()
    assert kernel[:4] == ["param", "Dense_0/kernel", "4x8", "25.00%"]
    assert kernel[-2:] == ["18.0", "2^0"]  # log2(65504 / 0.25) = 17.9999...
    dicts = numerics.rows_as_dicts(rows, step=7)
    assert dicts[0]["step"] == 7 and dicts[0]["kind"] == "param"
    assert numerics.format_table(dicts) == text
    with pytest.raises(ValueError, match="columns"):
        numerics.format_table(rows, columns=("nope",))


def test_nnx_probe_compiles_once_and_takes_an_optimizer_state():
    model = NNXOne(nnx.Rngs(0))
    traces = []

    def loss(m, b):
        traces.append(1)
        return jnp.mean(m(b).astype(jnp.float32) ** 2)

    state = alj.dynamic(initial_scale=2.0**9).init()
    probe = numerics.nnx_probe(model, loss)
    rows = probe(model, jnp.eye(4), state)
    n = len(traces)
    assert probe(model, jnp.eye(4), state) == rows
    assert len(traces) == n
    assert {r.scale for r in rows} == {2.0**9}


def test_nnx_taps_with_fp8_on_a_merged_copy():
    model = NNXOne(nnx.Rngs(0), dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    c = jnp.asarray(np.random.randn(4, 8) * 1e-3, jnp.float32)

    @jax.jit
    def grads(params):
        def loss(p):
            m = nnx.merge(graphdef, p)
            only_lin = lambda path, mod: path == ("lin",)
            with numerics.nnx_taps(m, lambda k, x: numerics.quantize_cotangent(x, 2.0**12),
                                   filter=only_lin):
                return jnp.sum(m(jnp.eye(4)) * c)
        return jax.grad(loss)(params)

    g = grads(params)
    q = _manual_round_trip(c, 2.0**12, jnp.float8_e5m2)
    np.testing.assert_array_equal(g["lin"]["kernel"][...], q)  # identity input
    assert type(model.lin) is nnx.Linear


# ------------------------------------------------ one interception for probes and scaling


def test_taps_reach_pure_jax_scale_groups():
    """The taps are a receiver of the front ends' call reports, so a pure-JAX function
    marked with scale_group is tapped as a linen module is."""
    dense = alj.scale_group("layer0")(lambda p, x: x @ p["w"])
    params = {"w": jnp.asarray(np.random.randn(4, 3), jnp.float32)}
    c = jnp.asarray(np.random.randn(2, 3), jnp.float32)
    seen = {}

    def loss(p):
        def tap(key, leaf):
            seen[key] = leaf.shape
            return numerics.quantize_cotangent(leaf, 1.0, "float8_e4m3fn")
        with numerics.taps(tap):
            return jnp.sum(dense(p, jnp.eye(2, 4)) * c)

    g = jax.jit(jax.grad(loss))(params)
    assert seen == {"layer0": (2, 3)}
    q = _manual_round_trip(c, 1.0, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(g["w"][:2], q)  # identity rows of the input


def test_taps_inside_an_adaptive_gradient_see_each_call_once():
    """Probing taps and adaptive scale points share the linen interception: inside an
    adaptive gradient each module call is tapped once, and an identity tap changes
    neither the gradients nor the statistics."""
    from _models import MLP, classification_loss

    model = MLP(dtype=jnp.float16)
    x = jnp.asarray(np.random.randn(8, 8), jnp.float32)
    y = jnp.asarray(np.random.randint(0, 4, size=8))
    params = model.init(jax.random.key(0), x)["params"]
    scaler = alj.adaptive(groups="module")
    state = optax.chain(alj.adaptive_unscale(scaler)).init(params)
    keys = []

    def loss(p, x, y, tapped):
        if not tapped:
            return classification_loss(model, {"params": p}, x, y)[0]
        with numerics.taps(lambda k, leaf: keys.append(k) or leaf):
            return classification_loss(model, {"params": p}, x, y)[0]

    plain = jax.jit(alj.adaptive_value_and_grad(lambda p, x, y: loss(p, x, y, False)))
    tapped = jax.jit(alj.adaptive_value_and_grad(lambda p, x, y: loss(p, x, y, True)))
    a, b = plain(state, params, x, y), tapped(state, params, x, y)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(u, v)
    # (the loss is traced twice: once analysed, once with the scale points)
    assert set(keys) == {"", "Dense_0", "Dense_1", "Dense_2", "Dense_3"}, keys
