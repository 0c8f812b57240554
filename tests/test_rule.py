"""The adaptive scale rule (``adaloss_jax._rule.adjust``) on hand-written statistics: each
line of its pseudo-code, with no model and no backward pass."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import adaloss_jax as alj
from adaloss_jax import _rule
from adaloss_jax._state import HEALTH_NOTHING_MEASURED, HEALTH_PINNED_LOW, HEALTH_SKIPPING

LOG2_MAX = math.log2(65504.0)
GROUPS = ("", "a", "b")


def _state(scales=(10, 10, 10), **options):
    scaler = alj.adaptive(groups="module", **options)
    params = {k: {"w": jnp.zeros(3)} for k in GROUPS if k}
    state = alj.adaptive_unscale(scaler).init(params)
    assert state.groups == GROUPS
    return state.with_log2_scales(dict(zip(GROUPS, scales)))


def _measured(state, unit, bad=(False,) * 3, active=(True,) * 3, param_nonfinite=None,
              loss_finite=True, **extra):
    """``unit``: log2 of each group's amax at unit scale (None: nothing measured, inf:
    not finite), measured at the state's scales."""
    used = np.asarray(state.log2_scales.array)
    amax = np.array([0.0 if u is None else (np.inf if u == np.inf else 2.0 ** (u + s))
                     for u, s in zip(unit, used)], np.float32)
    pnf = np.zeros(3, bool) if param_nonfinite is None else np.asarray(param_nonfinite)
    finite = bool(np.all(np.isfinite(amax)))
    return _rule.Measured(active=jnp.asarray(active), used=jnp.asarray(used),
                          amax=jnp.asarray(amax), bad=jnp.asarray(bad),
                          param_nonfinite=jnp.asarray(pnf), grads_finite=jnp.asarray(finite),
                          loss_finite=jnp.asarray(loss_finite), **extra)


adjust = jax.jit(_rule.adjust)


def _scales(state):
    return [float(v) for v in state.log2_scales.array]


def test_amax_rule_puts_each_group_margin_below_the_max_and_not_below_global():
    state = _state(max_rise=100, decay=math.inf)
    new = adjust(state, _measured(state, [-20.0, -12.0, -30.0]))
    target = [math.floor(LOG2_MAX - 4 - u) for u in (-20.0, -12.0, -30.0)]
    floor = math.floor(LOG2_MAX - 4 + 12.0)  # the largest unit amax sets the global scale
    assert _scales(new) == [max(t, floor) for t in target]
    assert bool(new.last_applied)


def test_held_peak_sinks_by_decay():
    state = _state(max_rise=100, decay=0.5)
    state = adjust(state, _measured(state, [-20.0, -12.0, -12.0]))
    new = adjust(state, _measured(state, [-10.0, -16.0, -16.0]))
    # Held: max(-16, -12 - 0.5) = -12.5 for a and b; above the global floor (the root's -10).
    assert _scales(new)[1] == math.floor(LOG2_MAX - 4 + 12.5)
    assert float(new.log2_amax["a"]) == -12.5


def test_nothing_measured_jumps_blind_and_a_step_without_measurement_is_skipped():
    state = _state(scales=(0, 0, 0), max_rise=100)
    new = adjust(state, _measured(state, [None, None, None]))
    jump = math.floor(LOG2_MAX - 4 + 24 - 1)
    assert _scales(new) == [jump] * 3
    assert not bool(new.last_applied)


def test_an_overflow_backs_off_where_it_started_and_others_hold():
    state = _state(max_rise=100, factor=8.0)
    m = _measured(state, [-20.0, np.inf, np.inf], bad=(False, True, False))
    new = adjust(state, m)
    # a backs off by log2(8); b only received non-finite values and holds; the root was
    # measured (finite) and moves to its target.
    assert _scales(new) == [math.floor(LOG2_MAX - 4 + 20.0), 7.0, 10.0]
    assert not bool(new.last_applied) and bool(new.overflowed["a"])
    again = adjust(new, _measured(new, [-20.0, np.inf, np.inf], bad=(False, True, False)))
    assert _scales(again)[1] == 7.0 - 3 * 2  # consecutive: factor ** (2 ** n)


