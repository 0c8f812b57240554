"""Adaptive per-layer loss scaling (Zhao et al., arXiv 1910.12385), for any JAX model.

How it works (all inside one ``jax.jit``):

* **Scale groups** (``groups="module"``) are the modules (or :func:`scale_group`
  functions) that own parameters directly, keyed by path (``"Block_0/attn"``), plus the
  root ``""`` whose scale multiplies the loss; with ``groups="global"`` there is only
  the root. ``max_depth=d`` cuts the paths at ``d`` components: a module nested deeper
  gets no scale points and its parameters are its enclosing depth-``d`` module's group
  (``max_depth=1``: one group per transformer block). Each group ``k`` has a
  power-of-two scale ``S_k = 2**s_k`` kept in fp32 in :class:`AdaptiveScaleState`.
* **Scale points** (``custom_vjp`` identities, :mod:`adaloss_jax._points`) go around
  every call of a module, put there by a front end (linen's ``intercept_methods``, NNX,
  or :func:`scale_group`), without changing the model.
* **Where conversions sit** (:mod:`adaloss_jax._stream`): the points cut the traced
  program into regions; all cotangents of one region share one scale, and a point
  converts a cotangent only where the scales of its two sides differ. A module's
  interior runs at its own group's scale; a cotangent leaving a module keeps that
  scale along the stream until it reaches a fan-in (a value with several consumers),
  whose region runs at the smallest of its consumers' scales, so branches always meet
  at one scale, for any graph. A parameter read at another scale than its owner's gets
  a conversion of its own, so each parameter gradient is unscaled by the scale it was
  computed at. The analysis is done once per program structure (cached).
* **Statistics** of each cotangent where it arrives at a point (amax, sum of squares,
  count, whether it or its conversion overflowed; with ``statistic="quantile"`` a
  histogram by binade) come out of the backward pass as the cotangents of zero "dummy"
  inputs, one per point, and count for every group that sets the scale of the region
  they were measured in (shifted to that group's scale), so a value that exists at a
  group's scale counts for it, and an overflow is blamed on the groups whose scales it
  happened at.
* :func:`adaptive_unscale` unscales each parameter leaf by its group's scale (in
  fp32), checks finiteness, skips exactly as :func:`adaloss_jax.unscale` does, and sets
  each group's next scale from this step's statistics::

        amax_k = max(amax of k's measured cotangents and parameter gradients) / S_k
        held_k = max(amax_k, held_k(previous step) / 2**decay)  # held peak; decay=inf: amax_k
        s_k    = max(floor(log2(u_max) - margin - log2(held_k)),      # "amax"
                     floor(log2(u_max) - margin - log2(max_j amax_j)))  # on finite steps:
                 never below the scale one global group would get, so the held peak never
                 flushes what one global scale would have kept
        s_k    = min(s_k, max(0, ceil(log2(u_min / (sqrt(2) erfinv(T) sigma_k)))))  # "gaussian"
        s_k    = min(s_k, min{q : #{|x| 2**q < 2 u_min} <= T * n_k})   # "quantile", x over
                 the n_k non-zero cotangents measured for k (none if the tail is cut off)
        s_k    = s_{k, previous}  on steps where total_applied % interval != 0
        s_k    = s_k - backoff * 2**n if an overflow started at group k's scale, after n
                                      consecutive skipped steps (n capped at 4) if k also
                                      overflowed at the previous step, else n = 0; a group
                                      that only received non-finite values holds its scale,
                                      until n >= max_consecutive_skips: then every group
                                      backs off
        s_k    = s_k + blind_jump     if nothing was measured (all of it flushed to zero);
                 blind_jump = floor(log2(u_max) - margin - log2(u_min) - 1), which cannot
                 overflow what was below u_min / 2
        s_k    = clip(s_k, log2(min_scale), log2(max_scale))

  The scales used in a step are one step old (delayed scaling, as Transformer Engine's
  amax history): a module applied twice must use the same scale in both backward
  passes, which a scale computed inside each backward pass cannot guarantee. ``margin``
  covers the staleness. An overflow skips the step and backs off the groups that saw
  non-finite values.

``groups="global"`` is the same method with one group: every point measures at the root
scale (no conversions), giving one statistics-driven global scale, the baseline that
isolates what per-layer scales add.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.scipy.special import erfinv

from adaloss_jax import _formats, _points, _policies, _stream, _transforms, _validation
from adaloss_jax._points import _HIST_BELOW, _NBINS, pow2
from adaloss_jax._policies import LossScaleState

ROOT = ""

@dataclasses.dataclass(frozen=True)
class AdaptiveScale:
    """Configuration of adaptive per-layer loss scaling.

    Attributes:
      statistic: ``"amax"`` (largest scale that keeps each group ``margin`` binades below
        overflow), ``"gaussian"`` (the reference's rule: the smallest scale, at least 1,
        that keeps the underflow share of a zero-mean normal model under ``threshold``,
        capped by the amax rule) or ``"quantile"`` (the smallest scale that keeps at
        most ``threshold`` of the non-zero cotangents measured for the group below
        ``2 u_min``, counted exactly from a per-binade histogram, capped by the amax
        rule; the lowest binade is kept clear because values rounded up from below
        ``u_min`` land there, so more than ``threshold`` there means a cut-off tail and
        the amax rule alone applies; costs a scatter-add pass over every measured
        cotangent). Gradients are far from normal, so "gaussian" flushes more than
        "amax"; "quantile" buys headroom rather than quality; hence "amax" is the
        default (measurements: docs/results.md).
      threshold: ``T``, the tolerated underflow share for ``"gaussian"`` and
        ``"quantile"``.
      interval: ``F``: recompute the scales from statistics only on steps where the
        applied steps so far are a multiple of ``F`` (the reference's update every ``F``
        iterations), holding them in between. An overflow still backs the groups that
        overflowed off at once, and a group whose cotangents all flushed still jumps.
        The statistics are measured every step anyway (they carry the overflow check),
        so this saves no time; it only makes the scales move less often.
      margin: binades kept free below the format's max (headroom for a one-step-old
        scale). Default (``None``): 4, or 2 for a format spanning fewer than 30 binades
        (fp8 e4m3fn's 18), where 4 costs too much of the range (docs/results.md).
      decay: the amax the amax rule uses is a held peak that sinks by ``decay`` binades a
        step (``held = max(amax, held_prev - decay)``), so a scale rises slowly after a
        spike while a larger amax lowers it at once: headroom for gradients that jump
        between steps, which a narrow format's small margin cannot give. ``math.inf``:
        this step's amax alone. Default (``None``): 1/16 with ``groups="module"``, else
        ``math.inf``.
      grad_dtype: the format cotangents are stored in (``u_min``/``u_max`` come from it).
      groups: ``"global"`` (default: one statistics-driven scale for everything,
        measured at every module boundary) or ``"module"`` (one scale per module that
        owns parameters, persisting along the backward stream). The default and the
        measurements behind it are in docs/results.md.
      initial_scale: scale of every group before the first statistics.
      min_scale / max_scale: bounds, powers of two.
      backoff: binades a group backs off by when its cotangents or gradients overflow.
      max_consecutive_skips: ``K``: after ``K`` skipped steps in a row the state's
        ``health`` says so (:func:`check_health` explains it outside jit); scales that
        cannot move any more (pinned at ``min_scale`` while overflowing, or at
        ``max_scale`` with nothing measured) are flagged at once.
      filter: ``(module_path: tuple[str, ...], module) -> bool``; modules it rejects get
        no scale point: they run in the region around them and their parameters join
        the nearest selected enclosing group (or the root). Default: every module.
      max_depth: scale points go only around calls of modules nested at most this deep
        (a top-level module such as ``"Block_0"`` is at depth 1, ``"Block_0/attn"`` at
        depth 2). A deeper module runs in the region of its enclosing module at that
        depth and, with ``groups="module"``, its parameters are that module's group:
        ``max_depth=1`` gives a transformer one scale per block (and per top-level
        embedding or head), with points only at block boundaries. Fewer points cost
        less to compile and run (docs/results.md, section 5). A block's interior then
        runs at one scale and is measured only through its boundary cotangents and its
        parameter gradients (``margin`` covers what lies between), and a simulated format
        rounds only where cotangents enter a group. A depth that cuts a path where no
        module is called (NNX or Equinox ``layers/0``: ``layers`` is a list) is refused
        at trace time with the depth that works. Default (``None``): every module.
      simulate: round every cotangent to ``grad_dtype`` where it enters a module that
        owns parameters, after its conversion (a *simulation* of fp8 gradients in an
        fp16/fp32 model; values are rounded to the format and kept in the compute
        dtype).

    The reference's two other statistics are left out. Its gradient-times-weight
    statistic models the products a layer's backward GEMM forms, to predict its input
    cotangent before it exists; here that cotangent is measured where it leaves the
    module, at the module's scale, and the rules above use it. Its lognormal model of
    the non-zero ``log|g|`` at the loss boundary estimates the ``T``-quantile of the
    magnitudes from a fitted mean and std; ``"quantile"`` counts that quantile, exactly
    at the binade resolution a power-of-two scale can use, with no model.
    """

    statistic: str = "amax"
    threshold: float = 1e-3
    interval: int = 1
    margin: int | None = None
    grad_dtype: Any = "float16"
    groups: str = "global"
    initial_scale: float = 1.0
    min_scale: float = 2.0**-24
    max_scale: float = 2.0**64
    backoff: int = 4
    max_consecutive_skips: int = 16
    decay: float | None = None
    filter: Callable[[tuple[str, ...], Any], bool] | None = None
    simulate: bool = False
    max_depth: int | None = None

    def __post_init__(self):
        if self.statistic not in ("amax", "gaussian", "quantile"):
            raise ValueError(
                f"statistic={self.statistic!r} is not known; pass 'amax', 'gaussian' or "
                f"'quantile'"
            )
        if self.groups not in ("module", "global"):
            raise ValueError(f"groups={self.groups!r} is not known; pass 'module' or 'global'")
        t = _validation.check_positive_finite("threshold", self.threshold)
        if t >= 1:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold!r}; pass 1e-3")
        _validation.check_int("interval", self.interval, minimum=1)
        if self.margin is None:  # frozen: set the resolved default once
            fmt = self.format
            wide = math.log2(fmt.max / fmt.min_subnormal) >= 30
            object.__setattr__(self, "margin", 4 if wide else 2)
        _validation.check_int("margin", self.margin, minimum=0)
        if self.decay is None:
            # Measured: per-layer scales at depth see gradients jump between steps and
            # need the held peak, in every format (without it a layer's scale climbs
            # straight back after an overflow: docs/results.md section 8); one global
            # scale, set by the largest layer, does not, and the peak only costs it
            # underflow (section 6).
            held = self.groups == "module"
            object.__setattr__(self, "decay", 0.0625 if held else math.inf)
        if not (isinstance(self.decay, int | float) and self.decay > 0):
            raise ValueError(f"decay must be a positive number of binades (or math.inf), "
                             f"got {self.decay!r}")
        _validation.check_int("backoff", self.backoff, minimum=1)
        _validation.check_int("max_consecutive_skips", self.max_consecutive_skips, minimum=1)
        _validation.check_power_of_two("initial_scale", self.initial_scale)
        _validation.check_power_of_two("min_scale", self.min_scale)
        _validation.check_power_of_two("max_scale", self.max_scale)
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"initial_scale={self.initial_scale!r} must lie in [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}]"
            )
        fmt = _formats.float_format(self.grad_dtype, argname="grad_dtype")
        if not fmt.needs_scaling:
            raise ValueError(
                f"grad_dtype={fmt.name} has fp32's exponent range and needs no loss scaling; "
                f"use adaloss_jax.no_scaling() (or bf16 without a scaler)"
            )
        _validation.check_bool("simulate", self.simulate)
        if self.max_depth is not None:
            _validation.check_int("max_depth", self.max_depth, minimum=1)
        if self.filter is not None and not callable(self.filter):
            raise TypeError(
                f"filter must be a callable (module_path, module) -> bool, got {self.filter!r}"
            )

    @property
    def format(self) -> _formats.FloatFormat:
        return _formats.float_format(self.grad_dtype)

    def group_of(self, module_path: tuple[str, ...]) -> str:
        return ROOT if self.groups == "global" else "/".join(module_path[:self.max_depth])


def adaptive(**kwargs) -> AdaptiveScale:
    """Builds an :class:`AdaptiveScale` (keyword arguments as its attributes; the
    signature shown by ``help`` and IDEs is :class:`AdaptiveScale`'s).

    >>> adaptive(statistic="gaussian", threshold=1e-3).margin
    4
    """
    return AdaptiveScale(**kwargs)


adaptive.__signature__ = inspect.signature(AdaptiveScale).replace(
    parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                for p in inspect.signature(AdaptiveScale).parameters.values()],
    return_annotation="AdaptiveScale")


class GroupVector(Mapping):
    """One value per scale group, held as one array: ``v["Dense_0"]`` reads a group's
    value, iteration gives the group names (a read-only ``Mapping``).

    A pytree with one leaf, ``array`` (the names are static). The fields that only
    :func:`adaptive_unscale` reads, and reads for all groups at once, are held this
    way: as ``{group: scalar}`` every group's value is an output of the compiled step
    of its own, a kernel that XLA compiles separately for each group (its index in the
    vector differs; docs/results.md section 5). The scales stay ``{group: scalar}``: the
    backward pass reads them one by one, and a read from a vector at a constant index
    makes each reading kernel unique instead.
    """

    __slots__ = ("names", "array")

    def __init__(self, names, values):
        self.names = tuple(names)
        self.array = values

    def _index(self, name):
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(name) from None

    def __getitem__(self, name):
        return self.array[self._index(name)]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)

    def __repr__(self):
        return f"GroupVector(names={self.names!r}, array={self.array!r})"

    def take(self, names) -> jax.Array:
        """The values of ``names``, in that order, as one vector."""
        names = tuple(names)
        if names == self.names:
            return jnp.asarray(self.array)
        return jnp.asarray(self.array)[jnp.asarray([self._index(g) for g in names], jnp.int32)]

    def replace(self, names, values) -> GroupVector:
        """A copy with the groups ``names`` set to ``values`` (a vector in that order)."""
        names = tuple(names)
        if names == self.names:
            return GroupVector(self.names, values)
        idx = jnp.asarray([self._index(g) for g in names], jnp.int32)
        return GroupVector(self.names, jnp.asarray(self.array).at[idx].set(values))


jax.tree_util.register_pytree_with_keys(
    GroupVector,
    lambda v: (((jax.tree_util.GetAttrKey("array"), v.array),), v.names),
    lambda names, children: GroupVector(names, children[0]),
    flatten_func=lambda v: ((v.array,), v.names),
)


class AdaptiveScaleState(NamedTuple):
    """State of :func:`adaptive_unscale`.

    Attributes:
      base: a :class:`LossScaleState`: ``loss_scale`` is the root scale (the one the loss
        is multiplied by) and its counters count applied and skipped steps exactly as the
        global scalers do.
      log2_scales: ``{group: fp32 scalar}``, ``s_k`` of each group.
      log2_amax: a :class:`GroupVector` (reads as ``{group: fp32 scalar}``), ``log2`` of
        the group's unit-scale amax at the last step (``-inf`` when nothing was measured).
      overflowed: a :class:`GroupVector` (reads as ``{group: bool}``), whether the group
        was non-finite at the last step.
      health: int32 bit set, 0 when all is well: ``HEALTH_SKIPPING`` (at least
        ``max_consecutive_skips`` skipped steps in a row), ``HEALTH_PINNED_LOW`` (a group
        overflowed at ``min_scale``: backing off cannot help), ``HEALTH_NOTHING_MEASURED``
        (a group measured nothing at ``max_scale``: its gradients are zero, or the loss
        does not reach it). :func:`check_health` explains the bits (outside jit).
      structure: ``{fingerprint: 0}``: the fingerprint (in the tree structure, so it is
        known at trace time) of the parameter paths and shapes the state was built for;
        gradients, statistics or parameters of another model are refused.
      slots: ``{group: int32 scalar}``, each group's index in the groups' natural order
        (fixed at ``init``). The update computes every group's new scale at once, in one
        vector, and gives each group's scale out as the element at its slot: an index
        held as data makes these reads one compiled kernel, where indices known at trace
        time made one kernel per group (docs/results.md, section 5).
    """

    base: LossScaleState
    log2_scales: dict
    log2_amax: GroupVector
    overflowed: GroupVector
    health: jax.Array
    structure: dict = {}  # never mutated
    slots: dict = {}  # never mutated


HEALTH_SKIPPING, HEALTH_PINNED_LOW, HEALTH_NOTHING_MEASURED = 1, 2, 4


class ScaleStats(NamedTuple):
    """What the backward pass measured, per active group (``{group: value}``), handed by
    :func:`adaptive_value_and_grad` to :func:`adaptive_unscale` as ``scale_stats``.

    Attributes:
      log2_scales: the scale each group's gradients were computed at (the one they are
        unscaled by).
      amax: the largest measured cotangent magnitude at the group's scale (inf if a
        value was not finite), in units of ``grad_dtype``: a value held in a wider format
        (the compute dtype between groups, when ``simulate`` rounds only where
        cotangents enter a group) counts ``u_max / u_max(its format)`` times less.
      bad: whether an overflow started at the group's scale: a conversion into a region
        it anchors overflowed, or a value arrived there too large for its format, or
        non-finite values left such a region while everything that flowed into it was
        finite. Values that were already non-finite when they arrived (propagated from
        where the overflow started) blame nobody, so only the groups that overflowed back
        off.
      nonfinite: whether any measured value or conversion was not finite (the step is
        skipped).
      sumsq / count: sum of squares and element count (the gaussian rule; zero under
        the others, which do not measure them).
      hist: per-binade histogram at the group's scale (``statistic="quantile"``), or
        ``{}``.
      structure: ``{fingerprint: 0}`` of the parameters the statistics were measured for
        (see :class:`AdaptiveScaleState`); ``{}`` skips the check.
    """

    log2_scales: dict
    amax: dict
    bad: dict
    sumsq: dict
    count: dict
    hist: dict
    nonfinite: jax.Array
    structure: dict = {}  # never mutated


# --------------------------------------------------------------------------- groups


_key_name = _points.key_name


def _strip_collection(path: tuple[str, ...]) -> tuple[str, ...]:
    return path[1:] if path and path[0] == "params" else path


def _leaf_paths(tree) -> list[tuple[str, ...]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    paths = []
    for p, _ in flat:
        # An NNX Variable flattens to its ``.value`` attribute: not part of the name.
        if p and isinstance(p[-1], jax.tree_util.GetAttrKey) and p[-1].name == "value":
            p = p[:-1]
        paths.append(_strip_collection(tuple(_key_name(k) for k in p)))
    return paths


def _fingerprint(tree) -> str:
    """A short hash of a parameter tree's leaf paths and shapes (not dtypes: fp32 master
    parameters and fp16 gradients match)."""
    import hashlib

    shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree_util.tree_leaves(tree)]
    text = repr(list(zip(_leaf_paths(tree), shapes)))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _check_structure(state_structure: dict, tree, what: str, fix: str) -> None:
    """Trace-time refusal of ``tree`` (or a fingerprint) from another model."""
    if not state_structure:  # a state from before fingerprints, or hand-made statistics
        return
    expected = next(iter(state_structure))
    got = tree if isinstance(tree, str) else _fingerprint(tree)
    if got != expected:
        raise ValueError(
            f"{what} belong to another model than this optimizer state (parameter paths or "
            f"shapes differ: fingerprint {got} != {expected}); {fix}"
        )


def _natural(name: str):
    """Sort key that puts ``Dense_2`` before ``Dense_10``."""
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _owner_paths(params, max_depth: int | None = None) -> set[tuple[str, ...]]:
    """The module paths that own leaves directly (the top level's own leaves excluded),
    cut at ``max_depth`` (a deeper module's leaves are its enclosing module's there)."""
    return {p[:-1][:max_depth] for p in _leaf_paths(params) if len(p) > 1}


def param_groups(params, scaler: AdaptiveScale) -> list[str]:
    """The scale groups of a parameter tree: the root and, with ``groups="module"``, every
    module that owns parameters directly (or through modules deeper than
    ``max_depth``), in natural order."""
    groups = {ROOT} | {scaler.group_of(o) for o in _owner_paths(params)}
    return sorted(groups, key=_natural)


def _leaf_group(path: tuple[str, ...], active: set[str], scaler: AdaptiveScale) -> str:
    owner = path[:-1]
    for i in range(len(owner), 0, -1):
        g = scaler.group_of(owner[:i])
        if g in active:
            return g
    return ROOT


# ----------------------------------------------------------------------- the grad helper


def _selector(scaler: AdaptiveScale, owners: set[tuple[str, ...]],
              deep: set | None = None) -> Callable:
    """``(path, module) -> "group" | "measure" | None`` for :class:`_points.Points`: a
    module that owns parameters (``owners``: cut at ``max_depth``) is a group, any other
    call is measured and cut, and a module deeper than ``max_depth`` (its path is added
    to ``deep``) or rejected by the filter gets no point."""

    def selects(path, module):
        if scaler.max_depth is not None and len(path) > scaler.max_depth:
            if deep is not None:
                deep.add(path)
            return None
        if scaler.filter is not None and module is not None and not scaler.filter(path, module):
            return None
        return "group" if path in owners else "measure"

    return selects


def _point_config(scaler: AdaptiveScale) -> _points.PointConfig:
    hist_lo = None
    if scaler.statistic == "quantile":
        hist_lo = scaler.format.min_exponent - _HIST_BELOW
    return _points.PointConfig(convert=False, measure=True, sumsq=scaler.statistic == "gaussian",
                               y_max=scaler.format.max, x_max=scaler.format.max,
                               hist_lo=hist_lo)


class _Analysis(NamedTuple):
    plan: _stream.Plan
    active: frozenset  # groups in use: the root and the selected owners
    owners: tuple  # group of each parameter leaf
    rows: tuple  # (y anchors, x anchors) of each statistics row, in point order


def _rows(plan: _stream.Plan) -> tuple:
    rows = []
    for pp in plan.points:
        if pp.x is None:
            continue
        for xa, ya in dict.fromkeys(zip(pp.x, pp.y)):
            rows.append((ya, xa))
    return tuple(rows)


def _structure_key(params, args, kwargs) -> tuple:
    """What the plan depends on: tree structures, shapes and dtypes, and the values of
    non-array arguments (flags such as ``train=True``)."""

    def leaf_key(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)))
        try:
            hash(x)
            return ("v", x)
        except TypeError:
            return ("id", id(x))

    out = []
    for tree in (params, args, kwargs):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        out.append((treedef, tuple(leaf_key(x) for x in leaves)))
    return tuple(out)


def _front_end_hooks() -> list:
    """Context-manager factories ``hook(points)`` that make a framework report its module
    calls to ``points``: linen's method interception when flax is installed."""
    try:
        from adaloss_jax.flax import _linen_hook
    except ImportError:  # no flax: scale_group() is the way in
        return []
    return [_linen_hook.intercept]


class _Hooks:
    def __init__(self, hooks, points):
        self.cms = [h(points) for h in hooks]

    def __enter__(self):
        for cm in self.cms:
            cm.__enter__()

    def __exit__(self, *exc):
        for cm in reversed(self.cms):
            cm.__exit__(*exc)


def _analyse(fun, scaler, hooks, has_aux, params, args, kwargs) -> _Analysis:
    """Traces the loss once with recording points and plans where conversions go."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    paths = _leaf_paths(params)
    owner_paths = _owner_paths(params, scaler.max_depth)
    deep: set = set()
    points = _points.Points(_point_config(scaler), _selector(scaler, owner_paths, deep))

    def rec(lv):
        lv = _points.record_params(list(lv))
        points.given(lv, paths)
        with points, _Hooks(hooks, points):
            out = fun(jax.tree_util.tree_unflatten(treedef, lv), *args, **kwargs)
        return jnp.asarray(out[0] if has_aux else out)

    closed = jax.make_jaxpr(rec)(leaves)
    group_calls = {"/".join(c.path) for c in points.calls if c.group}
    if scaler.groups == "module":
        if not points.reported:
            raise ValueError(
                "groups='module' found no module call inside the loss function: call the "
                "model inside it (model.apply(...) for linen, the model for NNX with "
                "adaloss_jax.flax.nnx_adaptive_value_and_grad, for Equinox with "
                "adaloss_jax.equinox.eqx_adaptive_value_and_grad), or mark layer functions "
                "with adaloss_jax.scale_group(name) (pure JAX), or use groups='global'"
            )
        if not group_calls and scaler.filter is not None:
            raise ValueError(
                f"the filter {scaler.filter!r} selected no module that owns parameters: "
                f"no scale group was formed; pass a filter that accepts at least one module "
                f"(or filter=None for all)"
            )
        if not group_calls:
            calls = sorted({"/".join(c.path) or "(root)" for c in points.calls})[:4]
            owned = sorted("/".join(o) for o in owner_paths)[:4]
            raise ValueError(
                f"no module call matched a module that owns parameters (calls: {calls}; "
                f"parameters owned by: {owned}): no scale group was formed. Apply the model "
                f"to the parameters the loss is given, or to a sub-tree of them "
                f"(model.apply({{'params': params['student']}}, ...) is found by the identity "
                f"of its leaves; parameters rebuilt or cast before the call are not)"
            )
    uncut = sorted({"/".join(p[:scaler.max_depth]) for p in deep}
                   - {"/".join(c.path) for c in points.calls})
    if uncut:  # every module under it would run unmeasured (and, per module, ungrouped)
        k = scaler.max_depth
        raise ValueError(
            f"max_depth={k}: modules under {uncut[:4]} are called, but {uncut[0]!r} itself "
            f"is no module call (a list or dict of modules?), so no scale point would go "
            f"around them (and with groups='module' their parameters would get no group of "
            f"their own); pass max_depth={k + 1} (paths count every component, a list index "
            f"included), or a filter"
        )
    narrow = {jnp.dtype(jnp.float16), jnp.dtype(scaler.format.dtype)}
    if points.calls and not points.dtypes & narrow:
        _policies.notice_once(
            "wide-model",
            f"adaloss_jax: no float16 value crossed a module boundary (saw "
            f"{sorted(d.name for d in points.dtypes)}): bf16/fp32 compute needs no loss "
            f"scaling; adaloss_jax.no_scaling() (or no scaler) does the same for less",
        )
    active = frozenset({ROOT} | (group_calls if scaler.groups == "module" else set()))
    owners = tuple(_leaf_group(p, active, scaler) for p in paths)
    if scaler.groups == "global":
        root = (ROOT,)
        plan = _stream.Plan(
            tuple(_stream.PointPlan((root,) * n, (root,) * n) for n in points.sizes),
            tuple(root for _ in _points.param_owners_for(leaves, owners)),
        )
    else:
        plan = _stream.analyse(closed.jaxpr, points.sizes,
                               _points.param_owners_for(leaves, owners),
                               keep=frozenset(points.rounding if scaler.simulate else ()))
    return _Analysis(plan, active, owners, _rows(plan))


def _anchor_scales(log2: dict, pairs) -> tuple[dict, dict]:
    """The log2 scale of every anchor set (the min over it) and the ratio of every
    ``(x, y)`` pair, built once per step outside the model (a value built inside a
    lifted transform such as ``nn.scan`` must not leak out of it).

    A set's min is computed once (:func:`_transforms.min_once`) from the largest smaller
    set already computed inside it and the groups it adds: along a residual stream the
    anchor sets grow by a block's groups per layer, so each layer's min has the same
    shape (compiled once) instead of a chain over every group below it, copied by XLA
    into each consumer and different in every layer.
    """
    sigma: dict = {}
    for a in sorted({a for pair in pairs for a in pair}, key=len):
        if len(a) == 1:
            sigma[a] = log2[a[0]]
            continue
        inner = max((t for t in sigma if 1 < len(t) < len(a) and set(t) <= set(a)),
                    key=len, default=())
        sigma[a] = _transforms.min_once(
            ([sigma[inner]] if inner else []) + [log2[g] for g in a if g not in inner])
    # S_x / S_y as a quotient of the two powers of two: exact, and XLA computes a
    # division once, as its own small kernel, where it would copy ``pow2(sx - sy)`` into
    # every kernel that converts a cotangent. Those kernels then differ only in the
    # buffer they read the ratio from, and identical kernels (one per layer) are
    # compiled once: compile time stays linear in depth. Each set's power of two is
    # built once: a set sits on one side of several pairs, and every op traced here is
    # one more op for XLA's passes to visit before they merge the copies.
    converted = dict.fromkeys(a for x, y in pairs if x != y for a in (x, y))
    scale = {a: pow2(sigma[a]) for a in converted}
    ratios = {(x, y): scale[x] / scale[y] for x, y in pairs if x != y}
    return sigma, ratios


def _shift_hist(hist: jax.Array, k) -> jax.Array:
    """A binade histogram seen at a scale ``2**k`` times larger (end bins keep
    everything beyond them)."""
    nb = hist.shape[-1]
    c = jnp.concatenate([jnp.zeros((1,), hist.dtype), jnp.cumsum(hist)])
    j = jnp.arange(1, nb)
    inner = c[jnp.clip(j - k.astype(jnp.int32), 0, nb)]
    c2 = jnp.concatenate([jnp.zeros((1,), hist.dtype), inner, c[-1:]])
    return jnp.diff(c2)


def _combine(an: _Analysis, row_stats: list, limits: list, log2: dict, sigma: dict,
             scaler: AdaptiveScale) -> ScaleStats:
    """Per-point statistics rows -> per-group statistics at each group's scale; amax is
    taken relative to the largest value of the format that holds it (``limits``).

    Vectorised over rows with static index arrays (a handful of ops whatever the model's
    size: compile time stays flat in depth).
    """
    groups = sorted(an.active, key=_natural)
    gi = {g: i for i, g in enumerate(groups)}
    sets = sorted({r[0] for r in an.rows} | {r[1] for r in an.rows})
    si = {a: i for i, a in enumerate(sets)}
    ng, ns = len(groups), len(sets)
    fmt_max = scaler.format.max
    used = {g: log2[g] for g in groups}
    if not an.rows:
        z = {g: jnp.zeros((), jnp.float32) for g in groups}
        hist = {g: jnp.zeros((_NBINS,), jnp.float32) for g in groups} if (
            scaler.statistic == "quantile") else {}
        return ScaleStats(used, z, {g: jnp.asarray(False) for g in groups}, z, z, hist,
                          jnp.asarray(False))
    m = jnp.stack(row_stats)
    amax_col = m[:, _points._AMAX]  # a NaN reads as inf (see _points._stats)
    m = m.at[:, _points._AMAX].set(jnp.where(jnp.isnan(amax_col), jnp.inf, amax_col))
    # Attributions: each row counts for every group anchoring either of its sides, at
    # that group's scale (the row was measured at the scale of its y side).
    e_row, e_grp, e_set, e_lim = [], [], [], []
    for r, ((ya, xa), (y_max, x_max)) in enumerate(zip(an.rows, limits)):
        for g in dict.fromkeys(ya + xa):
            lim = min(y_max if g in ya else math.inf, x_max if g in xa else math.inf)
            e_row.append(r)
            e_grp.append(gi[g])
            e_set.append(si[ya])
            e_lim.append(fmt_max / lim)
    e_row, e_grp, e_set = (jnp.asarray(v, jnp.int32) for v in (e_row, e_grp, e_set))
    log2_vec = jnp.stack([log2[g] for g in groups])
    sigma_vec = jnp.stack([sigma[a] for a in sets])
    k = log2_vec[e_grp] - sigma_vec[e_set]
    f = pow2(k)
    # A row written n times (a point in a loop) holds a sum of n maxima: an upper bound
    # of their max, kept as it is (the scale errs low, never into overflow).
    a = m[e_row, _points._AMAX] * jnp.asarray(e_lim, jnp.float32) * f
    amax_v = jnp.maximum(jax.ops.segment_max(a, e_grp, ng), 0.0)
    gaussian = scaler.statistic == "gaussian"
    if gaussian:
        sumsq_v = jax.ops.segment_sum(m[e_row, _points._SUMSQ] * f * f, e_grp, ng)
        count_v = jax.ops.segment_sum(m[e_row, _points._COUNT], e_grp, ng)
    else:  # only the gaussian rule reads them
        sumsq_v = count_v = jnp.zeros((ng,), jnp.float32)
    hist = {}
    if scaler.statistic == "quantile":
        h = jax.vmap(_shift_hist)(m[e_row, _points.hist_start(gaussian):], k)
        hist_v = jax.ops.segment_sum(h, e_grp, ng)
        hist = {g: hist_v[i] for g, i in gi.items()}

    # Overflow blame per anchor set (rows by their sides' sets).
    amax_r = m[:, _points._AMAX]
    bad_y = m[:, _points._BAD_Y] > 0
    bad_x = m[:, _points._BAD_X] > 0
    inf_y = ~(amax_r < jnp.inf)
    y_set = jnp.asarray([si[r[0]] for r in an.rows], jnp.int32)
    x_set = jnp.asarray([si[r[1]] for r in an.rows], jnp.int32)
    conv = jnp.asarray([r[0] != r[1] for r in an.rows])
    any_of = lambda v, idx: jax.ops.segment_max(v.astype(jnp.int32), idx, ns) > 0
    blame = any_of(bad_y & ~inf_y, y_set) | any_of(conv & bad_x & ~bad_y, x_set)
    left_inf = any_of(inf_y, y_set)
    arrived_bad = any_of(conv & (bad_x | bad_y), x_set)
    # Non-finite values left a region although all that came in was finite: the
    # overflow started inside it.
    started = blame | (left_inf & ~arrived_bad)
    p_set, p_grp = [], []
    for a_set in sets:
        for g in a_set:
            p_set.append(si[a_set])
            p_grp.append(gi[g])
    bad_v = jax.ops.segment_max(started[jnp.asarray(p_set)].astype(jnp.int32),
                                jnp.asarray(p_grp), ng) > 0
    nonfinite = jnp.any(bad_y | bad_x)
    pick = lambda v: {g: v[i] for g, i in gi.items()}
    return ScaleStats(used, pick(amax_v), pick(bad_v), pick(sumsq_v), pick(count_v), hist,
                      nonfinite)


def adaptive_value_and_grad(
    fun: Callable[..., Any],
    scaler: AdaptiveScale | None = None,
    has_aux: bool = False,
    *,
    hooks: list | None = None,
    cache_token: Any = None,
) -> Callable[..., tuple[Any, Any, ScaleStats]]:
    """Like ``jax.value_and_grad(fun)`` with per-layer scale points inserted.

    ``fun(params, *args, **kwargs)`` calls the model: a linen model's ``apply`` (any
    number of times), or functions marked with :func:`scale_group`. Returns
    ``g(opt_state, params, *args, **kwargs) -> (value, grads, stats)``: the unscaled
    loss (or ``(loss, aux)``), the *scaled* parameter gradients and the
    :class:`ScaleStats`; pass both to the optimizer as
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)``.

    The program's structure is analysed once per ``fun``, scaler and structure of
    ``(params, args, kwargs)`` (a trace of ``fun`` with recording points), and cached
    for the process: a second ``jit`` of the same step does not repeat it.
    ``hooks`` (advanced): context-manager factories ``hook(points)`` that make a
    framework report its module calls; default: linen's, when flax is installed.
    ``cache_token`` (advanced): what identifies ``fun`` in that cache (default ``fun``).
    """
    scaler = AdaptiveScale() if scaler is None else scaler
    _check_scaler(scaler)
    hooks = _front_end_hooks() if hooks is None else list(hooks)
    token = fun if cache_token is None else cache_token
    try:
        plans = _PLANS.setdefault((token, scaler, has_aux), {})
    except TypeError:  # an unhashable filter or token: cache on this helper only
        plans = {}

    def wrapped(opt_state, params, *args, **kwargs):
        state = adaptive_state(opt_state)
        log2 = state.log2_scales
        _check_structure(state.structure, params, "the parameters",
                         "pass the optimizer state built by tx.init for these parameters")
        key = _structure_key(params, args, kwargs)
        an = plans.get(key)
        if an is None:
            an = plans[key] = _analyse(fun, scaler, hooks, has_aux, params, args, kwargs)
        missing = sorted(set(an.active) - set(log2), key=_natural)
        if missing:
            raise ValueError(
                f"the model has scale groups {missing[:5]} that the optimizer state does not "
                f"know (state groups: {sorted(log2, key=_natural)[:8]}...); the state was "
                f"built for another model: re-run tx.init(params) for this one"
            )
        pairs = {(x, y) for pp in an.plan.points if pp.x is not None
                 for x, y in zip(pp.x, pp.y)}
        pairs |= {((o,), u) for o, u in zip(_points.param_owners_for(
            jax.tree_util.tree_leaves(params), an.owners), an.plan.params) if u is not None}
        # Sorted: every process of a multi-controller run must trace the same program,
        # and set order follows each process's string hash seed.
        sigma, ratios = _anchor_scales(log2, sorted(pairs))
        leaves, treedef = jax.tree_util.tree_flatten(params)
        paths = _leaf_paths(params)
        cfg = _point_config(scaler)
        width = _points.width(cfg.sumsq, cfg.hist_lo is not None)
        dummies = [jnp.zeros((width,), jnp.float32) for _ in an.rows]
        owner_paths = _owner_paths(params, scaler.max_depth)
        sim = scaler.format.dtype if scaler.simulate else None
        limits: list = []

        def scaled(lv, dummies):
            lv = _points.convert_params(list(lv), list(an.owners), an.plan.params, ratios)
            points = _points.Points(cfg, _selector(scaler, owner_paths), plan=an.plan,
                                    ratios=ratios, simulate=sim, dummies=dummies)
            points.given(lv, paths)
            with points, _Hooks(hooks, points):
                out = fun(jax.tree_util.tree_unflatten(treedef, lv), *args, **kwargs)
            limits[:] = points.limits
            if points.count != len(an.plan.points):
                raise ValueError(
                    f"adaloss_jax: the loss function made {points.count} module calls where "
                    f"the analysed trace made {len(an.plan.points)}; it must trace the same "
                    f"way each time for the same input structure"
                )
            loss, aux = out if has_aux else (out, None)
            loss32 = jnp.asarray(loss).astype(jnp.float32)
            return loss32 * pow2(log2[ROOT]), (loss, aux)

        (_, (loss, aux)), (g_leaves, row_stats) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True
        )(leaves, dummies)
        grads = jax.tree_util.tree_unflatten(treedef, g_leaves)
        stats = _combine(an, row_stats, limits, log2, sigma, scaler)
        stats = stats._replace(structure={_fingerprint(params): jnp.zeros((), jnp.int8)})
        return ((loss, aux) if has_aux else loss), grads, stats

    wrapped.plans = plans
    return wrapped


# (fun, scaler, has_aux) -> {structure: _Analysis}; plans depend only on these.
_PLANS: dict = {}


def adaptive_state(opt_state: Any) -> AdaptiveScaleState:
    """Finds the one :class:`AdaptiveScaleState` inside an optimizer state."""
    return _transforms.find_one(
        opt_state,
        AdaptiveScaleState,
        "optax.chain(adaloss_jax.adaptive_unscale(scaler), adaloss_jax.skip_nonfinite(inner))",
    )


def _check_scaler(scaler) -> None:
    if not isinstance(scaler, AdaptiveScale):
        raise TypeError(
            f"scaler must be an AdaptiveScale from adaloss_jax.adaptive(), got {scaler!r} "
            f"of type {type(scaler).__name__}"
        )


# ------------------------------------------------------------------------- optax side


def _reduce(x, op, axis_name):
    return x if axis_name is None else op(x, axis_name)


def adaptive_unscale(
    scaler: AdaptiveScale | None = None, *, axis_name: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """Unscales each parameter leaf by its own group's scale and updates the scales.

    Use as ``optax.chain(adaptive_unscale(), inner)`` (a skipped step gives ``inner`` a
    zero gradient) or, to skip exactly, :func:`adaptive_scaled` ``(inner)``, and call
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with the
    outputs of :func:`adaptive_value_and_grad` (with the same ``scaler``; default
    ``AdaptiveScale()``). Skips are decided and signalled exactly as in
    :func:`adaloss_jax.unscale`; the scale rule is in this module's docstring.
    ``scale_stats`` is required: without it nothing says which scale each gradient was
    computed at, so the update is refused at trace time.
    """
    scaler = AdaptiveScale() if scaler is None else scaler
    _check_scaler(scaler)
    fmt = scaler.format
    log2_max = math.log2(fmt.max)
    lo, hi = math.log2(scaler.min_scale), math.log2(scaler.max_scale)
    s0 = math.log2(scaler.initial_scale)
    blind_jump = math.floor(log2_max - scaler.margin - math.log2(fmt.min_subnormal) - 1)
    # -log2(sqrt(2) * erfinv(T)) + log2(u_min): the gaussian rule's constant part.
    gauss_c = math.log2(fmt.min_subnormal) - math.log2(
        math.sqrt(2.0) * float(erfinv(jnp.float32(scaler.threshold)))
    )
    e_min = fmt.min_exponent
    hist_lo = e_min - _HIST_BELOW

    def _quantile_rule(hist, s_g, axis_name):
        """The quantile rule's scale per group (``+inf`` where it has no answer), from
        the groups' histograms ``hist`` (one row each) and scales ``s_g``."""
        hist = _reduce(hist, jax.lax.psum, axis_name)
        zero = jnp.zeros(hist.shape[:-1] + (1,), jnp.float32)
        below = jnp.concatenate([zero, jnp.cumsum(hist, axis=-1)], axis=-1)
        total = below[..., -1]
        # below[j] counts values under 2**(hist_lo + j) (at the group's scale s_g); the
        # largest j with below[j] <= T * n puts binade k at 2 u_min.
        k = hist_lo + jnp.sum(below <= scaler.threshold * total[..., None], axis=-1) - 1
        s_q = (s_g + e_min + 1 - k).astype(jnp.float32)
        # k == e_min: more than T of the values sit in the lowest binade the format
        # holds, where values rounded up from below u_min land and under which flushed
        # ones vanish: the tail is cut off by an unknown amount, so no answer (the amax
        # rule alone sets the scale and the next step measures the whole tail).
        return jnp.where((total > 0) & (k != e_min), s_q, jnp.inf)

    def init_fn(params):
        if not jax.tree_util.tree_leaves(params):
            raise ValueError(
                "params has no leaves: adaptive_unscale keys its scale groups by the modules "
                "that own parameters; pass the model's parameters to tx.init"
            )
        groups = param_groups(params, scaler)
        f32 = lambda v: jnp.asarray(v, jnp.float32)
        return AdaptiveScaleState(
            base=_policies._initial_state(scaler.initial_scale, 1),
            log2_scales={g: f32(s0) for g in groups},
            log2_amax=GroupVector(groups, jnp.full((len(groups),), -jnp.inf, jnp.float32)),
            overflowed=GroupVector(groups, jnp.zeros((len(groups),), jnp.bool_)),
            health=jnp.zeros((), jnp.int32),
            structure={_fingerprint(params): jnp.zeros((), jnp.int8)},
            slots={g: jnp.asarray(i, jnp.int32)
                   for i, g in enumerate(sorted(groups, key=_natural))},
        )

    def update_fn(updates, state, params=None, *, loss=None, scale_stats=None, **extra):
        del params, extra
        if not isinstance(scale_stats, ScaleStats):
            raise ValueError(
                "adaptive_unscale needs scale_stats=... (got "
                f"{type(scale_stats).__name__}): the statistics that "
                "adaloss_jax.adaptive_value_and_grad returns with the scaled gradients, as in "
                "tx.update(grads, opt_state, params, loss=loss, scale_stats=stats). Gradients "
                "of an unscaled loss (plain jax.grad) need no adaptive_unscale; for a stock "
                "flax TrainState use adaloss_jax.flax.TrainState and train_step"
            )
        log2 = state.log2_scales
        used = scale_stats.log2_scales
        _check_structure(state.structure, updates, "the gradients",
                         "pass the gradients of the parameters tx.init was called with, or "
                         "re-run tx.init(params) for this model")
        if scale_stats.structure:
            _check_structure(state.structure, next(iter(scale_stats.structure)),
                             "the scale_stats", "pass the statistics adaptive_value_and_grad "
                             "returned for this model with this optimizer state")
        if set(state.slots) != set(log2):
            raise ValueError(
                "the adaptive scaler's state has no slot for some of its groups (a state "
                "saved by an older adaloss_jax, or built by hand): re-run tx.init(params) "
                "and restore checkpoints into that state's structure"
            )
        unknown = sorted(set(used) - set(log2), key=_natural)
        if unknown:
            raise ValueError(
                f"scale_stats has groups {unknown[:5]} that this optimizer state does not know "
                f"(state groups: {sorted(log2, key=_natural)[:8]}...); the state was built "
                f"for another model: re-run tx.init(params) for this one"
            )
        active = sorted(used, key=_natural)  # a fixed order: the same program everywhere
        paths = _leaf_paths(updates)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        leaf_groups = [_leaf_group(p, set(active), scaler) for p in paths]

        # Everything per group is computed on vectors over `active` (in that order): one
        # reduction each for the facts that span all groups (the skip decision, the
        # global floor), which XLA computes once. Written per group as chains of scalar
        # ops, XLA copied each chain into every consumer's fusion (every group's new
        # scale, every parameter leaf's skip select): HLO quadratic in depth, and most of
        # the compile time.
        ng = len(active)
        gi = {g: i for i, g in enumerate(active)}

        def vec(d, dtype):
            if not active:
                return jnp.zeros((0,), dtype)
            return jnp.stack([jnp.asarray(d[g]).astype(dtype) for g in active])

        # Per-group amax (at the group's scale) and overflow of the parameter gradients.
        # One read per leaf: non-finite elements enter the max as inf (not max(|x|) alone:
        # XLA's CPU max reduction can drop a NaN), so p_amax is inf iff the group's
        # parameter gradients are not all finite.
        inv = {g: pow2(-used[g]) for g in sorted(set(leaf_groups))}
        out, leaf_max = [], []
        for g, leaf in zip(leaf_groups, leaves):
            x = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
            mag = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.asarray(jnp.inf, x.dtype))
            leaf_max.append(jnp.max(mag, initial=0.0))
            out.append(x * inv[g])
        updates = jax.tree_util.tree_unflatten(treedef, out)
        p_dtype = jnp.result_type(jnp.float32, *(m.dtype for m in leaf_max))
        p_amax = jnp.zeros((ng,), p_dtype)
        if leaf_max:  # a group without leaves keeps 0
            p_amax = jnp.maximum(p_amax, jax.ops.segment_max(
                jnp.stack(leaf_max).astype(p_dtype),
                jnp.asarray([gi[g] for g in leaf_groups], jnp.int32), ng))

        used_v = vec(used, jnp.float32)
        log2_v = vec(log2, jnp.float32)
        prev_amax = state.log2_amax.take(active).astype(jnp.float32)
        # Consecutive overflows back off exponentially harder: backoff * 2**skips_in_a_row,
        # for a group that overflowed at the previous step too. A group blamed for the
        # first time backs off by `backoff` alone, however many steps other groups had
        # skipped: else skips blaming one group after another dropped each newly blamed
        # group by 16 * backoff (docs/results.md section 8).
        repeat = state.overflowed.take(active)
        drop = scaler.backoff * jnp.where(
            repeat, pow2(jnp.minimum(state.base.notfinite_count, 4)), 1.0)
        # Recompute from statistics when the applied steps so far are a multiple of
        # `interval`; backoffs and blind jumps happen on any step.
        recompute = state.base.total_applied % scaler.interval == 0
        p_bad = ~(p_amax < jnp.inf)
        stats_bad = vec(scale_stats.bad, jnp.bool_)
        blamed_any = jnp.any(stats_bad)
        nonfinite = scale_stats.nonfinite | jnp.any(p_bad)
        grads_finite = ~(_reduce(nonfinite.astype(jnp.int32), jax.lax.pmax, axis_name) > 0)
        amax = _reduce(jnp.maximum(vec(scale_stats.amax, jnp.float32), p_amax), jax.lax.pmax,
                       axis_name)
        # The scale one global group would get from this step's amax: on a finite step no
        # group's scale goes below it, so a held peak never flushes more than global would.
        unit_max = jnp.max(jnp.log2(amax) - used_v, initial=-jnp.inf)
        use_floor = grads_finite & (unit_max > -jnp.inf) & (ng > 1)
        if scaler.interval > 1:
            use_floor = use_floor & recompute
        floor_log2 = jnp.where(use_floor, jnp.floor(log2_max - scaler.margin - unit_max), -jnp.inf)
        # Recovery: after max_consecutive_skips skips in a row, blame has not fixed the
        # overflow; every group backs off, as one global scale would.
        escalate = state.base.notfinite_count >= scaler.max_consecutive_skips
        informative = jnp.any(amax > 0)
        # Non-finite gradients that no cotangent statistic explains: their groups.
        bad = stats_bad | (p_bad & ~blamed_any) | (escalate & ~grads_finite)
        bad = _reduce(bad.astype(jnp.int32), jax.lax.pmax, axis_name) > 0
        # A group that only received non-finite values keeps its scale.
        hold = ~bad & ~(amax < jnp.inf)
        unit_log2_amax = jnp.log2(amax) - used_v  # -inf when nothing measured
        if scaler.decay != math.inf:  # a peak held, sinking `decay` binades a step
            unit_log2_amax = jnp.maximum(unit_log2_amax, prev_amax - scaler.decay)
        target = jnp.maximum(jnp.floor(log2_max - scaler.margin - unit_log2_amax), floor_log2)
        if scaler.statistic == "gaussian":
            sumsq = _reduce(vec(scale_stats.sumsq, jnp.float32), jax.lax.psum, axis_name)
            count = _reduce(vec(scale_stats.count, jnp.float32), jax.lax.psum, axis_name)
            unit_log2_sigma = 0.5 * jnp.log2(sumsq / jnp.maximum(count, 1.0)) - used_v
            # The smallest power of two the normal model says is enough (ceil: floor
            # would allow up to 2T), never below 1 (the reference's alpha >= 1).
            under = jnp.maximum(jnp.ceil(gauss_c - unit_log2_sigma), 0.0)
            target = jnp.where(sumsq > 0, jnp.minimum(target, under), target)
        if scaler.statistic == "quantile":
            target = jnp.minimum(target, _quantile_rule(vec(scale_stats.hist, jnp.float32),
                                                        used_v, axis_name))
        # amax == 0: everything flushed (or no gradient at all). Every value was below
        # u_min / 2, so jumping by `blind_jump` binades still cannot overflow.
        grown = jnp.maximum(log2_v + blind_jump, floor_log2)
        if scaler.interval > 1:  # measured scales held between recomputations
            target = jnp.where(recompute, target, log2_v)
        nxt = jnp.where(bad, log2_v - drop, jnp.where(amax > 0, target, grown))
        nxt = jnp.where(hold, log2_v, nxt)
        pinned_low = jnp.any(bad & (log2_v <= lo))
        pinned_high = jnp.any((amax == 0) & (log2_v >= hi))
        new_log2_v = jnp.clip(nxt, lo, hi).astype(jnp.float32)
        new_amax_v = jnp.where(bad | hold, prev_amax, unit_log2_amax).astype(jnp.float32)

        loss_finite = (
            jnp.asarray(True) if loss is None else _transforms.all_finite(loss, axis_name=axis_name)
        )
        # A non-finite loss (forward overflow) is no reason to move any scale.
        new_log2_v = jnp.where(loss_finite, new_log2_v, log2_v)
        # Each group's scale is an output of its own (the backward pass reads them one
        # by one): the element at the group's slot of one vector (see `slots`).
        order = sorted(log2, key=_natural)
        pos = {g: i for i, g in enumerate(order)}
        # (The scatter also keeps the update computed once: XLA does not copy a scatter
        # into its readers.)
        full = jnp.stack([jnp.asarray(log2[g], jnp.float32) for g in order])
        full = full.at[jnp.asarray([pos[g] for g in active], jnp.int32)].set(
            new_log2_v, unique_indices=True)
        new_log2 = {g: jax.lax.dynamic_index_in_dim(full, state.slots[g], keepdims=False)
                    for g in log2}
        new_amax = state.log2_amax.replace(active, new_amax_v)
        new_bad = state.overflowed.replace(active, bad)
        # A step where everything flushed to zero carries no information: skip it (the
        # blind jump above has already raised the scales).
        base = _policies._count(state.base, grads_finite & informative, loss_finite)
        base = base._replace(loss_scale=pow2(new_log2[ROOT]))
        updates = _transforms.signal_skip(updates, base.last_applied)
        health = (
            jnp.where(base.notfinite_count >= scaler.max_consecutive_skips, HEALTH_SKIPPING, 0)
            | jnp.where(pinned_low, HEALTH_PINNED_LOW, 0)
            | jnp.where(pinned_high & ~informative, HEALTH_NOTHING_MEASURED, 0)
        ).astype(jnp.int32)
        return updates, AdaptiveScaleState(base, new_log2, new_amax, new_bad, health,
                                           state.structure, state.slots)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adaptive_scaled(
    inner: optax.GradientTransformation,
    scaler: AdaptiveScale | None = None,
    *,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.chain(adaptive_unscale(scaler), skip_nonfinite(inner))``: the exact skip.

    The literal ``optax.chain(adaptive_unscale(), inner)`` is safe too (a skipped step
    hands ``inner`` a zero gradient, never NaN), but ``inner`` still steps on it: Adam's
    moments decay and its momentum and weight decay move the parameters. Here a skipped
    step leaves the parameters and ``inner``'s state exactly as they were.
    """
    return optax.chain(adaptive_unscale(scaler, axis_name=axis_name),
                       _transforms.skip_nonfinite(inner))


def scale_summary(opt_state: Any) -> dict:
    """The adaptive state as plain Python data for logs (call outside jit), from any
    state a user holds (an optimizer state, a flax ``TrainState``, an ``nnx.Optimizer``
    or its raw ``opt_state``), groups in model order.

    Keys: ``log2_group_scales``, ``log2_unit_amax``, ``overflowed`` (``{group: value}``)
    and ``group_log2_min_med_max`` over the non-root groups (the root if it is alone).
    """
    st = jax.device_get(adaptive_state(opt_state))
    order = sorted(st.log2_scales, key=_natural)  # model order: Dense_2 before Dense_10
    groups = {g: float(st.log2_scales[g]) for g in order}
    vals = sorted(v for g, v in groups.items() if g) or [groups[ROOT]]
    mid = len(vals) // 2
    median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
    return {
        "log2_group_scales": groups,
        "log2_unit_amax": {g: float(st.log2_amax[g]) for g in order},
        "overflowed": {g: bool(st.overflowed[g]) for g in order},
        "group_log2_min_med_max": [vals[0], median, vals[-1]],
    }


def scale_table(opt_state: Any) -> str:
    """The per-group scales and last statistics as a text table (call outside jit)."""
    st = adaptive_state(opt_state)
    lines = [f"{'group':<40} {'log2 scale':>10} {'log2 unit amax':>15} {'overflowed':>10}"]
    for g in sorted(st.log2_scales, key=_natural):
        amax = float(st.log2_amax[g])
        lines.append(
            f"{(g or '(root)'):<40} {float(st.log2_scales[g]):>10.0f} "
            f"{amax:>15.1f} {bool(st.overflowed[g])!s:>10}"
        )
    return "\n".join(lines)


_HEALTH_TEXT = {
    HEALTH_SKIPPING: (
        "{k}+ steps in a row were skipped for non-finite gradients. If the loss is finite, "
        "something non-finite appears in the backward pass at any scale (log or sqrt of 0, "
        "inf * 0, a division by 0): find it with adaloss_jax.check_gradients or "
        "jax.debug_nans; scaling cannot fix it."
    ),
    HEALTH_PINNED_LOW: (
        "a group overflowed at min_scale, so backing it off cannot help: its backward pass "
        "makes non-finite values at any scale, or min_scale is too high for this model; "
        "lower min_scale or fix the non-finite operation."
    ),
    HEALTH_NOTHING_MEASURED: (
        "nothing was measured at max_scale: the gradients are exactly zero (the loss does "
        "not depend on the parameters, or everything is frozen); check that the loss "
        "function returns a loss computed from params."
    ),
}


def check_health(opt_state: Any, *, warn: bool = True) -> list[str]:
    """What the adaptive state's ``health`` bits say, with the fix (call outside jit).

    Returns one message per problem (empty when all is well) and, with ``warn``, issues
    each as a ``RuntimeWarning`` once per process.
    """
    st = adaptive_state(opt_state)
    bits = int(jax.device_get(st.health))
    k = int(jax.device_get(st.base.notfinite_count))
    msgs = [t.format(k=k) for b, t in _HEALTH_TEXT.items() if bits & b]
    if warn:
        for m in msgs:
            if m not in _WARNED:
                _WARNED.add(m)
                warnings.warn(f"adaloss_jax: {m}", RuntimeWarning, stacklevel=2)
    return msgs


_WARNED: set = set()
