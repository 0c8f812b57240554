"""Every documented option and front-end argument has a fixed test of its effect (issue 31).

The options of ``docs/scalers.md`` and the arguments of the front ends that no other
fixed test pins by their effect: each test here computes the expected result in closed
form (or against ``jax.grad`` of an fp32 model), on tiny shapes, so a change that ignores
the option fails every run. Where another test file already pins an option by its
effect, it is not repeated here.
"""

from __future__ import annotations

import contextlib
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _close import assert_fp32_trees_close
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_rule import _measured, _scales, _state, adjust

import adaloss_jax as alj
from adaloss_jax import _record
from adaloss_jax.equinox import eqx_adaptive_value_and_grad
from adaloss_jax.flax import TrainState, linen_train_step, nnx_optimizer, nnx_train_step

LOG2_MAX = math.log2(65504.0)  # fp16
E_MIN = -24  # log2 of fp16's smallest subnormal


def _mesh2():
    return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])


# ------------------------------------------------------------ alj.dynamic(...), end to end


def _dyn_loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"]))


_DYN_PARAMS = {"w": jnp.asarray([0.5, -0.25, 0.125])}
_DYN_X = jnp.asarray([[1.0, 2.0, -1.0]])


@functools.cache
def _dyn_step(**options):
    """A jitted step of ``loss_scaled(sgd, alj.dynamic(**options))`` with
    ``value_and_grad``; ``bad`` puts an inf into the scaled gradients (an overflow)."""
    tx = alj.loss_scaled(optax.sgd(0.1), alj.dynamic(**options))

    @jax.jit
    def step(params, opt_state, bad):
        loss, grads, stats = alj.value_and_grad(_dyn_loss)(opt_state, params, _DYN_X)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(bad, jnp.inf, g), grads)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, updates), opt_state, grads

    return tx, step


def _dyn_run(options, overflows):
    tx, step = _dyn_step(**options)
    params, state = _DYN_PARAMS, tx.init(_DYN_PARAMS)
    scales, applied = [], []
    for bad in overflows:
        before = params
        scale = float(alj.scale_state(state).loss_scale)
        params, state, grads = step(params, state, jnp.asarray(bad))
        st = alj.scale_state(state)
        scales.append(float(st.loss_scale))
        applied.append(bool(st.last_applied))
        if bad:  # skipped exactly
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(params),
                                                            jax.tree_util.tree_leaves(before)))
        else:  # the gradients were those of the loss times the scale the step ran at
            ref = jax.grad(_dyn_loss)(before, _DYN_X)
            np.testing.assert_allclose(grads["w"], scale * ref["w"], rtol=1e-6)
    return scales, applied


def test_dynamic_options_take_effect_through_the_factory_and_loss_scaled():
    """initial_scale=2**4, period=1 (grow on every finite step), factor=4, bounds
    [2**2, 2**8], hysteresis=2 (the first overflow after a refill is tolerated)."""
    options = dict(initial_scale=2.0**4, period=1, factor=4.0, min_loss_scale=2.0**2,
                   max_loss_scale=2.0**8, hysteresis=2)
    overflows = [False, False, False, True, True, True, True, True, False]
    scales, applied = _dyn_run(options, overflows)
    # 16 -> 64 -> 256 -> capped at 256; one overflow tolerated; then /4 per overflow down
    # to the floor 4, where it stays; a finite step grows it (and refills the hysteresis).
    assert scales == [64.0, 256.0, 256.0, 256.0, 64.0, 16.0, 4.0, 4.0, 16.0]
    assert applied == [not b for b in overflows]


def test_dynamic_consecutive_hysteresis_refills_after_every_applied_step():
    """hysteresis=2: overflow, finite, overflow backs off only when the finite step did
    not refill (``consecutive_hysteresis=False``: only growth refills)."""
    overflows = [True, False, True, True]
    base = dict(initial_scale=2.0**10, period=100, hysteresis=2)
    refill, _ = _dyn_run({**base, "consecutive_hysteresis": True}, overflows)
    plain, _ = _dyn_run(base, overflows)
    assert refill == [1024.0, 1024.0, 1024.0, 512.0]
    assert plain == [1024.0, 1024.0, 512.0, 256.0]


