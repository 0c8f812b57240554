"""The statistics channel: how a scale point's measurements leave the backward pass, and
what they say about each scale group.

Every applied scale point holds one *row* per pair of anchor sets among its leaves
(:mod:`adaloss_jax._stream`), measured where the cotangent arrives, at the scale of the
region on its consumer side. A row leaves the backward pass as the cotangent of a zero
"dummy" input of its own, so ``jax.grad`` hands it out with no side effect::

    column   what                                                    reduced by
    AMAX     largest |cotangent| (a NaN reads as inf)                max
    BAD_Y    the cotangent exceeded the format it is stored in       max
    BAD_X    its conversion exceeded the format where it goes        max
    SUMSQ    sum of squares           (statistic="gaussian" only)    sum
    COUNT    number of elements       (statistic="gaussian" only)    sum
    HIST     counts of non-zero elements by binade (NBINS columns,
             statistic="quantile" only)                              sum

A point met several times gets a row per meeting, never a sum of rows: a point inside
a scan gets a stacked dummy, one row per iteration, and a point inside a ``shard_map``
of the loss one row per device (:mod:`adaloss_jax._apply`); a point inside a vmap
measures the whole batched cotangent; a point in a step that a ``shard_map`` maps
reduces its row over the devices as the table says. :func:`reduce_rows` is that one
reduction, and :func:`decode` turns the rows into per-group :class:`ScaleStats`.
Nothing else reads a row's columns.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from adaloss_jax import _formats
from adaloss_jax._layout import GroupVector
from adaloss_jax._state import ScaleStats
from adaloss_jax._tree import SEED, state_group

_AMAX, _BAD_Y, _BAD_X, _SUMSQ, _COUNT = range(5)
_MAXED = 3  # the first three columns reduce by max, the rest by sum
NBINS = 56  # histogram bins, from HIST_BELOW binades under the format's smallest subnormal
HIST_BELOW = 16  # (the lowest bin also counts everything below it, the highest above)


class Columns(NamedTuple):
    """The layout of a statistics row for one scaler (static)."""

    sumsq: bool  # SUMSQ and COUNT columns
    hist_lo: int | None  # binade of the histogram's lowest bin; None: no histogram

    @classmethod
    def of(cls, scaler) -> Columns:
        hist_lo = None
        if scaler.statistic == "quantile":
            hist_lo = scaler.format.min_exponent - HIST_BELOW
        return cls(sumsq=scaler.statistic == "gaussian", hist_lo=hist_lo)

    @property
    def hist_start(self) -> int:
        return _COUNT + 1 if self.sumsq else _BAD_X + 1

    @property
    def width(self) -> int:
        return self.hist_start + (NBINS if self.hist_lo is not None else 0)


def reduce_rows(rows: jax.Array, axes: Sequence[int]) -> jax.Array:
    """Rows measured in several passes (stacked along ``axes``) as one row: the max of
    the maxima and flags, the sum of the rest. Exact, whatever the passes' order."""
    axes = tuple(axes)
    if not axes:
        return rows
    return jnp.concatenate([jnp.max(rows[..., :_MAXED], axis=axes),
                            jnp.sum(rows[..., _MAXED:], axis=axes)], axis=-1)


class PointConfig(NamedTuple):
    """Static configuration of one row's scale point (a custom_vjp nondiff argument)."""

    columns: Columns
    convert: bool  # False when both sides have the same scale by construction
    measure: bool  # False for parameter conversions (the optimizer measures gradients)
    y_max: float  # largest finite value where the cotangent arrives (its storage format)
    x_max: float  # the same after the conversion (the simulated format where it rounds)
    simulate: Any = None  # a dtype to round converted cotangents to (fp8 simulation)
    dummy_axes: frozenset = frozenset()  # mapped axes the dummy itself varies over


def _binade_hist(cts: tuple[jax.Array, ...], lo: int) -> jax.Array:
    """Counts of the non-zero elements of ``cts`` by ``floor(log2|x|)``, in NBINS bins
    from binade ``lo`` (clipped at both ends), as fp32.

    The binade is read from the fp32 exponent bits (exact for every fp16/fp8 value,
    subnormals included); a scatter-add into the bins is far cheaper than comparing every
    element with every bin.
    """
    hist = jnp.zeros((NBINS,), jnp.int32)
    for ct in cts:
        bits = jax.lax.bitcast_convert_type(ct.astype(jnp.float32), jnp.int32)
        binade = ((bits >> 23) & 0xFF) - 127
        idx = jnp.clip(binade - lo, 0, NBINS - 1).reshape(-1)
        hist = hist.at[idx].add((ct != 0).reshape(-1).astype(jnp.int32))
    return hist.astype(jnp.float32)


