"""Policies: closed-form loops against the documented rule, state pytrees, bad input."""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import adaloss_jax as alj
from adaloss_jax import _common


def reference(scaler: alj.DynamicLossScale, flags):
    """The rule from ``DynamicLossScale``'s docstring, in plain Python."""
    scale, count, hyst = scaler.initial_scale, 0, scaler.hysteresis
    nf = applied_total = skipped_total = nonfinite_loss_total = 0
    out = []
    for grads_finite, loss_finite in flags:
        applied = grads_finite and loss_finite
        if applied:
            count += 1
            if scaler.consecutive_hysteresis:
                hyst = scaler.hysteresis
            if count == scaler.period:
                scale = min(scale * scaler.factor, scaler.max_loss_scale)
                count = 0
                hyst = scaler.hysteresis
        elif loss_finite:
            count = 0
            hyst = max(hyst - 1, 0)
            if hyst == 0:
                scale = max(scale / scaler.factor, scaler.min_loss_scale)
        nf = 0 if applied else nf + 1
        applied_total += applied
        skipped_total += not applied
        nonfinite_loss_total += not loss_finite
        out.append(
            dict(
                loss_scale=scale,
                finite_count=count,
                hysteresis_left=hyst,
                notfinite_count=nf,
                total_applied=applied_total,
                total_skipped=skipped_total,
                total_nonfinite_loss=nonfinite_loss_total,
                last_applied=applied,
            )
        )
    return out


def _scan(scaler, state, grads_finite, loss_finite):
    def body(s, flags):
        s = scaler.adjust(s, *flags)
        return s, s

    return jax.lax.scan(body, state, (grads_finite, loss_finite))[1]


# One compiled trajectory function per scaler (scalers are hashable static config).
run = jax.jit(_scan, static_argnums=0)


def trajectory(scaler, flags):
    flags = np.asarray(flags, bool).reshape(-1, 2)
    states = run(scaler, scaler.init(), jnp.asarray(flags[:, 0]), jnp.asarray(flags[:, 1]))
    return jax.device_get(states)


def assert_matches_reference(scaler, flags):
    got = trajectory(scaler, flags)
    want = reference(scaler, [tuple(map(bool, f)) for f in np.asarray(flags).reshape(-1, 2)])
    for t, w in enumerate(want):
        for field, value in w.items():
            g = getattr(got, field)[t]
            assert g == value, f"step {t} field {field}: got {g}, rule says {value}"
        assert np.isfinite(got.loss_scale[t]) and got.loss_scale[t] > 0
    return got


def finite_steps(n):
    return [(True, True)] * n


def overflow_steps(n):
    return [(False, True)] * n