# ----------------------------------------------------- alj.adaptive(...): the rule's options


def test_threshold_sets_the_gaussian_scale():
    """statistic="gaussian": the smallest scale, at least 1, at which a zero-mean normal
    with the measured std puts at most ``threshold`` below u_min:
    ``max(0, ceil(log2 u_min - log2(sqrt(2) erfinv(T)) - log2 sigma))``; T=0.2 asks for
    8 binades less than the default 1e-3."""
    unit_sigma, t = -30.5, 0.2

    def erfinv(y):  # bisection on math.erf: double precision
        lo, hi = 0.0, 3.0
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
        return lo

    def expected(t):
        x = E_MIN - math.log2(math.sqrt(2.0) * erfinv(t)) - unit_sigma
        assert abs(x - round(x)) > 0.1  # no rounding question at the ceiling
        return max(0, math.ceil(x))

    state = _state(statistic="gaussian", threshold=t, max_rise=100, decay=math.inf)
    used = np.asarray(state.log2_scales.array)
    n = np.full(3, 1000.0, np.float32)
    sumsq = (2.0 ** (unit_sigma + used)) ** 2 * n
    new = adjust(state, _measured(state, [-20.0] * 3, sumsq=jnp.asarray(sumsq, jnp.float32),
                                  count=jnp.asarray(n)))
    assert (expected(0.2), expected(1e-3)) == (9, 17)
    assert math.floor(LOG2_MAX - 4 + 20.0) > 17  # the amax rule asks for more
    assert _scales(new) == [9.0] * 3


def test_threshold_sets_the_quantile_scale():
    """statistic="quantile": 10% of the values in binade -20 (at the used scale 2**10),
    90% in binade -12. T=0.2 lets the lower binade flush and puts the upper one at
    2 u_min: ``s = used + E_MIN + 1 - (-12)``; the default 1e-3 would keep the lower one
    (``s = used + E_MIN + 1 + 20``)."""
    from adaloss_jax import _channel

    lo = E_MIN - _channel.HIST_BELOW
    hist = np.zeros((3, _channel.NBINS), np.float32)
    hist[:, -20 - lo] = 100.0
    hist[:, -12 - lo] = 900.0
    state = _state(statistic="quantile", threshold=0.2, max_rise=100, decay=math.inf)
    new = adjust(state, _measured(state, [-21.5] * 3, hist=jnp.asarray(hist)))
    assert _scales(new) == [10 + E_MIN + 1 + 12] * 3


def test_max_loss_scale_caps_statistics_and_blind_jumps():
    state = _state(max_loss_scale=2.0**20, max_rise=100, decay=math.inf)
    new = adjust(state, _measured(state, [-30.0] * 3))  # asks for floor(LOG2_MAX - 4 + 30)
    assert math.floor(LOG2_MAX - 4 + 30) > 20 and _scales(new) == [20.0] * 3
    blind = adjust(state, _measured(state, [None] * 3))  # a blind jump of 34 binades
    assert _scales(blind) == [20.0] * 3


def test_min_loss_scale_floors_backoffs():
    """An overflow at group a (b only received its non-finite values) backs both off
    by log2(16) = 4 binades, from 6 to 2: floored at min_loss_scale=2**4."""
    unit, bad = [-20.0, np.inf, np.inf], (False, True, False)
    state = _state(scales=(6, 6, 6), min_loss_scale=2.0**4, initial_scale=2.0**6,
                   max_rise=100)
    new = adjust(state, _measured(state, unit, bad=bad))
    assert not bool(new.last_applied) and _scales(new)[1:] == [4.0, 4.0]