def test_nonfinite_parameter_gradients_nobody_explains_blame_their_group():
    state = _state(max_rise=100)
    m = _measured(state, [-20.0, -12.0, np.inf], param_nonfinite=(False, False, True))
    new = adjust(state, m)
    assert _scales(new)[2] == 10.0 - 4 and bool(new.overflowed["b"])


def test_max_consecutive_skips_backs_every_nonfinite_group_off_and_flags_health():
    state = _state(max_rise=100, max_consecutive_skips=2, factor=2.0)
    for _ in range(3):
        state = adjust(state, _measured(state, [-20.0, np.inf, np.inf], bad=(False, True, False)))
    assert _scales(state)[2] < 10.0  # b received only, but backs off after K skips
    assert int(state.health) & HEALTH_SKIPPING


def test_a_forward_overflow_moves_no_scale():
    state = _state(max_rise=100)
    new = adjust(state, _measured(state, [-20.0, -12.0, -12.0], loss_finite=False))
    assert _scales(new) == _scales(state) and not bool(new.last_applied)
    assert int(new.total_nonfinite_loss) == 1


def test_inactive_groups_keep_everything():
    state = _state(max_rise=100)
    new = adjust(state, _measured(state, [-20.0, -12.0, None], active=(True, True, False)))
    assert _scales(new)[2] == 10.0 and float(new.log2_amax["b"]) == -np.inf


def test_period_holds_measured_scales_between_recomputations():
    state = _state(max_rise=100, period=2, decay=math.inf)
    state = state.replace(base=state.base._replace(total_applied=jnp.int32(1)))
    new = adjust(state, _measured(state, [-20.0, -12.0, -12.0]))
    assert _scales(new) == _scales(state)


@pytest.mark.parametrize("rise", [4, 8, 9, 20])
def test_a_step_far_below_its_scale_is_skipped_and_the_scales_move(rise):
    """The new scales are computed either way; the step is applied only when no group
    rises by more than ``max_rise`` binades over the scale it was computed at."""
    state = _state(max_rise=8, decay=math.inf)
    unit = [-20.0, -20.0, -20.0]
    settled = math.floor(LOG2_MAX - 4 + 20.0)
    state = state.with_log2_scales(dict.fromkeys(GROUPS, settled - rise))
    new = adjust(state, _measured(state, unit))
    assert _scales(new) == [settled] * 3
    assert bool(new.last_applied) == (rise <= 8)
    assert int(new.notfinite_count) == (0 if rise <= 8 else 1)


def test_pinned_scales_are_flagged():
    state = _state(scales=(-24, -24, -24), max_rise=100)
    new = adjust(state, _measured(state, [-20.0, np.inf, -12.0], bad=(False, True, False)))
    assert int(new.health) & HEALTH_PINNED_LOW
    hi = _state(scales=(64, 64, 64), max_rise=100)
    new = adjust(hi, _measured(hi, [None, None, None]))
    assert int(new.health) & HEALTH_NOTHING_MEASURED


def test_gaussian_rule_takes_the_smaller_scale():
    state = _state(statistic="gaussian", max_rise=100, decay=math.inf)
    used = np.asarray(state.log2_scales.array)
    sigma = 2.0 ** (-14.0 + used)  # std at the used scale: unit std 2^-14
    n = np.full(3, 1000.0, np.float32)
    m = _measured(state, [-6.0, -6.0, -6.0], sumsq=jnp.asarray(sigma**2 * n, jnp.float32),
                  count=jnp.asarray(n))
    new = adjust(state, m)
    t = 1e-3
    erfinv = math.sqrt(math.pi) / 2 * (t + math.pi * t**3 / 12)
    gauss = max(0, math.ceil(-24 - math.log2(math.sqrt(2) * erfinv) + 14))
    assert _scales(new) == [min(math.floor(LOG2_MAX - 4 + 6), gauss)] * 3


def test_a_group_that_measured_nothing_does_not_stop_the_step():
    """A group whose gradients are exactly zero (an attention key bias, a module the loss
    does not reach this step) measures nothing: it jumps, and the step still applies."""
    state = _state(max_rise=100)
    new = adjust(state, _measured(state, [-12.0, -12.0, None]))
    assert bool(new.last_applied)
    assert _scales(new)[2] > 10.0  # the blind jump
