"""The adaptive scale rule: a pure function from a state and one step's statistics to the
next state, branch-free and jit-able (jmp's ``adjust``, for many groups)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import erfinv

from adaloss_jax import _channel, _common, _formats
from adaloss_jax._layout import GroupVector
from adaloss_jax._state import (
    AdaptiveScaleState,
    Health,
)

HEADROOM_RETURN = 1.0 / 256  # binades of learned headroom given back per applied step


class Measured(NamedTuple):
    """One step's statistics per group, as vectors in the state's group order (global:
    already reduced over devices).

    Attributes:
      active: bool, the groups the program used (the others keep their state).
      used: log2 of the scale each group's gradients were computed at.
      amax: largest magnitude measured for the group (cotangents and parameter
        gradients) at the scale it was computed at; 0: nothing measured; inf: a value
        was not finite.
      bad: bool, an overflow started at the group's scale (its cotangent statistics).
      param_nonfinite: bool, the group's parameter gradients were not all finite.
      grads_finite: bool scalar, every gradient and measured value was finite.
      loss_finite: bool scalar.
      sumsq, count: sum of squares and element count (``statistic="gaussian"``).
      hist: ``(groups, NBINS)`` binade histogram (``statistic="quantile"``).
      flushed: bool scalar, a cotangent arrived non-zero and flushed entirely where
        it is stored.
      starved: bool, per group: a cotangent on its way into it arrived zero, or
        non-zero and flushed entirely where it is stored.
      lost_amax: per group, log2 of the largest value at unit scale measured before it
        was lost on its way into the group (-inf: none).
      own: bool, per group: it measured something of its own (a row not converted at a
        live fan-in's choice and not held in float32's range, or its parameter
        gradients).
    """

    active: jax.Array
    used: jax.Array
    amax: jax.Array
    bad: jax.Array
    param_nonfinite: jax.Array
    grads_finite: jax.Array
    loss_finite: jax.Array
    sumsq: jax.Array | None = None
    count: jax.Array | None = None
    hist: jax.Array | None = None
    flushed: jax.Array | None = None
    starved: jax.Array | None = None
    lost_amax: jax.Array | None = None
    own: jax.Array | None = None


def adjust(state: AdaptiveScaleState, m: Measured) -> AdaptiveScaleState:
    """The next state, for the groups the step used (``s_k``: a group's log2 scale, ``u``:
    its value this step, ``A_k = amax_k / S_k``: its amax at unit scale, ``h_k``: the
    headroom it learned from its own overflows)::

        held_k  = max(log2 A_k, held_k(previous) - decay)      # held peak; decay=inf: A_k
                  (kept as it was where k was starved: its statistics miss what was
                  lost, and a same-step choice is bounded by the rule's scale only once
                  the group was measured: :func:`adaloss_jax._grad._limits`)
        T_k     = floor(log2 u_max - margin - held_k)           # "amax"
        T_k     = max(T_k, floor(log2 u_max - margin - max_j log2 A_j))   # finite steps,
                  several groups: never below the one global scale (no more flushing)
        s_k     = T_k - ceil(h_k)
        s_k     = min(s_k, max(0, ceil(log2(u_min / (sqrt(2) erfinv(T) sigma_k)))))
                  # "gaussian"
        s_k     = min(s_k, min{q : #{|x| 2**q < 2 u_min} <= T * n_k})   # "quantile": the
                  n_k non-zero values of the histogram (no answer if its tail is cut off)
        s_k     = min(s_k, max(u_k + blind_jump, ceil(log2 n_min - log2 L_k)))
                  if k was starved: a cotangent on its way into k flushed entirely or
                  arrived zero (what was lost below u_min / 2, and all computed from it,
                  is missing from its statistics: the jump that cannot overflow it),
                  but never so low that a value measured before it was lost would
                  flush again: L_k = max(A_k, the largest such value upstream
                  (lost_amax): measured on the wide side of a cast, or where it
                  flushed) lands at n_min, the smallest normal, the range above left
                  for the growth nobody measured
        s_k     = s_k(previous)  unless total_applied % period == 0
        s_k     = s_k(previous) + blind_jump - ceil(h_k)   if nothing was measured
                  (starved: at most max(s_k(previous) + blind_jump, ceil(log2 n_min -
                  log2 L_k)) - ceil(h_k))
                  (at least the global floor if h_k == 0 and k was not starved: a
                  cotangent that arrived as zeros says nothing of what k would hold)
                  (all of it flushed: blind_jump = floor(log2 u_max - margin - log2
                  u_min - 1) cannot overflow what was below u_min / 2; held_k is
                  lowered to log2 u_min - 1 - u_k, and below a ceiling c_k the jump
                  goes halfway to it)

        where an overflow started at k's scale u_k (k is blamed):
        c_k     = min(c_k, u_k)             # its ceiling: the lowest scale that overflowed
                  (dropped if k later measures nothing at c_k - 1 or above); until k's
                  next finite statistics its scale only falls, or jumps blind halfway
                  to c_k
        s_k     = u_k - log2(factor)        (k had a held peak)
        s_k     = u_k - log2(factor) * 2**n (no peak yet: n steps in a row before this
                  one k was blamed at, at most 4; a step that held k, below, neither
                  counts nor ends the run)
        s_k     = u_k - log2(factor)   for every other group that received only
                  non-finite values (the overflow hid its statistics: all of them back
                  off at once, not one group a step; x 2**n as above where it has no
                  peak yet and was blamed at the step before); after max_consecutive_skips
                  non-finite steps in a row with no group blamed, every group is blamed
        s_k     = s_k(previous)   if the loss was not finite (a forward overflow: no
                  scale can fix it; held_k, c_k, h_k and k's run of blame are kept
                  too: the statistics of a step that is thrown away, e.g. an
                  outlier batch, are no evidence of the gradients to come), or
                  k received non-finite values nobody overflowed at (its run kept), or
                  the step did not use k

        at k's next finite measurement below its ceiling (the growth inside the module
        that its boundary statistics miss is learned against statistics of the same
        regime, never against a peak measured before the overflow):
        h_k     = max(h_k, floor(log2 u_max - margin - log2 A_k) - c_k + d);  c_k = inf
                  # d = max(1, log2(factor) // 2): these statistics never ask for c_k
                  again, but for halfway between it and the scale k backed off to;
                  where they ask for at most c_k - d by themselves, they explain the
                  overflow: nothing is learned and c_k stays (it caps blind jumps)
        h_k     = max(h_k - 1/256, 0)   on an applied step, for each measured group
                  (a learned binade is given back after 256 applied steps)
        s_k     = clip(s_k, log2 min_loss_scale, log2 max_loss_scale)

        applied = grads finite and loss finite and something was measured
                  and no group's new s_k exceeds its used scale by more than max_rise
                  (the step was computed far below the scale its statistics call for;
                  a group that measured only rows a live fan-in converted at its own
                  choice, or rows held in float32's range, lost nothing at its scale:
                  not checked)

    So the rule does not cycle: a scale that overflowed is not asked for again on the
    same statistics (for 256 applied steps per learned binade), and one overflow backs
    off every group it hid.

    Skipped steps count in ``base`` as the global scalers' do. A step refused as
    underscaled (or with nothing measured) was finite: it is skipped, and it ends the
    run of non-finite steps (``notfinite_count``) that the escalation reads and each
    group's run of blamed steps (``overflowed``) that the harder back-off reads, so a
    refusal after a wrong guess is not paid for as another overflow. ``health`` flags a
    run that cannot recover (see :class:`~adaloss_jax.AdaptiveScaleState`).
    """
    cfg = state.scaler
    fmt = cfg.format
    log2_max = math.log2(fmt.max)
    lo, hi = math.log2(cfg.min_loss_scale), math.log2(cfg.max_loss_scale)
    log2 = state.log2_scales.array
    prev_amax = state.log2_amax.array
    base = state.base
    act, used, amax = m.active, m.used, m.amax
    ng = log2.shape[0]

    # The scale one global group would get: no group goes below it on a finite step.
    unit = jnp.where(act, jnp.log2(amax) - used, -jnp.inf)  # -inf: nothing measured
    unit_max = jnp.max(unit, initial=-jnp.inf)
    recompute = base.total_applied % cfg.period == 0
    use_floor = m.grads_finite & (unit_max > -jnp.inf) & (ng > 1)
    if cfg.period > 1:
        use_floor = use_floor & recompute
    floor = jnp.where(use_floor, jnp.floor(log2_max - cfg.margin - unit_max), -jnp.inf)

    held = unit if cfg.decay == math.inf else jnp.maximum(unit, prev_amax - cfg.decay)
    stat_t = jnp.maximum(jnp.floor(log2_max - cfg.margin - held), floor)
    # Non-finite parameter gradients that no cotangent statistic explains blame their
    # own groups.
    blamed = m.bad | (m.param_nonfinite & ~jnp.any(act & m.bad))
    # Non-finite steps in a row that no group is blamed for: every group is (a group
    # an overflow hid already backs off with it, and blaming it too would multiply
    # its next drop).
    escalate = (base.notfinite_count >= cfg.max_consecutive_skips) & ~jnp.any(act & blamed)
    bad = act & (blamed | (escalate & ~m.grads_finite))
    # A group that only received non-finite values was hidden by an overflow elsewhere:
    # it backs off with it (its statistics are lost), or holds when nothing overflowed.
    hidden = act & ~bad & ~(amax < jnp.inf)
    backs_off = hidden & jnp.any(bad)
    hold = ~act | (hidden & ~backs_off)
    # Headroom: growth inside a module that its boundary statistics miss, learned from
    # the scale it overflowed at (its ceiling) against its next finite statistics.
    # (An escalation's blame is no evidence of where overflow starts: no ceiling. A
    # ceiling that nothing measured can be raised to is dropped: the statistics moved.)
    ceiling = state.ceiling.array
    ceiling = jnp.where(act & (amax == 0) & (ceiling <= used + 1), jnp.inf, ceiling)
    ceiling = jnp.where(act & blamed, jnp.minimum(ceiling, used), ceiling)
    finite = act & ~bad & (amax > 0) & (amax < jnp.inf)
    seen = finite & (ceiling < jnp.inf) & m.loss_finite  # (above it: a passing spike)
    # Learned against this step's own amax (not the held peak, which may still sink):
    # these statistics then ask for at most halfway between the ceiling and the scale
    # it backed off to.
    learned = jnp.floor(log2_max - cfg.margin - unit) - ceiling + max(1, cfg.backoff // 2)
    room = jnp.where(seen & (used < ceiling), jnp.maximum(state.headroom.array, learned),
                     state.headroom.array)
    # Statistics that ask for less than the ceiling by themselves explain the overflow
    # (the group was above them): nothing to learn, and the ceiling stays, so a blind
    # jump lifted by the global floor cannot return to it.
    ceiling = jnp.where(seen & ((used >= ceiling) | (learned > 0)), jnp.inf, ceiling)

    target = stat_t - jnp.ceil(room)
    if m.sumsq is not None:
        target = jnp.minimum(target, _gaussian(m.sumsq, m.count, used, cfg))
    if m.hist is not None:
        target = jnp.minimum(target, _quantile(m.hist, used, cfg))
    blind_jump = math.floor(log2_max - cfg.margin - math.log2(fmt.min_subnormal) - 1)
    # A starved group's jump never leaves what was measured before it was lost where it
    # flushes again: it lands at the smallest normal, the range above left for the
    # growth nobody measured.
    known = unit if m.lost_amax is None else jnp.maximum(unit, m.lost_amax)
    lowest = jnp.where(known > -jnp.inf, jnp.ceil(math.log2(fmt.min_normal) - known),
                       -jnp.inf)
    starved = None if m.starved is None else act & m.starved
    if starved is not None:  # (values lost below u_min / 2 may be its largest)
        target = jnp.where(starved, jnp.minimum(target, jnp.maximum(used + blind_jump,
                                                                    lowest)), target)
    if cfg.period > 1:
        target = jnp.where(recompute, target, log2)

    # Blamed at the steps before too, with nothing measured yet: a harder drop, by the
    # group's own run (another group's overflows and forward overflows are not its).
    run = state.overflowed.array
    blind = (run > 0) & ~(prev_amax > -jnp.inf)
    drop = cfg.backoff * jnp.where(blind, _formats.pow2(jnp.minimum(run, 4)), 1.0)
    # (Other groups' statistics, the floor, lift no group that learned headroom: its
    # own boundary statistics are known to miss growth inside it.)
    grown = jnp.where(room > 0, log2 + blind_jump, jnp.maximum(log2 + blind_jump, floor)
                      ) - jnp.ceil(room)
    if starved is not None:  # (other groups' statistics, the floor, say nothing of
        # values that never reached this one's: at most the jump that cannot overflow)
        grown = jnp.where(starved, jnp.minimum(grown, jnp.maximum(log2 + blind_jump,
                                                                  lowest) - jnp.ceil(room)),
                          grown)
    # Below a ceiling the blind jump goes halfway to it: the scale lies in between.
    grown = jnp.minimum(grown, jnp.floor((log2 + ceiling) / 2))
    nxt = jnp.where(bad | backs_off, used - drop, jnp.where(amax > 0, target, grown))
    nxt = jnp.clip(jnp.where(hold, log2, nxt), lo, hi)
    new_log2 = jnp.where(m.loss_finite, nxt, log2).astype(jnp.float32)

    measured = jnp.any(act & (amax > 0))
    # (a group that measured only a live fan-in's rows computed nothing at its scale)
    checked = act & (amax > 0) & ~bad & (True if m.own is None else m.own)
    rise = jnp.where(checked, new_log2 - used, 0.0)
    underscaled = jnp.any(rise > cfg.max_rise)
    applied = m.grads_finite & m.loss_finite & measured & ~underscaled
    room = jnp.where(applied & finite, jnp.maximum(room - HEADROOM_RETURN, 0.0), room)
    keep = ~m.loss_finite
    room = jnp.where(keep, state.headroom.array, room)
    ceiling = jnp.where(keep, state.ceiling.array, ceiling)
    new_base = _common.count_step(base, m.grads_finite, m.loss_finite,
                                  refused=~measured | underscaled)
    new_base = new_base._replace(loss_scale=_formats.pow2(new_log2[0]))
    health = (jnp.where(new_base.notfinite_count >= cfg.max_consecutive_skips,
                        Health.SKIPPING, 0)
              | jnp.where(jnp.any(bad & (log2 <= lo)), Health.PINNED_LOW, 0)
              | jnp.where(jnp.any(act & (amax == 0) & (log2 >= hi)) & ~measured,
                          Health.NOTHING_MEASURED, 0)).astype(jnp.int32)
    if cfg.groups == "global" and m.flushed is not None:
        # One scale, as high as the largest gradients allow (within a binade of the
        # target), flushed a module's cotangent entirely: more span than it can hold.
        top = jnp.max(jnp.where(act, jnp.log2(amax), -jnp.inf))
        as_high = top >= log2_max - cfg.margin - 1
        health = health | jnp.where(m.loss_finite & m.grads_finite & m.flushed & as_high,
                                    Health.SPAN, 0).astype(jnp.int32)
    # A group that measured nothing had everything below u_min / 2 at its scale: a held
    # peak above that is stale (else a blind jump and the peak would alternate). A
    # starved group's statistics miss what was lost on its way: no peak of them (its
    # same-step choices are not bounded by a scale set from part of its values).
    flushed = jnp.minimum(prev_amax, math.log2(fmt.min_subnormal) - 1.0 - used)
    keep_peak = bad | hold | backs_off | ~m.loss_finite  # (a forward overflow: kept)
    if starved is not None:
        keep_peak = keep_peak | (starved & (amax > 0))
    peak = jnp.where(keep_peak, prev_amax,
                     jnp.where(act & (amax == 0) & m.loss_finite, flushed, held))
    names = state.groups
    return state.replace(
        base=new_base,
        log2_scales=GroupVector(names, _computed_once(new_log2), split=True),
        log2_amax=GroupVector(names, peak.astype(jnp.float32)),
        overflowed=GroupVector(names, jnp.where(m.loss_finite & ~hold,
                                                jnp.where(bad, run + 1, 0), run)),
        headroom=GroupVector(names, room.astype(jnp.float32)),
        ceiling=GroupVector(names, ceiling.astype(jnp.float32)),
        health=health,
    )


def _computed_once(v: jax.Array) -> jax.Array:
    """``v``, computed once: each group's scale is an output of its own, and XLA would
    copy the whole chain of ops that makes ``v`` into every output's kernel (one kernel
    per group, each compiled). It does not copy a scatter into its readers."""
    n = v.shape[-1]
    return jnp.zeros_like(v).at[..., jnp.arange(n)].set(v, unique_indices=True)


def _gaussian(sumsq, count, used, cfg) -> jax.Array:
    """The reference's rule: the smallest power of two at which a zero-mean normal with
    the measured std puts at most ``threshold`` of its mass below ``u_min`` (ceil: floor
    would allow up to 2T), never below 1 (its ``alpha >= 1``); +inf where nothing was
    measured."""
    with jax.ensure_compile_time_eval():  # a constant of the configuration
        t = float(erfinv(jnp.float32(cfg.threshold)))
    c = math.log2(cfg.format.min_subnormal) - math.log2(math.sqrt(2.0) * t)
    unit_log2_sigma = 0.5 * jnp.log2(sumsq / jnp.maximum(count, 1.0)) - used
    return jnp.where(sumsq > 0, jnp.maximum(jnp.ceil(c - unit_log2_sigma), 0.0), jnp.inf)


def _quantile(hist, used, cfg) -> jax.Array:
    """The smallest scale keeping at most ``threshold`` of the histogram's non-zero values
    below ``2 u_min`` (+inf where it has no answer).

    ``below[j]`` counts values under ``2**(lo + j)`` at the used scale; the largest ``j``
    with ``below[j] <= T n`` puts binade ``k`` at ``2 u_min``. ``k == e_min``: more than
    ``T`` of the values sit in the lowest binade the format holds, where values rounded
    up from below ``u_min`` land and under which flushed ones vanish: the tail is cut off
    by an unknown amount, so the amax rule alone applies (the next step sees the tail).
    """
    e_min = cfg.format.min_exponent
    lo = e_min - _channel.HIST_BELOW
    zero = jnp.zeros(hist.shape[:-1] + (1,), jnp.float32)
    below = jnp.concatenate([zero, jnp.cumsum(hist, axis=-1)], axis=-1)
    total = below[..., -1]
    k = lo + jnp.sum(below <= cfg.threshold * total[..., None], axis=-1) - 1
    s_q = (used + e_min + 1 - k).astype(jnp.float32)
    return jnp.where((total > 0) & (k != e_min), s_q, jnp.inf)