# ---------------------------------------- alj.adaptive(...): options through the gradient


_doc_lay = alj.scale_group("doc_lay")(lambda p, x: x * p["w"].astype(jnp.float16))
_LAY_PARAMS = {"doc_lay": {"w": jnp.ones((4,))}}


def _lay_loss(p, c):
    """fp16 compute; every cotangent and parameter gradient is ``c`` times the scale."""
    return jnp.sum(_doc_lay(p["doc_lay"], jnp.ones((4,), jnp.float16)).astype(jnp.float32)) * c


@functools.cache
def _lay_step(**options):
    tx = alj.adaptive_scaled(optax.sgd(1.0), alj.adaptive(**options))

    @jax.jit
    def step(params, state, c):
        loss, grads, stats = alj.adaptive_value_and_grad(_lay_loss)(state, params, c)
        updates, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, updates), state, stats

    return tx, step


def test_margin_keeps_its_binades_free_below_the_format_max():
    """One global group measured at 2**10 with unit amax 2**-10: the next scale is
    ``floor(log2 65504 - margin + 10)``: 18 with margin=7 (21 with the default 4, as the
    retries test below finds)."""
    tx, step = _lay_step(initial_scale=2.0**10, retries=0, margin=7)
    _, state, stats = step(_LAY_PARAMS, tx.init(_LAY_PARAMS), jnp.float32(2.0**-10))
    assert float(stats.amax[""]) == 1.0  # 2**-10 at 2**10
    assert float(alj.scale_state(state).log2_scales[""]) == 25 - 7


@pytest.mark.parametrize("retries", [2, 4])
def test_retries_bounds_the_passes_a_step_takes(retries):
    """From 2**40 the cotangent ``2**-10 * S`` overflows fp16 above 24. Each overflow backs
    off by log2(16) = 4, doubled for each pass in a row before it that overflowed too
    (nothing measured yet): 40, 36, 28, then 12, which fits, but its statistics ask for
    floor(log2 65504 - 4 + 10) = 21, more than ``max_rise`` above it: refused. A retry
    is the next step computed in its place. With ``retries`` retries the step takes
    ``retries + 1`` passes: 2 retries end at 28 and skip (the scales at 12); 4 reach 21,
    and the step is applied there."""
    passes = [40, 36, 28, 12, 21]
    tx, step = _lay_step(groups="global", initial_scale=2.0**40, retries=retries)
    params, state, stats = step(_LAY_PARAMS, tx.init(_LAY_PARAMS), jnp.float32(2.0**-10))
    st = alj.scale_state(state)
    assert int(st.total_retries) == retries
    assert float(stats.log2_scales[""]) == passes[retries]  # the last pass's scale
    if retries < 4:
        assert not bool(st.last_applied)
        assert float(st.log2_scales[""]) == passes[retries + 1]
        np.testing.assert_array_equal(params["doc_lay"]["w"], np.ones(4))
    else:
        assert bool(st.last_applied) and float(st.log2_scales[""]) == 21
        np.testing.assert_array_equal(params["doc_lay"]["w"], np.full(4, 1 - 2.0**-10))


_doc_sim = alj.scale_group("doc_sim")(lambda p, x: x * p["w"])
_SIM_C = jnp.asarray([1.3, 0.7, 3e-6, -5.1], jnp.float32)
_SIM_PARAMS = {"doc_sim": {"w": jnp.ones(4)}}


def _sim_loss(p, x):
    return jnp.sum(_doc_sim(p["doc_sim"], x) * _SIM_C)