CONFIGS = {
    "classic": dict(initial_scale=2.0**12, period=3),
    "period1": dict(initial_scale=2.0**12, period=1),
    "factor4-tight": dict(
        initial_scale=2.0**12, period=2, factor=4.0, min_loss_scale=2.0**8,
        max_loss_scale=2.0**16,
    ),
    "hyst3": dict(initial_scale=2.0**12, period=4, hysteresis=3),
    "hyst2-consecutive": dict(
        initial_scale=2.0**12, period=4, hysteresis=2, consecutive_hysteresis=True
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_flags_follow_documented_rule(name):
    scaler = alj.DynamicLossScale(**CONFIGS[name])
    rng = np.random.default_rng(1)
    # Mostly finite steps, some gradient overflows, a few non-finite losses.
    u = rng.random(300)
    flags = np.stack([u > 0.25, ~((u > 0.15) & (u < 0.2))], axis=1)
    got = assert_matches_reference(scaler, flags)
    # The sequence exercises every branch.
    assert got.total_nonfinite_loss[-1] > 0
    assert got.total_skipped[-1] > got.total_nonfinite_loss[-1]
    assert len(set(got.loss_scale.tolist())) > 2


def test_growth_every_period_hand_derived():
    scaler = alj.DynamicLossScale(initial_scale=2.0**4, period=3)
    got = trajectory(scaler, finite_steps(9))
    # Growth on the 3rd, 6th and 9th consecutive finite steps.
    assert got.loss_scale.tolist() == [16, 16, 32, 32, 32, 64, 64, 64, 128]
    assert got.finite_count.tolist() == [1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert got.total_applied.tolist() == list(range(1, 10))
    assert got.total_skipped.tolist() == [0] * 9


def test_overflow_resets_the_period():
    scaler = alj.DynamicLossScale(initial_scale=2.0**4, period=3)
    got = trajectory(scaler, finite_steps(2) + overflow_steps(1) + finite_steps(3))
    assert got.loss_scale.tolist() == [16, 16, 8, 8, 8, 16]
    assert got.notfinite_count.tolist() == [0, 0, 1, 0, 0, 0]


def test_scale_never_leaves_bounds_nor_becomes_zero_inf_nan():
    # Extremes of fp32: the scale sticks at the bounds instead of reaching 0 or inf.
    scaler = alj.DynamicLossScale(
        initial_scale=1.0, period=1, min_loss_scale=2.0**-126, max_loss_scale=2.0**127
    )
    got = assert_matches_reference(scaler, overflow_steps(200) + finite_steps(400))
    assert got.loss_scale[199] == 2.0**-126
    assert got.loss_scale[-1] == 2.0**127
    assert np.all(np.isfinite(got.loss_scale)) and np.all(got.loss_scale > 0)
    # The documented defaults: min 1, max 2**64.
    scaler = alj.DynamicLossScale(initial_scale=2.0**15, period=1)
    got = trajectory(scaler, overflow_steps(40) + finite_steps(100))
    assert got.loss_scale[39] == 1.0
    assert got.loss_scale[-1] == 2.0**64


def test_hysteresis_refills_only_on_growth():
    scaler = alj.DynamicLossScale(initial_scale=2.0**10, period=3, hysteresis=2)
    # overflow, finite, overflow: no growth in between, so the 2nd overflow backs off.
    got = trajectory(scaler, [(False, True), (True, True), (False, True), (False, True)])
    assert got.loss_scale.tolist() == [1024, 1024, 512, 256]
    assert got.hysteresis_left.tolist() == [1, 1, 0, 0]
    # A growth refills it.
    got = trajectory(scaler, overflow_steps(1) + finite_steps(3) + overflow_steps(2))
    assert got.loss_scale.tolist() == [1024, 1024, 1024, 2048, 2048, 1024]
    assert got.hysteresis_left.tolist() == [1, 1, 1, 2, 1, 0]


def test_hysteresis_consecutive_refills_after_every_applied_step():
    scaler = alj.DynamicLossScale(
        initial_scale=2.0**10, period=3, hysteresis=2, consecutive_hysteresis=True
    )
    got = trajectory(scaler, [(False, True), (True, True), (False, True), (False, True)])
    # The finite step refills, so only two overflows in a row back off.
    assert got.loss_scale.tolist() == [1024, 1024, 1024, 512]
    assert got.hysteresis_left.tolist() == [1, 2, 1, 0]


def test_nonfinite_loss_keeps_scale_and_finite_count():
    scaler = alj.DynamicLossScale(initial_scale=2.0**4, period=3)
    flags = [(True, True), (True, True), (True, False), (False, False), (True, True)]
    got = assert_matches_reference(scaler, flags)
    assert got.loss_scale.tolist() == [16, 16, 16, 16, 32]
    assert got.finite_count.tolist() == [1, 2, 2, 2, 0]
    assert got.last_applied.tolist() == [True, True, False, False, True]
    assert got.notfinite_count.tolist() == [0, 0, 1, 2, 0]
    assert got.total_skipped[-1] == 2
    assert got.total_nonfinite_loss[-1] == 2
    assert got.total_applied[-1] == 3


@pytest.mark.parametrize(
    "scaler", [alj.StaticLossScale(2.0**7), alj.NoLossScale()], ids=["static", "none"]
)
def test_static_and_none_keep_scale_and_count(scaler):
    flags = [(True, True), (False, True), (False, True), (True, False), (True, True)]
    got = trajectory(scaler, flags)
    expected = 2.0**7 if isinstance(scaler, alj.StaticLossScale) else 1.0
    assert got.loss_scale.tolist() == [expected] * 5
    assert got.last_applied.tolist() == [True, False, False, False, True]
    assert got.notfinite_count.tolist() == [0, 1, 2, 3, 0]
    assert got.total_applied[-1] == 2
    assert got.total_skipped[-1] == 3
    assert got.total_nonfinite_loss[-1] == 1


def test_factories():
    assert alj.static(2.0**10) == alj.StaticLossScale(2.0**10)
    assert alj.dynamic(period=7) == alj.DynamicLossScale(period=7)
    assert isinstance(alj.no_scaling(), alj.NoLossScale)
    assert isinstance(alj.dynamic(compute_dtype="float8_e4m3fn"), alj.DynamicLossScale)
    derived = dataclasses.replace(alj.dynamic(period=7), hysteresis=2)
    assert (derived.period, derived.hysteresis) == (7, 2)
    with pytest.raises(ValueError, match="hysteresis"):
        dataclasses.replace(derived, hysteresis=0)


def test_state_flatten_unflatten_keeps_every_field_and_survives_jit():
    scaler = alj.DynamicLossScale(initial_scale=2.0**10, period=3, hysteresis=2)
    state = jax.tree_util.tree_map(lambda x: x[-1], run(
        scaler, scaler.init(), jnp.array([True, False, True, True]), jnp.array([True] * 4)
    ))
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert len(leaves) == len(alj.LossScaleState._fields)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(back, alj.LossScaleState)
    through_jit = jax.jit(lambda s: s)(state)
    for field in alj.LossScaleState._fields:
        for other in (back, through_jit):
            a, b = getattr(state, field), getattr(other, field)
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    assert state.loss_scale.dtype == jnp.float32
    assert state.last_applied.dtype == jnp.bool_


def test_min_loss_scale_survives_jit_unlike_jmp():
    """jmp's DynamicLossScale drops ``min_loss_scale`` in tree_flatten; ours is config."""
    jmp_scale = jmp.DynamicLossScale(
        loss_scale=jnp.asarray(2.0**12, jnp.float32),
        period=3,
        min_loss_scale=jnp.asarray(2.0**10, jnp.float32),
    )
    leaves, treedef = jax.tree_util.tree_flatten(jmp_scale)
    lost = jax.tree_util.tree_unflatten(treedef, leaves)
    assert float(lost.min_loss_scale) == 1.0  # jmp's default, not the 2**10 we set

    # Passed through jit as an argument, jmp backs off below its minimum...
    jmp_adjust = jax.jit(lambda ls: ls.adjust(jnp.asarray(False)))
    for _ in range(5):
        jmp_scale = jmp_adjust(jmp_scale)
    assert float(jmp_scale.loss_scale) == 2.0**7
    # ...ours keeps it, since the bound lives in the (static) scaler.
    ours = alj.DynamicLossScale(initial_scale=2.0**12, period=3, min_loss_scale=2.0**10)
    got = trajectory(ours, overflow_steps(5))
    assert got.loss_scale.tolist() == [2048, 1024, 1024, 1024, 1024]


BAD = {
    "factor=1": (dict(factor=1.0), ValueError, "factor"),
    "factor<1": (dict(factor=0.5), ValueError, "factor"),
    "factor-not-pow2": (dict(factor=3.0), ValueError, "factor"),
    "factor-bool": (dict(factor=True), TypeError, "factor"),
    "initial-zero": (dict(initial_scale=0.0), ValueError, "initial_scale"),
    "initial-negative": (dict(initial_scale=-4.0), ValueError, "initial_scale"),
    "initial-inf": (dict(initial_scale=math.inf), ValueError, "initial_scale"),
    "initial-nan": (dict(initial_scale=math.nan), ValueError, "initial_scale"),
    "initial-not-pow2": (dict(initial_scale=1000.0), ValueError, "initial_scale"),
    "initial-str": (dict(initial_scale="big"), TypeError, "initial_scale"),
    "initial-array": (dict(initial_scale=jnp.asarray(2.0)), TypeError, "initial_scale"),
    "min-zero": (dict(min_loss_scale=0.0), ValueError, "min_loss_scale"),
    "max-inf": (dict(max_loss_scale=math.inf), ValueError, "max_loss_scale"),
    "max-beyond-fp32": (dict(max_loss_scale=2.0**200), ValueError, "max_loss_scale"),
    "min>max": (
        dict(initial_scale=2.0**4, min_loss_scale=2.0**5, max_loss_scale=2.0**4),
        ValueError,
        "min_loss_scale",
    ),
    "initial-below-min": (dict(initial_scale=1.0, min_loss_scale=2.0), ValueError, "initial_scale"),
    "initial-above-max": (
        dict(initial_scale=2.0**15, max_loss_scale=2.0**10), ValueError, "initial_scale"
    ),
    "period-zero": (dict(period=0), ValueError, "period"),
    "period-float": (dict(period=10.0), TypeError, "period"),
    "period-bool": (dict(period=True), TypeError, "period"),
    "hysteresis-zero": (dict(hysteresis=0), ValueError, "hysteresis"),
    "hysteresis-bool": (dict(hysteresis=True), TypeError, "hysteresis"),
    "consecutive-int": (dict(consecutive_hysteresis=1), TypeError, "consecutive_hysteresis"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_dynamic_config_is_refused_at_construction(name):
    kwargs, exc, argname = BAD[name]
    for make in (alj.DynamicLossScale, alj.dynamic):
        with pytest.raises(exc, match=argname) as info:
            make(**kwargs)
        if name not in ("min>max",):
            # The message shows the offending value too.
            value = kwargs[argname]
            shown = repr(value) if not isinstance(value, jax.Array) else "Array"
            assert shown in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        (dict(loss_scale=3.0), ValueError),
        (dict(loss_scale=0.0), ValueError),
        (dict(loss_scale=math.nan), ValueError),
        (dict(loss_scale=False), TypeError),
    ],
    ids=["not-pow2", "zero", "nan", "bool"],
)
def test_bad_static_config_is_refused(kwargs, exc):
    with pytest.raises(exc, match="loss_scale"):
        alj.static(**kwargs)
    with pytest.raises(exc, match="loss_scale"):
        alj.StaticLossScale(**kwargs)


def test_bad_compute_dtype_names_the_argument():
    with pytest.raises(ValueError, match="compute_dtype"):
        alj.dynamic(compute_dtype="int8")
    with pytest.raises(TypeError, match="compute_dtype"):
        alj.static(compute_dtype=object())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "float32"], ids=["bf16", "fp32"])
def test_wide_dtypes_get_no_scaling_with_one_notice(dtype, monkeypatch):
    monkeypatch.setattr(_common, "_NOTICED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = alj.dynamic(compute_dtype=dtype)
        second = alj.dynamic(compute_dtype=dtype, period=10)
        third = alj.static(compute_dtype=dtype)
    assert isinstance(first, alj.NoLossScale)
    assert isinstance(second, alj.NoLossScale)
    assert isinstance(third, alj.NoLossScale)
    notices = [w for w in caught if "NoLossScale" in str(w.message)]
    assert len(notices) == 1, [str(w.message) for w in caught]
    assert float(first.init().loss_scale) == 1.0


def test_float16_scales_without_notice(monkeypatch):
    monkeypatch.setattr(_common, "_NOTICED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(alj.dynamic(compute_dtype=jnp.float16), alj.DynamicLossScale)
        assert isinstance(alj.static(compute_dtype="fp16"), alj.StaticLossScale)


def test_dynamic_takes_the_fields_of_its_scaler_and_names_an_unknown_one():
    """``dynamic()`` forwards its options to ``DynamicLossScale`` (one list of fields,
    one set of defaults), and a misspelt one is named with the valid ones."""
    assert alj.dynamic() == alj.DynamicLossScale()
    assert alj.dynamic(initial_scale=2.0**8, hysteresis=2) == alj.DynamicLossScale(
        initial_scale=2.0**8, hysteresis=2)
    with pytest.raises(TypeError, match=r"\['periods'\].*'period'"):
        alj.dynamic(periods=3)
