"""Adaptive scaling options: the quantile statistic and recomputing every F steps."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _close import assert_fp32_trees_close
from flax import linen as nn
from test_adaptive import _grads_through, _setup, known_stats

import adaloss_jax as alj
from adaloss_jax.diagnostics import Health

LOG2_MAX = math.log2(65504.0)  # fp16
E_MIN = -24  # log2 of fp16's smallest subnormal
T = 1e-3
MARGIN = 4
N = 4096


class _Gain(nn.Module):
    """``x * p``: with ``x = 1`` and the loss ``sum(out * C)``, both the output and the
    input cotangent and the gradient of ``p`` are exactly ``C`` (times the scale)."""

    @nn.compact
    def __call__(self, x):
        return x * self.param("p", nn.initializers.ones, x.shape)


@functools.cache
def _quantile_step(log2_scale: int):
    """One jitted adaptive step on ``_Gain`` (fp32, global group, quantile statistic)
    with the cotangent ``C`` as an argument; shared by the crafted-distribution cases."""
    model = _Gain()
    x = jnp.ones((N,), jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]
    scaler = alj.adaptive(compute_dtype="float16", statistic="quantile", threshold=T, margin=MARGIN,
                          initial_scale=2.0**log2_scale, retries=0)  # one pass
    tx = alj.adaptive_unscale(scaler)
    state = tx.init(params)

    def loss_fn(p, c):
        return jnp.sum(model.apply({"params": p}, x) * c)

    @jax.jit
    def step(c):
        loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(state, params, c)
        _, new = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        return new.log2_scales[""], stats.hist[""]

    return step


def _reference(c: np.ndarray, s: int) -> tuple[int, int, int, bool]:
    """fp64 numpy: (expected new log2 scale, amax rule, quantile rule, cut-off tail) for
    cotangent ``c`` measured at scale ``2**s``.

    Quantile rule: the smallest integer ``q`` with at most ``T * n`` of the ``n`` non-zero
    ``|c| * 2**q`` below ``2 * u_min``. It has no answer (the amax rule alone applies)
    when, at the measured scale, at most ``T * n`` are below ``u_min`` but more than
    ``T * n`` below ``2 * u_min`` (the tail is cut off in the lowest binade).
    """
    m = np.abs(c[c != 0]).astype(np.float64)
    n = m.size
    amax_rule = math.floor(LOG2_MAX - MARGIN - math.log2(m.max()))
    binade = np.floor(np.log2(m)).astype(int)  # exact: fp32 values are powers of 2 apart
    q = next(q for q in range(-200, 200) if np.sum(binade + q < E_MIN + 1) <= T * n)
    at = binade + s
    cut = np.sum(at < E_MIN) <= T * n < np.sum(at < E_MIN + 1)
    return (amax_rule if cut else min(amax_rule, q)), amax_rule, q, bool(cut)


def _signed(mags, rng):
    return (mags * rng.choice([-1.0, 1.0], size=mags.shape)).astype(np.float32)


def _case(name, rng):
    if name == "lognormal":  # log2|c| ~ N(-20, 3): the quantile rule is below the amax cap
        return _signed(2.0 ** rng.normal(-20.0, 3.0, N), rng), "quantile"
    if name == "lognormal_with_zeros":  # zeros are not counted
        c = _signed(2.0 ** rng.normal(-20.0, 3.0, N), rng)
        c[rng.random(N) < 0.4] = 0.0
        return c, "quantile"
    if name == "wide":  # log-uniform over 38 binades: wider than fp16 allows, amax caps it
        return _signed(2.0 ** rng.uniform(-38.0, 0.0, N), rng), "amax"
    if name == "cut_off_tail":  # 1% sit exactly at u_min: the tail below is unknown
        c = _signed(2.0 ** rng.uniform(-10.0, -5.0, N), rng)
        c[: N // 100] = 2.0**E_MIN
        return c, "cut"
    raise ValueError(name)


@pytest.mark.parametrize("name", ["lognormal", "lognormal_with_zeros", "wide",
                                  "cut_off_tail"])
def test_quantile_scale_matches_numpy_closed_form(name):
    """End to end under jit: the histogram out of the scale points and the scale chosen
    from it equal an fp64 numpy computation on the same cotangent."""
    rng = np.random.default_rng(7)
    c, branch = _case(name, rng)
    s = 0
    got, stats = _quantile_step(s)(jnp.asarray(c))
    expect, amax_rule, q, cut = _reference(c, s)
    assert float(got) == expect
    # The case exercises the branch it is named for.
    assert {"quantile": q < amax_rule and not cut, "amax": amax_rule < q and not cut,
            "cut": cut}[branch]
    # The histogram: both measured cotangents (output and input) are c, at scale 2**s.
    hist = np.asarray(stats)
    nz = c[c != 0]
    idx = np.clip(np.floor(np.log2(np.abs(nz.astype(np.float64)))).astype(int) + s
                  - (E_MIN - 16), 0, hist.size - 1)
    np.testing.assert_array_equal(hist, 2 * np.bincount(idx, minlength=hist.size))


def test_quantile_measured_at_the_group_scale():
    """The same cotangent measured at scale 2**5 gives the same unit-scale answer (the
    histogram shifts by the scale's exponent, nothing is multiplied)."""
    rng = np.random.default_rng(8)
    c, _ = _case("lognormal", rng)
    c = c * np.float32(2.0**-5)  # the loss the scaled step sees is 2**5 times larger
    got, _ = _quantile_step(5)(jnp.asarray(c))
    assert float(got) == _reference(c, 5)[0]


@functools.cache
def _gaussian_stats():
    """Pure JAX, three groups in a chain (``ga`` -> ``gb`` -> the root), fp32 compute
    scaled as fp16 (exact), statistic="gaussian": a jitted function from a state with
    chosen scales to the step's statistics."""
    ga = alj.scale_group("ga")(lambda w, x: jnp.tanh(x * w["w"]))
    gb = alj.scale_group("gb")(lambda w, x: x @ w["w"])
    params = {"ga": {"w": jax.random.normal(jax.random.key(0), (8,))},
              "gb": {"w": jax.random.normal(jax.random.key(1), (8, 4))}}
    x = jax.random.normal(jax.random.key(2), (16, 8))

    def loss(p, x):
        return jnp.sum(jnp.sin(gb(p["gb"], ga(p["ga"], x)))) * 2.0**-6

    tx = alj.adaptive_unscale(alj.adaptive(groups="module", statistic="gaussian",
                                           compute_dtype="float16", retries=0))
    state = tx.init(params)

    @jax.jit
    def stats(log2):
        s = state.with_log2_scales(dict(zip(("", "ga", "gb"), log2)))
        return alj.adaptive_value_and_grad(loss)(s, params, x)[2]

    return stats


def test_gaussian_statistics_are_each_groups_own_at_its_own_scale():
    """Each group's sum of squares (and amax) is measured at that group's own scale,
    whatever the neighbours' scales: scales (0, 0, 0) -> (3, -4, 7) multiply group g's
    sum of squares by exactly ``4**s_g`` (its amax by ``2**s_g``) and leave its count."""
    stats = _gaussian_stats()
    base = stats((0, 0, 0))
    scales = {"": 3, "ga": -4, "gb": 7}
    moved = stats(tuple(scales.values()))
    for g, s in scales.items():
        assert float(base.count[g]) > 0 and float(base.sumsq[g]) > 0, g
        assert float(moved.count[g]) == float(base.count[g]), g
        assert float(moved.sumsq[g]) == pytest.approx(float(base.sumsq[g]) * 4.0**s,
                                                      rel=1e-6), g
        assert float(moved.amax[g]) == pytest.approx(float(base.amax[g]) * 2.0**s,
                                                     rel=1e-6), g
    # The groups do measure different cotangents (a mix-up between them would show).
    assert len({round(float(base.sumsq[g]), 6) for g in scales}) == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_tied_reused_attention"])
def test_quantile_statistic_keeps_fp32_gradients_exact(name):
    """Per-module scales drawn at random: the histogram channel changes no gradient."""
    _, params, loss_fn, batch = _setup(name, jnp.float32)
    scaler = alj.adaptive(compute_dtype="float16", groups="module", statistic="quantile")
    groups = alj.param_groups(params, scaler)
    rng = np.random.default_rng(3)
    log2 = {g: int(rng.integers(-8, 16)) for g in groups}
    step, state = _grads_through(scaler, loss_fn, params, batch, log2)
    got, new_state, stats = step(state, params, *batch)
    assert bool(new_state[0].base.last_applied)
    assert all(h.shape == (56,) for h in stats.hist.values())
    ref = jax.grad(loss_fn)(params, *batch)
    assert_fp32_trees_close(got, ref)


@pytest.mark.slow
def test_quantile_on_fp16_model_flushes_at_most_about_threshold():
    """fp16 MLP, loss x 2^-28: after warm-up, the quantile scale is at most the amax
    scale and the share of non-zero cotangents measured below 2 u_min is at most T
    (read from the step's own histogram, which is at the scale used)."""
    _, params, loss16, batch = _setup("mlp", jnp.float16)
    tiny = lambda p, x, y: loss16(p, x, y) * 2.0**-28
    amax_step, amax_state = _grads_through(alj.adaptive(), tiny, params, batch)
    quant_step, quant_state = _grads_through(alj.adaptive(statistic="quantile"), tiny,
                                             params, batch)
    for _ in range(4):
        _, amax_state, _ = amax_step(amax_state, params, *batch)
        _, quant_state, stats = quant_step(quant_state, params, *batch)
    assert bool(quant_state[0].base.last_applied)
    s_q = float(quant_state[0].log2_scales[""])
    assert s_q <= float(amax_state[0].log2_scales[""])
    hist = sum(np.asarray(h) for h in stats.hist.values())
    lo = E_MIN - 16
    assert hist[: E_MIN + 1 - lo].sum() <= T * hist.sum()


def test_period_closed_form_loop():
    """period=F: scales are recomputed on steps where the applied steps so far are a
    multiple of F and held otherwise; an overflow backs the group that overflowed off at
    once, below the scale it overflowed at (its ceiling), which its next finite
    statistics turn into headroom kept at every recomputation after (the other groups
    follow the same F-step rhythm)."""
    F, backoff = 3, 2
    params = {"params": {k: {"w": jnp.zeros((3,))} for k in "ab"}}
    # decay=inf: this step's amax alone (the held peak has a test of its own).
    scaler = alj.adaptive(groups="module", period=F, factor=2.0**backoff, margin=MARGIN,
                          decay=math.inf, max_rise=1000)
    tx = alj.adaptive_unscale(scaler)
    update = jax.jit(functools.partial(tx.update, params=None))
    state = tx.init(params)
    rng = np.random.default_rng(5)
    steps = 12
    unit = {g: rng.uniform(-30.0, -10.0, steps) for g in "ab"}  # log2 unit amax
    unit["a"][:8] = unit["a"][0]  # the overflows and the headroom on the same statistics
    overflow_a = {4, 5}  # two consecutive overflows of group a
    s = {g: 0.0 for g in "ab"}
    ceiling, room = math.inf, 0  # group a's
    applied = 0
    for t in range(steps):
        rows = {}
        for g in "ab":
            bad = g == "a" and t in overflow_a
            amax = 2.0 ** (unit[g][t] + float(state.log2_scales[g]))
            rows[g] = (amax, 0.0, 8.0, bad)
        rows[""] = (2.0**-3, 0.0, 8.0, False)
        _, state = update(params, state, scale_stats=known_stats(state, rows))
        skipped = t in overflow_a
        if skipped:  # a has a measured peak: the plain backoff, below its ceiling
            ceiling = min(ceiling, s["a"])
            s["a"] -= backoff
        elif ceiling < math.inf:  # its first finite statistics since: headroom
            room = max(room, math.floor(LOG2_MAX - MARGIN - unit["a"][t]) - ceiling
                       + backoff // 2)
            ceiling = math.inf
        for g in "ab":
            if not (g == "a" and skipped) and applied % F == 0:
                s[g] = math.floor(LOG2_MAX - MARGIN - unit[g][t]) - (room if g == "a" else 0)
        applied += 0 if skipped else 1
        for g in "ab":
            assert float(state.log2_scales[g]) == s[g], (t, g)
        assert int(state.base.total_applied) == applied
    # The loop really held scales: period=1 would have moved them on every step.
    assert applied == steps - len(overflow_a)
    assert room > 0 and float(state.headroom["a"]) == pytest.approx(room - 6 / 256)


def test_options_are_validated():
    with pytest.raises(ValueError, match="period"):
        alj.adaptive(period=0)
    with pytest.raises(ValueError, match="factor"):
        alj.adaptive(factor=1.0)
    with pytest.raises(ValueError, match="max_rise"):
        alj.adaptive(max_rise=-1)
    assert alj.adaptive(factor=2.0**6).max_rise == 7  # the step after one backoff applies
    with pytest.raises(TypeError):
        alj.adaptive("amax")  # keyword-only
    with pytest.raises(ValueError, match="quantile"):
        alj.adaptive(statistic="median")


@pytest.mark.parametrize("root_unit", [6.0, -12.0])
def test_held_peak_sinks_by_decay_per_step_above_the_global_floor(root_unit):
    """decay=d: the amax rule uses max(amax, previous held peak - d) (unit scale), but on
    a finite step no group goes below the scale one global group would get from this
    step's amax. root_unit=6: the root's large amax puts that floor under the held peak;
    -12: the floor binds whenever the peak is held above this step's amax."""
    params = {"params": {"a": {"w": jnp.zeros((3,))}}}
    d, margin = 0.25, 2
    scaler = alj.adaptive(groups="module", decay=d, margin=margin, grad_dtype="float8_e4m3fn",
                          max_rise=1000)
    tx = alj.adaptive_unscale(scaler)
    update = jax.jit(functools.partial(tx.update, params=None))
    state = tx.init(params)
    log2_max = math.log2(448.0)
    held = -math.inf
    bound = []
    for unit in (0.0, -8.0, -8.0, 3.0, -8.0):
        amax = 2.0 ** (unit + float(state.log2_scales["a"]))
        root = 2.0 ** (root_unit + float(state.log2_scales[""]))
        rows = {"": (root, 0.0, 8.0, False), "a": (amax, 0.0, 8.0, False)}
        _, state = update(params, state, scale_stats=known_stats(state, rows))
        held = max(unit, held - d)
        peak = math.floor(log2_max - margin - held)
        floor = math.floor(log2_max - margin - max(unit, root_unit))
        assert float(state.log2_scales["a"]) == max(peak, floor)
        bound.append(floor > peak)
    assert any(bound) == (root_unit < 0)  # each case exercises what it says


@pytest.mark.parametrize("dtype,groups,decay", [
    ("float8_e4m3fn", "module", 0.0625), ("float8_e4m3fn", "global", math.inf),
    ("float16", "module", 0.0625), ("float8_e5m2", "module", 0.0625),
    ("float16", "global", math.inf)])
def test_default_decay(dtype, groups, decay):
    assert alj.adaptive(grad_dtype=dtype, groups=groups).decay == decay


def test_after_max_consecutive_skips_every_group_backs_off():
    """Overflow is blamed where it started; a group that only received non-finite values
    (its statistics hidden by that overflow) backs off with it by the plain backoff,
    however long the run. When K non-finite steps in a row show values no group's
    overflow explains, every non-finite group is blamed (the recovery one global scale
    would make)."""
    params = {"params": {k: {"w": jnp.zeros((3,))} for k in "ab"}}
    scaler = alj.adaptive(groups="module", max_consecutive_skips=2, factor=2.0)
    tx = alj.adaptive_unscale(scaler)
    update = jax.jit(functools.partial(tx.update, params=None))
    start = tx.init(params)
    start = start.with_log2_scales({g: 10 for g in start.log2_scales})
    for a_overflows, expected in [(True, [9.0, 8.0, 7.0, 6.0]),
                                  (False, [10.0, 10.0, 9.0, 7.0])]:
        state, b_scales = start, []
        for _ in range(4):
            rows = {"": (1.0, 0.0, 8.0, False), "a": (math.inf, 0.0, 8.0, a_overflows),
                    "b": (math.inf, 0.0, 8.0, False)}
            stats = known_stats(state, rows)  # (a NaN nobody overflowed at: non-finite)
            stats = dataclasses.replace(stats, nonfinite=jnp.asarray(True))
            _, state = update(params, state, scale_stats=stats)
            b_scales.append(float(state.log2_scales["b"]))
        assert int(state.base.total_skipped) == 4
        # b backs off by backoff with each overflow that hid it, and is never blamed for
        # it; with nobody to blame it holds for K steps, then it is blamed, and backs off
        # by backoff, then, with no measured peak, by backoff * 2**min(n, 4) (n: the
        # steps in a row it was blamed at before, 1; the steps it held do not count).
        assert b_scales == expected, a_overflows
        assert bool(state.overflowed["b"]) == (not a_overflows)
        assert int(state.health) & Health.SKIPPING


def test_a_group_blamed_first_backs_off_by_factor_alone():
    """The harder backoff after consecutive skips is for a group that overflowed at the
    previous step too, before anything was measured of it. Skips in a row, each blaming
    another group, once dropped every newly blamed group by backoff * 16, so a run kept
    skipping; each drops by backoff, and so does a measured group overflowing twice (it
    learns headroom instead)."""
    groups = "abcd"
    params = {"params": {k: {"w": jnp.zeros((3,))} for k in groups}}
    scaler = alj.adaptive(groups="module", factor=4.0)
    tx = alj.adaptive_unscale(scaler)
    update = jax.jit(functools.partial(tx.update, params=None))
    state = tx.init(params)
    state = state.with_log2_scales({g: 20 for g in state.log2_scales})
    for t, blamed in enumerate("abcdd"):
        rows = {"": (1.0, 0.0, 8.0, False)}
        for g in groups:
            amax = math.inf if g == blamed else 2.0 ** (LOG2_MAX - MARGIN - 1)
            rows[g] = (amax, 0.0, 8.0, g == blamed)
        before = float(state.log2_scales[blamed])
        _, state = update(params, state, scale_stats=known_stats(state, rows))
        assert int(state.base.notfinite_count) == t + 1
        # d overflows twice in a row: it has a measured peak, so its second drop is
        # backoff too (the harder one is for a group nothing was measured of yet).
        expected = 2.0
        assert before - float(state.log2_scales[blamed]) == expected, (t, blamed)