def test_simulate_rounds_cotangents_to_grad_dtype_where_they_enter_a_module():
    """simulate=True, grad_dtype="float8_e5m2" on an fp32 model: the cotangent entering
    ``doc_sim``, ``C * S``, is rounded to e5m2, so the parameter gradient is exactly
    ``e5m2(C * S)``: at S=1, 1.3 -> 1.25, 0.7 -> 0.75, -5.1 -> -5, and 3e-6 (below half
    e5m2's smallest subnormal 2**-16) flushes to 0; at S=2**8 it is kept."""
    scaler = alj.adaptive(grad_dtype="float8_e5m2", simulate=True, retries=0)
    state = alj.adaptive_unscale(scaler).init(_SIM_PARAMS)
    vg = jax.jit(alj.adaptive_value_and_grad(_sim_loss))
    for k in (0, 8):
        _, grads, _ = vg(state.with_log2_scales({"": k}), _SIM_PARAMS, jnp.ones(4))
        want = np.asarray((_SIM_C * 2.0**k).astype(jnp.float8_e5m2).astype(jnp.float32))
        assert not np.array_equal(want, np.asarray(_SIM_C * 2.0**k))
        assert (want[2] == 0) == (k == 0)
        np.testing.assert_array_equal(grads["doc_sim"]["w"], want)


_doc_inner = alj.scale_group("doc_blk/inner")(lambda p, x: x * p["w"] * 2.0**-8)
_doc_blk = alj.scale_group("doc_blk")(lambda p, x: _doc_inner(p["inner"], x) * 2.0**8)
_BLK_PARAMS = {"doc_blk": {"inner": {"w": jnp.ones(4)}}}


def _blk_loss(p, x):
    return jnp.sum(_doc_blk(p["doc_blk"], x)) * 2.0**-10


def test_max_depth_puts_scale_points_only_around_modules_that_deep():
    """``doc_blk/inner`` is at depth 2, inside ``doc_blk``; the cotangent between them is
    2**8 times the one at doc_blk's boundary (2**-10). With max_depth=1 inner gets no
    scale point: its parameters are doc_blk's (their gradient, 2**-10 at unit scale,
    comes back at doc_blk's scale 2**5), and the larger cotangent inside doc_blk is not
    measured: doc_blk's amax is its boundary's, 2**-10 at 2**5."""
    for max_depth, groups in ((None, ("", "doc_blk", "doc_blk/inner")), (1, ("", "doc_blk"))):
        scaler = alj.adaptive(groups="module", compute_dtype="float16", retries=0,
                              max_depth=max_depth, same_step=False)  # at the set scales
        state = alj.adaptive_unscale(scaler).init(_BLK_PARAMS)
        assert state.groups == groups
    state = state.with_log2_scales({"": 0, "doc_blk": 5})
    _, grads, stats = jax.jit(alj.adaptive_value_and_grad(_blk_loss))(state, _BLK_PARAMS,
                                                                      jnp.ones(4))
    assert sorted(stats.log2_scales) == ["", "doc_blk"]
    assert float(stats.amax[""]) == 2.0**-10
    assert float(stats.amax["doc_blk"]) == 2.0**-10 * 2.0**5
    np.testing.assert_array_equal(grads["doc_blk"]["inner"]["w"], np.full(4, 2.0**-5))


# ------------------------------------------------------------------ pure-JAX entry points


_HOOK_ON: list = []


@contextlib.contextmanager
def _doc_hook(receiver):
    """A front end's hook: within it, ``_hooked`` reports its calls as the module at
    ``("doc_hooked",)``."""
    del receiver
    _HOOK_ON.append(True)
    try:
        yield
    finally:
        _HOOK_ON.pop()


def _dense(p, x):
    return jnp.tanh(x @ p["w"])


def _hooked(p, x):
    if _HOOK_ON:
        return _record.report(("doc_hooked",), None, _dense, (p, x), {})
    return _dense(p, x)


def _hooked_loss(p, x):
    return jnp.sum(_hooked(p["doc_hooked"], x) @ p["head"]["w"])


_HOOK_PARAMS = {"doc_hooked": {"w": jnp.full((3, 3), 0.5)}, "head": {"w": jnp.ones((3, 2))}}


