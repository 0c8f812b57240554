"""The statistics channel on hand-written values: a row's columns, their reduction over
passes, the scale point's conversion, and the decoding of rows into per-group
statistics."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaloss_jax import _channel
from adaloss_jax._layout import GroupVector

COLS = _channel.Columns(sumsq=True, hist_lo=-40)
FP16 = 65504.0


def _cfg(convert=False, x_max=FP16):
    return _channel.PointConfig(COLS, convert=convert, measure=True, y_max=FP16, x_max=x_max)


def test_a_row_holds_amax_flags_sums_and_a_histogram():
    ct = jnp.asarray([0.5, -3.0, 0.0, 2.0**-20], jnp.float32)
    row = np.asarray(_channel.measure((ct,), jnp.float32(1.0), _cfg()))
    assert row.shape == (COLS.width,)
    assert row[0] == 3.0 and row[1] == 0 and row[2] == 0
    np.testing.assert_allclose(row[3], 0.25 + 9.0 + 2.0**-40)
    assert row[4] == 4
    hist = row[COLS.hist_start:]
    assert hist.sum() == 3  # the non-zero elements, by binade
    assert hist[-20 - -40] == 1 and hist[-1 - -40] == 1 and hist[1 - -40] == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.5, -3.0, 2.0**-24, -65504.0, 65504.0, math.inf,
                                 -math.inf, 7.0, -0.0]), min_size=1, max_size=40),
       st.sampled_from([jnp.float16, jnp.float32]))
def test_both_magnitudes_agree_on_every_value(values, dtype):
    """The CPU's max(max, -min) and the other platforms' max(|ct|) give the same fp32
    magnitude on any cotangent, signed infinities and zeros included."""
    ct = jnp.asarray(values, dtype)
    assert _channel._max_and_min(ct).dtype == _channel._max_abs(ct).dtype == jnp.float32
    assert float(_channel._max_and_min(ct)) == float(_channel._max_abs(ct)) == max(
        abs(v) for v in values)


def test_a_gpu_lowering_measures_each_cotangent_in_one_reduction():
    """Lowered for CUDA, the magnitude of two cotangents is two reductions with ``abs``
    (the CPU's lowering keeps its max and min: four)."""
    cts = (jax.ShapeDtypeStruct((64, 32), jnp.float16),
           jax.ShapeDtypeStruct((8,), jnp.float16))
    for platform, reductions in (("cuda", 2), ("cpu", 4)):
        text = jax.export.export(jax.jit(lambda *c: _channel.magnitude(c)),
                                 platforms=[platform])(*cts).mlir_module()
        assert text.count("stablehlo.reduce") == reductions, platform
    compiled = jax.jit(lambda *c: _channel.magnitude(c)).lower(*cts).compile().as_text()
    assert compiled.count(" reduce(") == 4 and "conditional" not in compiled


def test_overflow_flags_cover_the_value_and_its_conversion():
    ct = jnp.asarray([60000.0], jnp.float32)
    row = _channel.measure((ct,), jnp.float32(2.0), _cfg(convert=True))
    assert float(row[1]) == 0 and float(row[2]) == 1  # fits, its conversion does not
    row = _channel.measure((jnp.asarray([jnp.inf]),), jnp.float32(1.0), _cfg())
    assert float(row[0]) == np.inf and float(row[1]) == 1


def test_rows_of_several_passes_reduce_to_the_row_of_all_of_them():
    """max for the maxima and flags, sum for the sums: the row of the concatenated
    cotangent, whatever the split into passes."""
    rng = np.random.default_rng(0)
    parts = [jnp.asarray(rng.normal(size=7) * 2.0 ** rng.integers(-8, 8), jnp.float32)
             for _ in range(5)]
    stacked = jnp.stack([_channel.measure((p,), jnp.float32(1.0), _cfg()) for p in parts])
    whole = _channel.measure((jnp.concatenate(parts),), jnp.float32(1.0), _cfg())
    np.testing.assert_allclose(_channel.reduce_rows(stacked, (0,)), whole, rtol=1e-6)
    assert np.array_equal(_channel.reduce_rows(whole, ()), whole)


def test_the_scale_point_converts_exactly_and_hands_its_row_out():
    x = jnp.asarray([1.0, -2.0], jnp.float16)

    def f(x, dummy):
        (y,) = _channel.scale_point(_cfg(convert=True), (x,), jnp.float32(0.25), dummy)
        return jnp.sum(y.astype(jnp.float32) * jnp.asarray([3.0, 5.0]))

    gx, row = jax.grad(f, argnums=(0, 1))(x, jnp.zeros((COLS.width,), jnp.float32))
    np.testing.assert_array_equal(gx, jnp.asarray([0.75, 1.25], jnp.float16))
    assert float(row[0]) == 5.0  # measured before the conversion, where it arrived


def test_decode_attributes_rows_to_the_groups_of_both_sides():
    """Row 0 arrived in a's region and goes to the root's: it counts for both, shifted to
    each one's scale; row 1 (inside b, overflowing) blames b alone."""
    cols = _channel.Columns(sumsq=False, hist_lo=None)
    rows = [_channel.Row(y=("a",), x=("",), y_max=FP16, x_max=FP16),
            _channel.Row(y=("b",), x=("b",), y_max=FP16, x_max=FP16)]
    values = [jnp.asarray([8.0, 0.0, 0.0]), jnp.asarray([jnp.inf, 1.0, 1.0])]
    used = GroupVector(("", "a", "b"), jnp.asarray([2.0, 5.0, 0.0]), split=True)
    stats = _channel.decode(rows, values, used, cols, FP16)
    assert float(stats.amax["a"]) == 8.0
    assert float(stats.amax[""]) == 8.0 * 2.0 ** (2 - 5)  # at the root's scale
    assert float(stats.amax["b"]) == np.inf
    assert [bool(stats.bad[g]) for g in ("", "a", "b")] == [False, False, True]
    assert bool(stats.nonfinite)
    assert float(stats.log2_scales["a"]) == 5.0


@pytest.mark.parametrize("sumsq", [False, True])
def test_decode_reads_the_loss_seed_at_the_roots_planned_scale(sumsq):
    """A cast's row measured at the loss's seed (the root's planned scale, 2) and
    converted into the root's region, which chose 12 in the same pass: it counts once
    for the root, shifted from 2 to 12 and relative to the float16 it narrows to; too
    large where it goes, it blames the root."""
    from adaloss_jax._tree import SEED

    cols = _channel.Columns(sumsq=sumsq, hist_lo=None)
    f32 = float(np.finfo(np.float32).max)
    rows = [_channel.Row(y=(SEED,), x=("",), y_max=f32, x_max=FP16, wide=True)]
    used = GroupVector(("", "a"), jnp.asarray([12.0, 5.0]), split=True)
    planned = GroupVector(("", "a"), jnp.asarray([2.0, 5.0]), split=True)
    values = [jnp.asarray([8.0, 0.0, 0.0] + ([64.0, 4.0] if sumsq else []))]
    stats = _channel.decode(rows, values, used, cols, FP16, planned=planned)
    assert float(stats.amax[""]) == 8.0 * 2.0**10
    assert float(stats.amax["a"]) == 0.0
    assert not bool(stats.bad[""])
    if sumsq:
        assert float(stats.sumsq[""]) == 64.0 * 2.0**20
        assert float(stats.count[""]) == 4.0  # once, though both sides are the root's
    values = [jnp.asarray([8.0, 0.0, 1.0] + ([64.0, 4.0] if sumsq else []))]
    stats = _channel.decode(rows, values, used, cols, FP16, planned=planned)
    assert bool(stats.bad[""]) and not bool(stats.bad["a"])


def test_decode_reads_a_live_fan_in_at_its_plan_plus_what_it_moved():
    """A fan-in of a and b (planned 5 and 9: its plan is 5) chose 11 in the pass, moved
    6: a row measured there (amax 8 at 11) counts for a at a's scale, 8 * 2^(7 - 11),
    and for b at b's, 8 * 2^(9 - 11); a row leaving it for c (at c's 3) flushes where it
    arrives only where the fan-in's own scale says so. Without ``moved`` the same rows
    read at the plan, 5."""
    cols = _channel.Columns(sumsq=False, hist_lo=None)
    fan = ("a", "b")
    rows = [_channel.Row(y=fan, x=fan, y_max=FP16, x_max=FP16),
            _channel.Row(y=("c",), x=fan, y_max=FP16, x_max=FP16)]
    values = [jnp.asarray([8.0, 0.0, 0.0]), jnp.asarray([2.0**-10, 0.0, 0.0])]
    used = GroupVector(("a", "b", "c"), jnp.asarray([7.0, 9.0, 3.0]), split=True)
    planned = GroupVector(("a", "b", "c"), jnp.asarray([5.0, 9.0, 3.0]), split=True)
    stats = _channel.decode(rows, values, used, cols, FP16, planned=planned,
                            fmt_min=2.0**-24, moved={fan: jnp.float32(6.0)})
    assert float(stats.amax["a"]) == 8.0 * 2.0 ** (7 - 11)
    assert float(stats.amax["b"]) == 8.0 * 2.0 ** (9 - 11)
    assert not bool(stats.flushed)  # 2^-10 at 3 is 2^-2 at 11: stored
    plan = _channel.decode(rows, values, used, cols, FP16, planned=planned, fmt_min=2.0**-24)
    assert float(plan.amax["a"]) == 8.0 * 2.0 ** (7 - 5)
    moved_down = _channel.decode(rows, values, used, cols, FP16, planned=planned,
                                 fmt_min=2.0**-24, moved={fan: jnp.float32(-18.0)})
    assert bool(moved_down.flushed)  # 2^-10 at 3 is 2^-26 at -13: below half the min
    assert bool(moved_down.starved["a"]) and bool(moved_down.starved["b"])


@pytest.mark.parametrize("sumsq,hist", [(False, False), (True, False), (True, True)])
def test_columns(sumsq, hist):
    cols = _channel.Columns(sumsq=sumsq, hist_lo=-30 if hist else None)
    assert cols.width == 3 + 2 * sumsq + _channel.NBINS * hist


def test_decode_marks_groups_starved_by_a_flushed_or_zero_cotangent():
    """Row 0 leaves a's scale (0) for the root's (-3) stored in fp16: 2**-23 becomes
    2**-26, below half of fp16's smallest value, so it flushed and the root, which
    computes from it, is starved; row 1 arrived in b as zeros (b is starved, nothing
    flushed); row 2 fits. Without the format's smallest value nothing is judged."""
    cols = _channel.Columns(sumsq=False, hist_lo=None)
    rows = [_channel.Row(y=("a",), x=("",), y_max=FP16, x_max=FP16),
            _channel.Row(y=("b",), x=("b",), y_max=FP16, x_max=FP16),
            _channel.Row(y=("c",), x=("c",), y_max=FP16, x_max=FP16)]
    values = [jnp.asarray([2.0**-23, 0.0, 0.0]), jnp.zeros(3), jnp.asarray([1.0, 0.0, 0.0])]
    groups = ("", "a", "b", "c")
    used = GroupVector(groups, jnp.asarray([-3.0, 0.0, 0.0, 0.0]), split=True)
    stats = _channel.decode(rows, values, used, cols, FP16, fmt_min=2.0**-24)
    assert [bool(stats.starved[g]) for g in groups] == [True, False, True, False]
    assert bool(stats.flushed)
    # At the root's scale -1 the same value is stored as 2**-24: kept.
    used = GroupVector(groups, jnp.asarray([-1.0, 0.0, 0.0, 0.0]), split=True)
    stats = _channel.decode(rows, values, used, cols, FP16, fmt_min=2.0**-24)
    assert [bool(stats.starved[g]) for g in groups] == [False, False, True, False]
    assert not bool(stats.flushed)
    assert _channel.decode(rows, values, used, cols, FP16).starved is None


def test_a_cond_branch_not_taken_starves_nothing():
    """Rows in a ``cond``'s branches (cond 7: one row per branch; cond 9: one branch's
    row): a branch's backward pass runs only where it was taken, so a row of zeros
    there starves its group only when no row of its cond measured anything (the taken
    branch received zeros); a row of zeros outside any cond always does."""
    cols = _channel.Columns(sumsq=False, hist_lo=None)
    row = lambda g, branch: _channel.Row(y=(g,), x=(g,), y_max=FP16, x_max=FP16,  # noqa: E731
                                         branch=branch)
    rows = [row("a", 7), row("b", 7), row("c", 9), row("d", None)]
    groups = ("", "a", "b", "c", "d")
    used = GroupVector(groups, jnp.zeros(5), split=True)
    one = jnp.asarray([1.0, 0.0, 0.0])
    for values, want in [([one, jnp.zeros(3), one, one], [False] * 5),
                         ([jnp.zeros(3), one, jnp.zeros(3), one], [False, False, False,
                                                                   True, False]),
                         ([jnp.zeros(3)] * 4, [False, True, True, True, True])]:
        stats = _channel.decode(rows, values, used, cols, FP16, fmt_min=2.0**-24)
        assert [bool(stats.starved[g]) for g in groups] == want


@pytest.mark.parametrize("shapes,bits", [([(5, 3)], 3), ([(4, 8, 3), (2, 7)], 5),
                                         ([(7,), ()], 0), ([(1, 4)], 0)])
def test_a_first_choice_reserves_the_binades_of_a_sum_over_the_leading_axes(shapes, bits):
    """``ceil(log2 n)``, ``n`` the most elements per entry of the last axis (4 x 8 = 32
    rows: 5 binades); vectors and scalars sum nothing."""
    assert _channel.first_reserve(tuple(jnp.zeros(s) for s in shapes)) == bits


@pytest.mark.parametrize("reserve", [0.0, 2.0, 5.0, 100.0])
def test_a_first_choice_keeps_room_for_the_sum_over_64_rows_at_most_reserve(reserve):
    """amax 2**-10 aims at 2**11: scale 21; before the group has a prior, less
    ``min(log2 64, reserve)``; with one, none (the prior holds what was measured)."""
    cfg = _channel.LiveConfig(_cfg(), x_token=None, y_token=None, emits=0, decides=True,
                              target=11.0, reserve=reserve)
    cts = (jnp.zeros((8, 8, 4)),)
    amax = jnp.float32(2.0**-10)
    first, delta = _channel.decide(amax, cts, 0.0, jnp.asarray([0.0, np.inf, 3.0]), cfg)
    assert float(first) == 21 - min(6, reserve) and float(delta) == float(first) - 3
    known, _ = _channel.decide(amax, cts, 0.0, jnp.asarray([0.0, 100.0, 3.0]), cfg)
    assert float(known) == 21


@st.composite
def _zero_row_graphs(draw):
    """Rows between ``ns`` anchor sets (cycles and repeated pairs allowed): each row's
    sets, its amax (zero or not), whether it flushed and whether it is a cast's wide
    side."""
    ns = draw(st.integers(1, 12))
    n = draw(st.integers(1, 3 * ns))
    idx = st.integers(0, ns - 1)
    fmts = st.sampled_from([FP16, 448.0, 57344.0])  # a row's sides stored in fp16 or fp8
    return (ns, draw(st.lists(idx, min_size=n, max_size=n)),
            draw(st.lists(idx, min_size=n, max_size=n)),
            draw(st.lists(st.tuples(fmts, fmts), min_size=n, max_size=n)),
            draw(st.lists(st.sampled_from([0.0, 0.0, 2.0**-30, 0.5, 7.0]), min_size=n,
                          max_size=n)),
            draw(st.lists(st.booleans(), min_size=n, max_size=n)),
            draw(st.lists(st.booleans(), min_size=n, max_size=n)),
            draw(st.lists(st.integers(-8, 8), min_size=ns, max_size=ns)))


def _lost_amax_by_hand(ns, xs, ys, maxes, amax, gone, wide, sigma):
    """The fixed point, one row at a time until nothing changes (plain Python); a value
    in units of the format (fp16's max over the narrower side's max)."""
    now = [-math.inf] * ns
    for x, y, (y_max, x_max), a, g, w in zip(xs, ys, maxes, amax, gone, wide):
        if (g or w) and a > 0:
            now[x] = max(now[x], math.log2(a * FP16 / min(y_max, x_max)) - sigma[y])
    changed = True
    while changed:
        changed = False
        for x, y, a in zip(xs, ys, amax):
            if a == 0 and now[y] > now[x]:
                now[x], changed = now[y], True
    return now


# Cheap examples (plain ops, no model): five times the profile's draws (20 fast, 60 CI).
@settings(max_examples=5 * settings.default.max_examples, deadline=None)
@given(_zero_row_graphs())
def test_what_was_lost_reaches_every_set_along_rows_of_zeros_on_any_graph(graph):
    """On random graphs of rows (chains, cycles, several rows into a set), the lost
    amax of every set is the by-hand fixed point, both by matrix squaring (the sets a
    model has, up to _DENSE_SETS) and by the loop beyond it."""
    ns, xs, ys, maxes, amax, gone, wide, sigma = graph
    rows = [_channel.Row(y=(str(y),), x=(str(x),), y_max=y_max, x_max=x_max, wide=w)
            for x, y, (y_max, x_max), w in zip(xs, ys, maxes, wide)]
    args = (rows, jnp.asarray(amax, jnp.float32), jnp.asarray(gone),
            jnp.asarray([float(sigma[y]) for y in ys], jnp.float32), xs, ys, ns, FP16)
    want = _lost_amax_by_hand(ns, xs, ys, maxes, amax, gone, wide, sigma)
    dense = _channel._lost_amax(*args)
    limit = _channel._DENSE_SETS
    try:
        _channel._DENSE_SETS = 0
        looped = _channel._lost_amax(*args)
    finally:
        _channel._DENSE_SETS = limit
    np.testing.assert_allclose(np.asarray(dense), want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(looped), want, atol=1e-4)


def test_a_chain_of_zeros_as_long_as_the_sets_carries_what_was_lost_to_its_end():
    """The longest chain there can be (ns - 1 rows of zeros through every set, rows
    listed backwards): the last set receives the first one's loss, by squaring and by
    the loop, and the squaring has no ``while`` in its program."""
    ns = 9
    xs, ys = [0] + list(range(ns - 1, 0, -1)), [0] + list(range(ns - 2, -1, -1))
    rows = [_channel.Row(y=(str(y),), x=(str(x),), y_max=FP16, x_max=FP16, wide=i == 0)
            for i, (x, y) in enumerate(zip(xs, ys))]
    amax = jnp.asarray([2.0**-30] + [0.0] * (ns - 1), jnp.float32)
    args = (rows, amax, jnp.zeros(ns, bool), jnp.zeros(ns, jnp.float32), xs, ys, ns, FP16)
    got = jax.jit(lambda *a: _channel._lost_amax(rows, *a, xs, ys, ns, FP16))
    assert list(np.asarray(got(*args[1:4]))) == pytest.approx([-30.0] * ns, abs=1e-4)
    assert "while" not in got.lower(*args[1:4]).as_text()
    # as many sets as squaring takes: still no loop
    big = _channel._DENSE_SETS
    chain = [_channel.Row(y=(str(i),), x=(str(i + 1),), y_max=FP16, x_max=FP16)
             for i in range(big - 1)]
    text = jax.jit(lambda a: _channel._lost_amax(
        chain, a, jnp.zeros(big - 1, bool), jnp.zeros(big - 1), list(range(1, big)),
        list(range(big - 1)), big, FP16)).lower(jnp.zeros(big - 1)).as_text()
    assert "while" not in text
    limit = _channel._DENSE_SETS
    try:
        _channel._DENSE_SETS = 0
        assert list(np.asarray(_channel._lost_amax(*args))) == pytest.approx([-30.0] * ns,
                                                                     abs=1e-4)
    finally:
        _channel._DENSE_SETS = limit


def test_decode_carries_what_was_measured_before_it_was_lost_along_rows_of_zeros():
    """The root measured 2**-30 on the wide (float32) side of a cast (row 0) and the cast
    flushed it: a received zeros from the root (row 1) and b zeros from a (row 2), so
    both lost what the root measured: their lost_amax is its log2 (-30 at the root's
    scale 0, in fp16's units). c flushed 2**-25 arriving from d at -2 (row 3: stored at
    c's -3 as 2**-26): its own lost value, -23 at unit scale. d lost nothing.
    Rows in another order give the same answer (a fixed point, not one pass)."""
    cols = _channel.Columns(sumsq=False, hist_lo=None)
    rows = [_channel.Row(y=("",), x=("",), y_max=FP16, x_max=FP16, wide=True),
            _channel.Row(y=("",), x=("a",), y_max=FP16, x_max=FP16),
            _channel.Row(y=("a",), x=("b",), y_max=FP16, x_max=FP16),
            _channel.Row(y=("d",), x=("c",), y_max=FP16, x_max=FP16)]
    values = [jnp.asarray([2.0**-30, 0.0, 0.0]), jnp.zeros(3), jnp.zeros(3),
              jnp.asarray([2.0**-25, 0.0, 0.0])]
    groups = ("", "a", "b", "c", "d")
    used = GroupVector(groups, jnp.asarray([0.0, 4.0, 8.0, -3.0, -2.0]), split=True)
    want = [-30.0, -30.0, -30.0, -23.0, -math.inf]
    stats = _channel.decode(rows, values, used, cols, FP16, fmt_min=2.0**-24)
    assert [float(stats.lost_amax[g]) for g in groups] == pytest.approx(want, abs=1e-4)
    order = [2, 3, 1, 0]
    stats = _channel.decode([rows[i] for i in order], [values[i] for i in order], used,
                            cols, FP16, fmt_min=2.0**-24)
    assert [float(stats.lost_amax[g]) for g in groups] == pytest.approx(want, abs=1e-4)
    assert _channel.decode(rows, values, used, cols, FP16).lost_amax is None