def magnitude(cts: tuple[jax.Array, ...]) -> jax.Array:
    """The largest magnitude of ``cts`` in fp32 (0 for none): ``max(|ct|)``, one
    reduction, on GPUs and TPUs; ``max(max(ct), -min(ct))`` on the CPU (see
    :func:`measure`). The two agree on every value, infinities included; the platform
    picks one when the step is lowered (``jax.lax.platform_dependent``)."""
    amax = jnp.zeros((), jnp.float32)
    for ct in cts:
        if ct.size:
            amax = jnp.maximum(amax, jax.lax.platform_dependent(
                ct, cpu=_max_and_min, default=_max_abs))
    return amax


def _max_and_min(ct: jax.Array) -> jax.Array:
    """``max(max(ct), -min(ct))`` in fp32: two reductions straight over ``ct``, for a
    backend that does not fuse ``abs`` into a reduction (XLA's CPU)."""
    return jnp.maximum(jnp.max(ct).astype(jnp.float32), -jnp.min(ct).astype(jnp.float32))


def _max_abs(ct: jax.Array) -> jax.Array:
    """``max(|ct|)`` in fp32: one reduction with ``abs`` fused into it (a GPU reduces
    ``max`` and ``min`` in a kernel each, and in two stages over a large cotangent)."""
    return jnp.max(jnp.abs(ct)).astype(jnp.float32)


def measure(cts: tuple[jax.Array, ...], ratio, cfg: PointConfig, amax=None) -> jax.Array:
    """The statistics row of the arriving cotangents ``cts`` (``amax``: their
    :func:`magnitude`, if already taken).

    The magnitude maximum is :func:`magnitude`'s. On the CPU it is ``max(max(ct),
    -min(ct))``: two reductions straight over the cotangent (XLA's CPU backend does not
    fuse an elementwise producer into a reduction, so ``max(|ct|)`` would materialise a
    temporary the size of the cotangent); elsewhere ``max(|ct|)``. Infinities reach
    every reduction. A NaN may reach AMAX (:func:`decode`
    reads it as inf) or be dropped by a CPU reduction: such a NaN came from an inf
    upstream, which a point there saw, and reaches the parameter gradients, whose
    finiteness the optimizer checks element by element. ``BAD_Y``/``BAD_X`` are negated
    comparisons, so a NaN sets them too.

    Nothing is computed that is the same for every point or known at trace time
    (``BAD_X`` is ``BAD_Y`` where nothing converts or rounds): these ops are repeated at
    every point of the program.
    """
    if amax is None:
        amax = magnitude(cts)
    sumsq = jnp.zeros((), jnp.float32)
    if cfg.columns.sumsq:
        for ct in cts:
            c = ct.astype(jnp.float32)
            sumsq = sumsq + jnp.sum(c * c)
    bad_y = jnp.logical_not(amax <= cfg.y_max)
    if cfg.convert or cfg.x_max != cfg.y_max:
        bad_x = jnp.logical_not(amax * ratio <= cfg.x_max)
    else:
        bad_x = bad_y
    cols = [amax, bad_y.astype(jnp.float32), bad_x.astype(jnp.float32)]
    if cfg.columns.sumsq:
        cols += [sumsq, jnp.float32(sum(ct.size for ct in cts))]
    parts = [jnp.stack(cols)]
    if cfg.columns.hist_lo is not None:
        parts.append(_binade_hist(cts, cfg.columns.hist_lo))
    return jnp.concatenate(parts)


def _varying_axes(x) -> set:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return set(mat.varying)
    return set(getattr(aval, "vma", ()) or ())


def varying_axes(x) -> frozenset:
    """The mapped axes (``shard_map``) a value varies over, by its type."""
    return frozenset(_varying_axes(x))