def test_adaptive_value_and_grad_hooks_make_a_framework_report_its_modules():
    """``hooks``: module calls reported through a hook get their own scale group (the
    parameters' gradients scaled by its scale); without the hook the loss calls no
    module."""
    scaler = alj.adaptive(groups="module", compute_dtype="float16", retries=0,
                          same_step=False)  # the gradients at the scales set here
    state = alj.adaptive_unscale(scaler).init(_HOOK_PARAMS)
    assert state.groups == ("", "doc_hooked", "head")
    state = state.with_log2_scales({"": 3, "doc_hooked": 7, "head": 0})
    x = jnp.ones((2, 3))
    vg = jax.jit(alj.adaptive_value_and_grad(_hooked_loss, hooks=(_doc_hook,)))
    _, grads, stats = vg(state, _HOOK_PARAMS, x)
    assert sorted(stats.log2_scales) == ["", "doc_hooked"]
    ref = jax.grad(_hooked_loss)(_HOOK_PARAMS, x)
    # head is called by no module: its parameters are the root's (scale 2**3).
    want = {"doc_hooked": jax.tree_util.tree_map(lambda g: g * 2.0**7, ref["doc_hooked"]),
            "head": jax.tree_util.tree_map(lambda g: g * 2.0**3, ref["head"])}
    assert_fp32_trees_close(grads, want)
    with pytest.raises(ValueError, match="found no module call"):
        alj.adaptive_value_and_grad(_hooked_loss)(state, _HOOK_PARAMS, x)


def test_value_and_grad_argnums_scales_the_chosen_arguments():
    tx = alj.loss_scaled(optax.sgd(1.0), alj.static(2.0**3))
    state = tx.init({"w": jnp.zeros(2)})
    f = lambda a, b: jnp.sum(a * b**2)
    a, b = jnp.asarray([1.0, 2.0]), jnp.asarray([3.0, -1.0])
    loss, gb, stats = alj.value_and_grad(f, argnums=1)(state, a, b)
    assert float(loss) == 11.0 and float(stats.loss_scale) == 8.0
    np.testing.assert_array_equal(gb, 8.0 * 2 * a * b)
    _, (ga, gb2), _ = alj.value_and_grad(f, argnums=(0, 1))(state, a, b)
    np.testing.assert_array_equal(ga, 8.0 * b**2)
    np.testing.assert_array_equal(gb2, 8.0 * 2 * a * b)


def test_select_tree_and_all_finite():
    t, f = {"w": jnp.ones(2), "b": jnp.ones(())}, {"w": jnp.zeros(2), "b": jnp.zeros(())}
    for pred, want in ((True, 1.0), (False, 0.0)):
        got = alj.select_tree(jnp.bool_(pred), t, f)
        assert [np.asarray(x).tolist() for x in jax.tree_util.tree_leaves(got)] == [
            want, [want, want]]
    assert bool(alj.all_finite(t))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        assert not bool(alj.all_finite({**t, "b": jnp.asarray(bad)})), bad


# ----------------------------------------------------------------------------- Flax linen


class _Linen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(jnp.tanh(nn.Dense(4)(x)))  # fp32: compute_dtype makes it scale


_LX = jax.random.normal(jax.random.key(0), (5, 3))
_LINEN = _Linen()
_LINEN_PARAMS = _LINEN.init(jax.random.key(1), _LX)["params"]


def _linen_loss(params, x, *, weight):
    out = _LINEN.apply({"params": params}, x)
    return jnp.mean(out**2) * weight, {"out0": out[0, 0]}


def _scalers(retries=4):
    """fp32 models scaled all the same (``compute_dtype``); ``retries=0``: one pass at
    the state's scales, applied however far below its statistics' call (``max_rise``)."""
    return {"dynamic": alj.dynamic(initial_scale=2.0**5),
            "adaptive": alj.adaptive(groups="module", compute_dtype="float16", retries=retries,
                                     max_rise=1000 if retries == 0 else None)}


_LINEN_REF = jax.jit(lambda p, x, w: jax.value_and_grad(_linen_loss, has_aux=True)(
    p, x, weight=w))
_LINEN_STEP = jax.jit(lambda s, x, w: linen_train_step(s, _linen_loss, x, has_aux=True, weight=w))


@pytest.mark.parametrize("family", ["dynamic", "adaptive"])
def test_linen_train_step_has_aux_and_keyword_arguments(family):
    """``linen_train_step(state, loss_fn, *args, has_aux=True, **kwargs)``: the keyword
    arguments reach the loss, ``metrics["aux"]`` is its aux, and the update is SGD on
    the gradient of the unscaled fp32 loss (the scale was taken out exactly)."""
    state = TrainState.create(apply_fn=_LINEN.apply, params=_LINEN_PARAMS,
                              tx=optax.sgd(1.0), scaler=_scalers()[family])
    w = jnp.float32(2.0**-3)
    new, metrics = _LINEN_STEP(state, _LX, w)
    assert bool(metrics["applied"])
    (loss, aux), ref = _LINEN_REF(_LINEN_PARAMS, _LX, w)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)
    assert float(metrics["aux"]["out0"]) == pytest.approx(float(aux["out0"]), rel=1e-6)
    if family == "dynamic":
        assert float(metrics["loss_scale"]) == 2.0**5
    got = jax.tree_util.tree_map(lambda a, b: a - b, _LINEN_PARAMS, new.params)
    assert_fp32_trees_close(got, ref, atol=1e-6)


@functools.cache
def _mapped_linen_step(scaler, axis_name):
    """``linen_train_step`` under ``shard_map`` on 2 devices with nothing reducing the
    gradients (check_vma=False); each device returns its own state."""
    state = TrainState.create(apply_fn=_LINEN.apply, params=_LINEN_PARAMS, tx=optax.sgd(0.1),
                              scaler=scaler, axis_name=axis_name)

    @jax.custom_vjp
    def poison(h, bad):
        return h

    poison.defvjp(lambda h, bad: (h, bad),
                  lambda bad, g: (g * jnp.where(bad[:, None], jnp.inf, 1.0), None))

    def loss_fn(params, x, bad):
        return jnp.mean(poison(_LINEN.apply({"params": params}, x), bad) ** 2)

    def local(state, x, bad):
        state, metrics = linen_train_step(state, loss_fn, x, bad)
        return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], (state, metrics["applied"]))

    mesh = _mesh2()
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                              out_specs=P("data"), check_vma=False))
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return lambda x, bad: jax.device_get(f(jax.device_put(state, rep), jax.device_put(x, dat),
                                           jax.device_put(bad, dat)))


@pytest.mark.parametrize("family", ["dynamic", "adaptive"])
def test_linen_train_state_axis_name_makes_every_device_skip_together(family):
    """``TrainState.create(..., axis_name=...)``: an overflow in one device's shard skips
    the step on every device, with the same scales (without the reduction the other
    device would apply its step)."""
    scaler = {"dynamic": alj.dynamic(initial_scale=2.0**10),
              "adaptive": alj.adaptive(groups="module", compute_dtype="float16", retries=0,
                                       max_rise=1000)}[family]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    bad = jnp.asarray([False, False, True, False])  # the second device's shard
    state, applied = _mapped_linen_step(scaler, "data")(x, bad)
    assert applied.tolist() == [False, False]
    devices = [jax.tree_util.tree_map(lambda a, d=d: a[d], state) for d in range(2)]
    summaries = [alj.diagnostics.scale_summary(s) for s in devices]
    assert summaries[0] == summaries[1]
    if family == "dynamic":
        assert summaries[0]["log2_group_scales"] == {"": 9.0}  # backed off from 2**10
    for s in devices:  # no device moved its parameters
        for a, b in zip(jax.tree_util.tree_leaves(s.params),
                        jax.tree_util.tree_leaves(_LINEN_PARAMS)):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------ Flax NNX


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(3, 4, rngs=rngs)  # fp32: compute_dtype makes it scale
        self.l2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(model, x, *, weight):
    out = model(x)
    return jnp.mean(out**2) * weight, {"out0": out[0, 0]}