def _over_devices(row: jax.Array, cts: tuple, dummy_axes: frozenset) -> jax.Array:
    """Under ``shard_map`` a cotangent may vary over mapped axes while its dummy does
    not (a dummy made inside the map: the map is around the whole step); the row is
    reduced over those axes here (the row's own reduction, by collectives), so it is
    global, as under SPMD ``jit``. Over the axes the dummy varies over too (a dummy
    passed into a map inside the loss: one row per device) nothing is reduced here."""
    axes = set()
    for c in cts:
        axes |= _varying_axes(c)
    axes -= dummy_axes
    if not axes:
        return row
    axes = tuple(sorted(axes))
    return jnp.concatenate([jax.lax.pmax(row[:_MAXED], axes),
                            jax.lax.psum(row[_MAXED:], axes)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def scale_point(cfg: PointConfig, xs: tuple, ratio: jax.Array, dummy: jax.Array):
    """Identity on ``xs``; the backward pass multiplies the cotangents by ``ratio``
    (exact: a power of two, in fp32) and returns their row as ``dummy``'s cotangent."""
    del ratio, dummy
    return xs


def _scale_point_fwd(cfg, xs, ratio, dummy):
    del dummy
    return xs, ratio


def _scale_point_bwd(cfg, ratio, cts):
    if cfg.convert:
        out = tuple((c.astype(jnp.float32) * ratio).astype(c.dtype) for c in cts)
    else:
        out = cts
    if cfg.simulate is not None:
        out = tuple(_formats.round_to(c, cfg.simulate) for c in out)
    if not cfg.measure:
        return out, jnp.zeros_like(ratio), None
    return out, jnp.zeros_like(ratio), _over_devices(measure(cts, ratio, cfg), cts,
                                                      cfg.dummy_axes)


scale_point.defvjp(_scale_point_fwd, _scale_point_bwd)


def convert_param(x: jax.Array, ratio: jax.Array) -> jax.Array:
    """A parameter read at a scale other than its owner's: identity whose backward pass
    multiplies the gradient by ``ratio`` (so it arrives at the owner's scale)."""
    inf = float("inf")
    cfg = PointConfig(Columns(False, None), convert=True, measure=False, y_max=inf, x_max=inf)
    (y,) = scale_point(cfg, (x,), ratio, jnp.zeros((), jnp.float32))
    return y


class Row(NamedTuple):
    """What decoding needs to know of one row (static): the anchor sets of its two sides
    and the largest finite values there (:class:`PointConfig`)."""

    y: tuple[str, ...]  # anchors where the cotangent arrived (it was measured there)
    x: tuple[str, ...]  # anchors where it goes
    y_max: float
    x_max: float
    wide: bool = False  # measured in a wider dtype before a cast narrows it: nothing
    # it measured was lost where it is stored
    branch: int | None = None  # in a ``cond``'s branch: the cond (its outermost, in
    # the program). A branch's backward pass runs only where it was taken: a row of
    # zeros there is a sign that zeros arrived only if every row of its cond is zeros


def _shift_hist(hist: jax.Array, k) -> jax.Array:
    """A binade histogram seen at a scale ``2**k`` times larger (end bins keep
    everything beyond them)."""
    nb = hist.shape[-1]
    c = jnp.concatenate([jnp.zeros((1,), hist.dtype), jnp.cumsum(hist)])
    j = jnp.arange(1, nb)
    inner = c[jnp.clip(j - k.astype(jnp.int32), 0, nb)]
    c2 = jnp.concatenate([jnp.zeros((1,), hist.dtype), inner, c[-1:]])
    return jnp.diff(c2)


_WIDE = 1e38  # a format with float32's range: nothing it holds flushes at a rule's scale


def decode(rows: Sequence[Row], values: Sequence[jax.Array], used: GroupVector,
           columns: Columns, fmt_max: float, planned: GroupVector | None = None,
           fmt_min: float | None = None, moved: dict | None = None) -> ScaleStats:
    """Rows -> per-group statistics, each at its group's scale.

    A row counts for every group anchoring either of its sides, shifted to that group's
    scale (it was measured at the scale of its ``y`` side, ``sigma[row.y]``); its AMAX
    is taken relative to the largest value of the format that held it. An overflow is
    blamed on the groups whose scales it started at: a conversion into a region that
    overflowed, a value too large where it arrived, or non-finite values leaving a
    region while all that entered it was finite.

    Args:
      rows: the static description of each row, in the order of ``values``.
      values: each row's array (stacked rows already reduced: :func:`reduce_rows`), or
        several rows' as one array (a row per layer of a stack: ``(layers, width)``).
      used: the log2 scale of each group in use (an anchor set's is the min over it).
      columns: the row layout.
      fmt_max: the largest finite value of the scaler's format.
      planned: where live regions chose their own scales (``AdaptiveScale.same_step``),
        the scales the plan set: a fan-in's scale (a set of several groups) is the min
        of their planned scales, a one-group region's its group's in ``used`` (but
        the loss's seed, :data:`~adaloss_jax._tree.SEED`: the root's planned scale; its
        rows count for the root).
      moved: ``{anchor set: choice - plan}``: the fan-ins that chose their own scale in
        the backward pass (``adaloss_jax._live``); such a set's scale is its planned one
        (the min) plus that difference.

    Vectorised over rows with static index arrays: a handful of ops whatever the
    model's size and depth.
    """
    groups = used.names
    log2 = used.array
    gi = {g: i for i, g in enumerate(groups)}
    gi[SEED] = gi.get(state_group(SEED))  # (counts for the root, at its planned scale)
    ng = len(groups)
    z = jnp.zeros((ng,), jnp.float32)
    vec = lambda v: GroupVector(groups, v)
    gaussian, quantile = columns.sumsq, columns.hist_lo is not None
    if not rows:
        return ScaleStats(used, vec(z), vec(z > 0), jnp.asarray(False),
                          sumsq=vec(z) if gaussian else None, count=vec(z) if gaussian else None,
                          hist=vec(jnp.zeros((NBINS, ng), jnp.float32)) if quantile else None)
    sets = sorted({r.y for r in rows} | {r.x for r in rows})
    si = {a: i for i, a in enumerate(sets)}
    ns = len(sets)
    m = jnp.concatenate([v.reshape(-1, v.shape[-1]) for v in values])
    amax_r = m[:, _AMAX]
    m = m.at[:, _AMAX].set(jnp.where(jnp.isnan(amax_r), jnp.inf, amax_r))
    # Attributions: each row counts for every group anchoring either of its sides.
    # (``e_own``: the group anchors a side that is no fan-in choosing its own scale)
    e_row, e_grp, e_set, e_lim, e_own = [], [], [], [], []
    for r, row in enumerate(rows):
        lims: dict = {}  # group -> the largest value where it holds the row
        own: set = set()
        for side, side_max in ((row.y, row.y_max), (row.x, row.x_max)):
            for g in side:
                lims[gi[g]] = min(lims.get(gi[g], math.inf), side_max)
                if side not in (moved or {}):
                    own.add(gi[g])
        for i, lim in lims.items():
            e_row.append(r)
            e_grp.append(i)
            e_set.append(si[row.y])
            e_lim.append(fmt_max / lim)
            e_own.append(i in own and lim < _WIDE)
    e_row, e_grp, e_set = (jnp.asarray(v, jnp.int32) for v in (e_row, e_grp, e_set))
    # Every set's scale at once (one gather and a min; a set's row padded with its first).
    width = max(len(a) for a in sets)
    members = [[gi[g] for g in a] + [gi[a[0]]] * (width - len(a)) for a in sets]
    sigma_vec = jnp.min((log2 if planned is None else planned.array)[
        jnp.asarray(members, jnp.int32)], axis=1)
    if planned is not None:
        single = jnp.asarray([len(a) == 1 and a[0] != SEED for a in sets])
        sigma_vec = jnp.where(single, log2[jnp.asarray([gi[a[0]] for a in sets])],
                              sigma_vec)
    chose = [(si[a], d) for a, d in (moved or {}).items() if a in si]
    if chose:
        sigma_vec = sigma_vec.at[jnp.asarray([i for i, _ in chose], jnp.int32)].add(
            jnp.stack([jnp.asarray(d, jnp.float32) for _, d in chose]))
    k = log2[e_grp] - sigma_vec[e_set]
    f = _formats.pow2(k)
    a = m[e_row, _AMAX] * jnp.asarray(e_lim, jnp.float32) * f
    amax_v = jnp.maximum(jax.ops.segment_max(a, e_grp, ng), 0.0)
    # What a group measured in rows it anchors other than through a fan-in choosing
    # its own scale, and held where it may flush (not in float32's range): none where
    # its own rows were zeros (a module whose output's cotangent is stopped, its input
    # such a fan-in), or all in float32 (the root of a float32 model, simulating fp8).
    own = vec(jax.ops.segment_max(jnp.where(jnp.asarray(e_own), a, 0.0), e_grp, ng) > 0)
    sumsq = count = hist = None
    if gaussian:
        sumsq = vec(jax.ops.segment_sum(m[e_row, _SUMSQ] * f * f, e_grp, ng))
        count = vec(jax.ops.segment_sum(m[e_row, _COUNT], e_grp, ng))
    if quantile:
        h = jax.vmap(_shift_hist)(m[e_row, columns.hist_start:], k)
        hist = vec(jax.ops.segment_sum(h, e_grp, ng).T)

    # Overflow blame per anchor set (rows by their sides' sets).
    amax_r = m[:, _AMAX]
    bad_y = m[:, _BAD_Y] > 0
    bad_x = m[:, _BAD_X] > 0
    inf_y = ~(amax_r < jnp.inf)
    ys, xs = [si[r.y] for r in rows], [si[r.x] for r in rows]  # each row's sets
    y_set, x_set = jnp.asarray(ys, jnp.int32), jnp.asarray(xs, jnp.int32)
    conv = jnp.asarray([r.y != r.x for r in rows])
    any_of = lambda v, idx: jax.ops.segment_max(v.astype(jnp.int32), idx, ns) > 0
    blame = any_of(bad_y & ~inf_y, y_set) | any_of(conv & bad_x & ~bad_y, x_set)
    left_inf = any_of(inf_y, y_set)
    arrived_bad = any_of(conv & (bad_x | bad_y), x_set)
    started = blame | (left_inf & ~arrived_bad)
    p_set = [si[s] for s in sets for _ in s]
    p_grp = [gi[g] for s in sets for g in s]
    bad_v = jax.ops.segment_max(started[jnp.asarray(p_set)].astype(jnp.int32),
                                jnp.asarray(p_grp), ng) > 0
    # A row stored in the scaler's format (where it rounds, or where the model computes
    # in it) that arrived non-zero and flushed entirely there: one scale lost it. The
    # groups it went to are starved (and so is every group a row reached as zeros, but
    # for a row of a cond's branch that was not taken): what was lost, and all computed
    # from it, is missing from their statistics.
    flushed, starved, lost_amax = jnp.asarray(False), None, None
    zero = (amax_r == 0) & ~_untaken(rows, amax_r)
    lost = zero
    if fmt_min is not None:
        stored_in = jnp.asarray([r.x_max == fmt_max and not r.wide for r in rows])
        stored = amax_r * _formats.pow2(sigma_vec[x_set] - sigma_vec[y_set])
        gone = stored_in & (amax_r > 0) & (stored < fmt_min / 2)
        flushed, lost = jnp.any(gone), lost | gone
        starved = vec(jax.ops.segment_max(any_of(lost, x_set)[jnp.asarray(p_set)].astype(
            jnp.int32), jnp.asarray(p_grp), ng) > 0)
        lost_amax = vec(jax.ops.segment_max(
            _lost_amax(rows, amax_r, gone, sigma_vec[y_set], xs, ys, ns, fmt_max, zero)[
                jnp.asarray(p_set)], jnp.asarray(p_grp), ng))
    return ScaleStats(used, vec(amax_v), vec(bad_v), jnp.any(bad_y | bad_x),
                      sumsq=sumsq, count=count, hist=hist, flushed=flushed,
                      starved=starved, lost_amax=lost_amax, own=own)


def _untaken(rows: Sequence[Row], amax_r: jax.Array) -> jax.Array:
    """Per row, whether it lies in a ``cond``'s branch that may not have been taken: some
    row of the same cond measured something (so a row of zeros there is a branch the
    backward pass did not run, not zeros that arrived)."""
    conds = sorted({r.branch for r in rows if r.branch is not None})
    if not conds:
        return jnp.zeros((len(rows),), bool)
    at = {c: i for i, c in enumerate(conds)}
    idx = jnp.asarray([at[r.branch] if r.branch is not None else len(conds)
                       for r in rows], jnp.int32)
    seen = jax.ops.segment_max((amax_r > 0).astype(jnp.int32), idx, len(conds) + 1) > 0
    return jnp.asarray([r.branch is not None for r in rows]) & seen[idx]


def _lost_amax(rows, amax_r, gone, sigma_y, x_set: list, y_set: list, ns: int,
               fmt_max: float, zero=None):
    """Per anchor set, log2 of the largest value (at unit scale, in units of the
    format) that was measured before it was lost on its way into the set: where it
    flushed entirely (that row's own amax), where it was measured on the wide side of a
    cast (it flushes at the cast), and, along rows that arrived as zeros, whatever their
    own side had lost; -inf where nothing was. ``x_set``, ``y_set``: each row's sets;
    ``zero``: the rows that arrived as zeros (default: those of amax 0; a branch not
    taken is none, :func:`_untaken`).

    A closure over the rows that arrived as zeros: set ``x`` receives what every set
    reaching it along such rows lost. Computed without a loop whose length depends on
    the values (on a GPU a ``while`` loop reads its condition on the host once a turn
    and splits the step's command buffer): up to :data:`_DENSE_SETS` sets, a boolean
    reachability matrix squared ``ceil(log2(ns - 1))`` times (every chain of sets is at
    most ``ns - 1`` rows long); beyond that, one pass per link until nothing changes."""
    lim = jnp.asarray([fmt_max / min(r.y_max, r.x_max) for r in rows], jnp.float32)
    wide = jnp.asarray([r.wide for r in rows])
    unit = jnp.log2(jnp.where(amax_r > 0, amax_r, 1.0) * lim) - sigma_y
    x_set, y_set = jnp.asarray(x_set, jnp.int32), jnp.asarray(y_set, jnp.int32)
    zero = amax_r == 0 if zero is None else zero
    seen = jax.ops.segment_max(jnp.where((gone | wide) & (amax_r > 0), unit, -jnp.inf),
                               x_set, ns)
    if ns <= _DENSE_SETS:
        # reach[x, y]: x receives what y lost (itself, or along rows of zeros)
        reach = jnp.eye(ns, dtype=jnp.float32).at[x_set, y_set].max(
            zero.astype(jnp.float32))
        for _ in range(math.ceil(math.log2(max(ns - 1, 1)))):
            reach = (jnp.dot(reach, reach, precision=jax.lax.Precision.HIGHEST) > 0
                     ).astype(jnp.float32)
        return jnp.max(jnp.where(reach > 0, seen[None, :], -jnp.inf), axis=1)

    def spread(carry):
        now, _ = carry
        came = jax.ops.segment_max(jnp.where(zero, now[y_set], -jnp.inf), x_set, ns)
        return jnp.maximum(now, came), now

    return jax.lax.while_loop(lambda c: jnp.any(c[0] != c[1]), spread,
                              spread((seen, seen)))[0]


# Anchor sets up to which _lost_amax closes over rows of zeros by matrix squaring (a
# handful of ns x ns products; beyond, their cost outgrows a loop's).
_DENSE_SETS = 256


# ------------------------------------------------------------------ same-step scales


class LiveConfig(NamedTuple):
    """Static configuration of a point on the border of live regions
    (:mod:`adaloss_jax._live`): where each side's log2 scale comes from."""

    point: PointConfig
    x_token: int | None  # which emitted token's cotangent is the x side's scale
    y_token: int | None  # the same for the y side (None: the planned one)
    emits: int  # tokens emitted (one per live group whose scale it needs)
    decides: bool  # it chooses the x side's scale (the decider of a live region)
    takes: int = 0  # tokens the decider takes (one per point that needs its choice)
    target: float = 0.0  # log2 of the largest value the decider aims at (x_max, margin)
    low: float = -math.inf  # log2 of the smallest subnormal its region holds (held_span)
    lo: float = -math.inf  # bounds of every scale (log2)
    hi: float = math.inf
    axes: tuple = ()  # mapped axes to agree over where the types do not say (check_vma off)
    reserve: float = 0.0  # the most a first choice keeps free for sums inside (max_rise)
    halfway: bool = False  # a fan-in's first choice: halfway down its dtype's span
    follows: bool = False  # the x side's token counts x ``base[2]`` (a stream's way in)
    first_token: int | None = None  # and this one x ``1 - base[2]`` (the side before it)
    recurrent: bool = False  # a decider in a scan over time: it chooses where ``base[2]``
    # is 0 (the iteration the backward pass runs first), elsewhere it reads its x side's
    # token (the choice carried from there); ``chosen`` counts at that iteration only


def decide(amax: jax.Array, cts: tuple, ly, limits: jax.Array, cfg: LiveConfig,
           dummy_axes=frozenset()) -> tuple[jax.Array, jax.Array]:
    """The log2 scale ``s`` a live region gets from the cotangents ``cts`` arriving at
    its decider (at scale ``2**ly``; ``amax``: their :func:`magnitude` on this device),
    and ``s - planned``::

        A     = amax(cts) / 2**ly                       # over the devices that share it
        s     = floor(target - log2 A) - headroom        # target = high - margin
        s     = s - reserve        while prior is +inf (nothing measured inside yet):
                                   # reserve = min(ceil(log2 n), max_rise), n = the
                                   # elements of a cotangent per entry of its last axis;
                                   # a fan-in's: halfway(low, target)
                                   # (low, high: held_span)
        s     = min(s, prior)      # prior: the rule's scale (+inf until the group was
                                   # measured or overflowed)
        s     = planned where A is 0 or not finite       (nothing to measure by: the
                                                         rule's scale)
        s     = clip(s, log2 min_loss_scale, log2 max_loss_scale)

    ``limits = [headroom, prior, planned]``; the prior holds the growth inside the
    module the rule has measured (its scale is set from the module's largest value, not
    only its entry's), and after an overflow the rule's back-off. Before it has one, the
    region's parameter gradients are sums over the cotangent's leading axes (a Dense
    kernel's over every token, a norm's scale likewise): ``reserve`` keeps room for a
    sum of ``n`` terms as large as the entry, so the first pass measures them instead of
    overflowing; at most ``max_rise`` binades, so the rule does not refuse the step as
    computed too far below the scale its statistics call for.

    Both are the results of a conditional (measured or planned), so XLA computes them
    once: as a plain select, the scalar chain behind the choice (each decider's input
    is the choice of the region downstream) would be fused into every kernel that
    converts or unscales by it, and the compiled step would grow with depth squared.
    ``limits`` is read inside the conditional only: it is one group's slice of a table
    of every group's (``adaloss_jax._grad._limits``), and a kernel that read it outside
    would be a distinct kernel per group, each compiled apart."""
    varying = set().union(*(_varying_axes(c) for c in cts))
    axes = tuple(sorted(varying - dummy_axes)) if varying else cfg.axes  # (untyped, as
    # under check_vma=False: the optimizer's axis_name)
    if axes:  # one scale for every device whose gradients are summed
        amax = jax.lax.pmax(amax, axes)
    reserve = min(first_reserve(cts), cfg.reserve)
    if cfg.halfway:
        reserve = halfway(cfg.low, cfg.target)

    def measured(limits):
        headroom, prior, planned = limits[0], limits[1], limits[2]
        headroom = headroom + jnp.where(prior < jnp.inf, 0.0, reserve)
        s = jnp.minimum(jnp.floor(cfg.target - (jnp.log2(amax) - ly)) - headroom, prior)
        s = jnp.clip(s, cfg.lo, cfg.hi)
        return s, s - planned

    def unmeasured(limits):
        s = jnp.clip(limits[2], cfg.lo, cfg.hi)
        return s, s - limits[2]

    return jax.lax.cond((amax > 0) & (amax < jnp.inf), measured, unmeasured, limits)


def held_span(x_max: float, dtypes) -> tuple[float, float]:
    """``(low, high)``: log2 of the smallest subnormal and of the largest value a live
    region's decider counts its region as holding (static): the largest value where
    its point holds the cotangent (``x_max``: the format's, where it rounds to it), and
    the smallest subnormal of the ``dtypes`` its cotangents arrive in. A span wider than
    float16's counts as float16's: the region holds values in a narrow dtype too, which
    a scale aimed at float32's largest value would overflow, or one put halfway down
    its span would flush (an RNN's state carried in float32 through a cell computing in
    float16)."""
    low = min(math.log2(float(jnp.finfo(d).smallest_subnormal)) for d in dtypes)
    return (max(low, math.log2(_formats.FLOAT16.min_subnormal)),
            math.log2(min(x_max, _formats.FLOAT16.max)))


def halfway(low: float, target: float) -> float:
    """A fan-in's first reserve: half the binades between ``target`` and ``low``, the
    smallest subnormal its region holds (:func:`held_span`; static). A residual
    stream's cotangent grows below its decider by an amount nothing has measured yet
    (each reader's branch adds to it, a block's gain multiplies it); with its largest
    value halfway down, it may grow by half the span before it overflows, and only
    values smaller by more than that flush."""
    return float(math.floor((target - low) / 2))


def first_reserve(cts: tuple) -> float:
    """``ceil(log2 n)``, ``n`` the most elements any of ``cts`` has per entry of its
    last axis (0 for scalars and vectors): the binades a sum over its leading axes can
    grow by, terms as large as the largest entry (static). Under ``shard_map`` the
    shapes are the device's shard's: the sum over its own rows, the one it computes."""
    n = max((c.size // c.shape[-1] for c in cts if c.ndim >= 2 and c.shape[-1]), default=1)
    return float(math.ceil(math.log2(max(n, 1))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def live_point(cfg: LiveConfig, xs: tuple, base: jax.Array, limits: jax.Array,
               dummy: jax.Array, chosen: jax.Array, taken: tuple):
    """:func:`scale_point` on the border of live regions: identity on ``xs``, plus
    ``cfg.emits`` zero tokens. ``base = [x, y]``: the planned log2 scales of the two
    sides (and, for a stream's way in, ``cfg.follows``, a third: 1 at a layer whose x
    side is its own stream, 0 at the first, where it is the region before the scan,
    ``cfg.first_token``'s, or the one it decides, there only); a side in a live region
    reads its scale from an emitted token's cotangent,
    or (the decider) chooses it (:func:`decide`, with ``limits``) and returns its
    difference from the planned scale as the cotangent of ``chosen`` (from
    ``limits[2]``, the group's plan) and of every token it ``taken`` (from ``base[0]``)::

        chosen side  = base[side] + cotangent of its token      (a token nobody took
                                                                 reads the plan)
        group's scale = plan + cotangent of ``chosen``          (a decider the backward
                                                                 pass never reaches, its
                                                                 output unused: the plan)

    (a stack's carry holds a token that the last layer's consumer may not take)."""
    del base, limits, dummy, chosen, taken
    return xs, tuple(jnp.zeros((), jnp.float32) for _ in range(cfg.emits))


def _live_point_fwd(cfg, xs, base, limits, dummy, chosen, taken):
    del dummy
    tokens = tuple(jnp.zeros((), jnp.float32) for _ in range(cfg.emits))
    return (xs, tokens), (base, limits, chosen, taken)


def _typed_as(v: jax.Array, primal: jax.Array) -> jax.Array:
    """``v`` as the cotangent of ``primal`` under ``shard_map``'s types: reduced over
    the mapped axes it varies over and ``primal`` does not. A choice varies there only
    by type (its statistics were reduced over the devices; a state carried through the
    retry loop of a map around the whole step is typed as varying), so every device
    holds the same value and the max is it."""
    extra = tuple(sorted(_varying_axes(v) - _varying_axes(primal)))
    return jax.lax.pmax(v, extra) if extra else v


def _live_point_bwd(cfg, res, cts):
    base, limits, chosen, taken = res
    cts, emitted = cts
    pc = cfg.point
    ly = base[1] if cfg.y_token is None else base[1] + emitted[cfg.y_token]
    amax = magnitude(cts)
    lx = base[0] if cfg.x_token is None else base[0] + emitted[cfg.x_token] * (
        base[2] if cfg.follows else 1.0)
    if cfg.first_token is not None:
        lx = lx + emitted[cfg.first_token] * (1.0 - base[2])
    moved = jnp.zeros((), jnp.float32)
    if cfg.decides:
        chosen_x, mine = decide(amax, cts, ly, limits, cfg, pc.dummy_axes)
        first = base[2] == 0 if cfg.follows or cfg.recurrent else None
        if cfg.follows or cfg.recurrent:  # it decides at one layer or iteration only:
            # a stream's way in deciding the region before the first layer (elsewhere
            # its x side is the layer's stream, read as above), or a decider in a scan
            # over time (elsewhere its choice is the one carried; the group's scale is
            # one for every iteration, its gradients summed over them)
            chosen_x = jnp.where(first, chosen_x, lx)
            mine = jnp.where(first, mine, 0.0)
        moved = chosen_x - base[0]
        if cfg.follows:
            moved = jnp.where(first, moved, 0.0)
        lx = chosen_x
    ratio = _formats.pow2(lx) / _formats.pow2(ly)
    out = tuple((c.astype(jnp.float32) * ratio).astype(c.dtype) for c in cts)
    if pc.simulate is not None:
        out = tuple(_formats.round_to(c, pc.simulate) for c in out)
    row = (_over_devices(measure(cts, ratio, pc, amax), cts, pc.dummy_axes) if pc.measure
           else None)
    # The choice as its difference from the plan (``limits[2]``), as a token's: a decider
    # the backward pass never reaches (its module's output unused) reads the plan.
    if not cfg.decides:
        mine = jnp.zeros((), jnp.float32)
    return (out, jnp.zeros_like(base), jnp.zeros_like(limits), row, _typed_as(mine, chosen),
            tuple(_typed_as(moved, t) for t in taken))


live_point.defvjp(_live_point_fwd, _live_point_bwd)