_ONLY_L2 = nnx.All(nnx.Param, nnx.PathContains("l2"))
_NNX_STEP = nnx.jit(lambda m, o, x, w: nnx_train_step(m, o, _nnx_loss, x, has_aux=True,
                                                      weight=w))


def _numpy(tree):
    return jax.tree_util.tree_map(np.asarray, nnx.as_pure(tree))


@pytest.mark.parametrize("family", ["dynamic", "adaptive"])
def test_nnx_train_step_wrt_has_aux_and_keyword_arguments(family):
    """``nnx_optimizer(..., wrt=...)`` trains only the selected variables (the adaptive
    scaler's groups are theirs), ``nnx_train_step(..., has_aux=True, **kwargs)`` hands
    the keyword arguments to the loss and returns its aux, and the update is SGD on the
    gradient of the unscaled fp32 loss."""
    model = _NnxNet(nnx.Rngs(0))
    optimizer = nnx_optimizer(model, optax.sgd(1.0), _scalers(retries=0)[family],
                              wrt=_ONLY_L2)
    if family == "adaptive":
        assert alj.scale_state(optimizer).groups == ("", "l2")
    before = _numpy(nnx.state(model, nnx.Param))
    w = jnp.float32(2.0**-3)
    metrics = _NNX_STEP(model, optimizer, _LX, w)
    assert bool(metrics["applied"])
    ref_model = _NnxNet(nnx.Rngs(0))
    (loss, aux), ref = nnx.jit(nnx.value_and_grad(
        lambda m, w: _nnx_loss(m, _LX, weight=w), argnums=nnx.DiffState(0, _ONLY_L2),
        has_aux=True))(ref_model, w)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-6)
    assert float(metrics["aux"]["out0"]) == pytest.approx(float(aux["out0"]), rel=1e-6)
    after = _numpy(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree_util.tree_leaves(before["l1"]),
                    jax.tree_util.tree_leaves(after["l1"])):
        np.testing.assert_array_equal(a, b)  # not in wrt: untouched
    got = jax.tree_util.tree_map(lambda a, b: a - b, before["l2"], after["l2"])
    assert_fp32_trees_close(got, _numpy(ref)["l2"], atol=1e-6)


def test_nnx_optimizer_axis_name_goes_to_the_scaler():
    """The adaptive state keeps ``axis_name``: its gradient function and update reduce
    the statistics over it (``TrainState.create``'s test above shows the effect)."""
    model = _NnxNet(nnx.Rngs(0))
    for axis_name in ("data", None):
        opt = nnx_optimizer(model, optax.sgd(0.1), alj.adaptive(groups="module"),
                            axis_name=axis_name)
        assert alj.scale_state(opt).axis_name == axis_name


# -------------------------------------------------------------------------------- Equinox


def test_eqx_adaptive_value_and_grad_scales_each_module_and_returns_aux():
    """Each ``eqx.Module`` that owns arrays is a group (``layers/i``); its gradients come
    back scaled by its own scale, ``adaptive_unscale`` turns them into the gradient of
    the fp32 loss, ``has_aux`` returns the aux and keyword arguments reach the loss."""
    model = eqx.filter_jit(lambda k: eqx.nn.MLP(3, 2, 4, depth=2, key=k))(
        jax.random.key(0))  # fp32
    params = eqx.filter(model, eqx.is_inexact_array)
    tx = alj.adaptive_unscale(alj.adaptive(groups="module", compute_dtype="float16",
                                           retries=0, max_rise=1000))
    state = tx.init(params)
    assert state.groups == ("", "layers/0", "layers/1", "layers/2")
    log2 = {"": 2, "layers/0": 9, "layers/1": -3, "layers/2": 5}
    state = state.with_log2_scales(log2)
    x = jax.random.normal(jax.random.key(1), (5, 3))

    def loss_fn(model, x, *, weight):
        out = jax.vmap(model)(x)
        return jnp.mean(out**2) * weight, out[0, 0]

    @eqx.filter_jit
    def step(model, state, x):
        (loss, aux), grads, stats = eqx_adaptive_value_and_grad(loss_fn, has_aux=True)(
            state, model, x, weight=0.5)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array),
                                   loss=loss, scale_stats=stats)
        ref = eqx.filter_value_and_grad(lambda m: loss_fn(m, x, weight=0.5), has_aux=True)(
            model)
        return (loss, aux, grads, updates, state, stats), ref

    (loss, aux, grads, updates, new, stats), ((ref_loss, ref_aux), ref) = step(model, state, x)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert float(aux) == pytest.approx(float(ref_aux), rel=1e-6)
    assert bool(new.base.last_applied)
    assert sorted(stats.log2_scales) == sorted(log2)
    for i, (g, r) in enumerate(zip(grads.layers, ref.layers)):
        s = 2.0 ** stats.log2_scales[f"layers/{i}"]  # as set, or chosen in the pass
        assert_fp32_trees_close((g.weight, g.bias), (r.weight * s, r.bias * s))
    assert_fp32_trees_close(updates, eqx.filter(ref, eqx.is_inexact_array))


# ---------------------------------------------------------------------------- checkpoints


def _checkpoint_trees():
    """A state worth restoring (scales moved off their start), and a fresh template."""
    params = {"Dense_0": {"kernel": jnp.arange(16.0).reshape(4, 4)}}
    tx = alj.adaptive_scaled(optax.adam(1e-3), alj.adaptive(groups="module"))
    ad, inner = tx.init(params)
    tree = {"params": params, "opt_state": (ad.with_log2_scales({"": 3, "Dense_0": 7}), inner)}
    template = {"params": jax.tree_util.tree_map(jnp.zeros_like, params),
                "opt_state": tx.init(params)}
    return tree, template


def _sharded(template):
    mesh = _mesh2()
    return {"params": jax.device_put(template["params"], NamedSharding(mesh, P("data"))),
            "opt_state": jax.device_put(template["opt_state"], NamedSharding(mesh, P()))}


def _assert_restored(restored, tree, template):
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(tree)
    for r, t, want in zip(*(jax.tree_util.tree_leaves(x) for x in (restored, template, tree))):
        assert isinstance(r, jax.Array) and r.sharding == t.sharding
        np.testing.assert_array_equal(np.asarray(r), np.asarray(want))
    table = alj.diagnostics.scale_table
    assert table(restored["opt_state"]) == table(tree["opt_state"])


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "sharded"])
def test_load_state_restores_onto_the_templates_placement(tmp_path, sharded):
    """``load_state`` reads back every leaf, on one device for an unsharded template and
    with the template's sharding for one that spans several devices."""
    tree, template = _checkpoint_trees()
    if sharded:
        template = _sharded(template)
        assert len(template["params"]["Dense_0"]["kernel"].sharding.device_set) == 2
    alj.checkpoint.save_state(tmp_path / "ckpt.npz", tree)
    _assert_restored(alj.checkpoint.load_state(tmp_path / "ckpt.npz", template), tree, template)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-device", "sharded"])
def test_orbax_restores_the_documented_tree_onto_a_template(tmp_path, sharded):
    """docs/checkpoints.md: ``StandardCheckpointer`` save, then restore into a template of
    concrete arrays built by the same optimizer (sharded or not)."""
    tree, template = _checkpoint_trees()
    if sharded:
        template = _sharded(template)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", tree)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", template)
    _assert_restored(restored, tree, template)
