"""Adaptive per-layer loss scaling (Zhao et al., arXiv 1910.12385) for Flax linen models.

How it works (all inside one ``jax.jit``):

* **Scale groups** (``groups="module"``) are the modules that own parameters (keyed by
  module path, e.g. ``"Block_0/attn"``), plus the root ``""`` whose scale multiplies the
  loss; with the default ``groups="global"`` there is only the root. Each group
  ``k`` has a power-of-two scale ``S_k = 2**s_k`` kept in fp32 in
  :class:`AdaptiveScaleState`.
* **Scale points** are ``custom_vjp`` identities that ``flax.linen.intercept_methods``
  puts around every call of a selected module, without changing the model. In the
  backward pass, a cotangent entering module ``k`` (at its parent's scale ``S_p``) is
  multiplied by ``S_k / S_p``; a cotangent leaving it through the module's inputs is
  multiplied by ``S_p / S_k``. So every module's internals run at their own scale and
  everything outside it is back at the parent's scale: cotangents that autodiff sums
  (residuals, q/k/v from one input, a module applied twice, a tied embedding used as
  the output head) always meet at one scale, for any graph. Parameters are keyed by
  the module that owns them, so a tied or reused module's gradient contributions are
  all at that module's scale.
* **Statistics** (amax, sum of squares, count and a non-finite flag of each cotangent at
  the scale points; with ``statistic="quantile"`` also a histogram of its non-zero
  elements by binade, ``floor(log2|x|)`` at the group's scale) are returned by the
  backward pass as the cotangents of zero "dummy" inputs, one per module path with a slot
  per call, so ``jax.value_and_grad`` hands them out with no side effects. Module calls
  that are not a group of their own (parameter-free modules, or ones the filter rejects)
  get a measure-only point whose statistics count for the enclosing group.
* :func:`adaptive_unscale` unscales each parameter leaf by its own group's scale (in
  fp32), checks finiteness, skips exactly as :func:`adaloss_jax.unscale` does, and sets
  each group's next scale from this step's statistics::

        amax_k = max(amax of k's scaled cotangents and parameter gradients) / S_k
        s_k    = floor(log2(u_max) - margin - log2(amax_k))           # "amax"
        s_k    = min(s_k, max(0, ceil(log2(u_min / (sqrt(2) erfinv(T) sigma_k)))))  # "gaussian"
        s_k    = min(s_k, min{q : #{|x| 2**q < 2 u_min} <= T * n_k})   # "quantile", x over
                 the n_k non-zero cotangents measured for k (none if the tail is cut off)
        s_k    = s_{k, previous}  on steps where total_applied % interval != 0
        s_k    = s_k - backoff * 2**n if group k overflowed (its statistics are not finite)
                                      after n consecutive skipped steps (n capped at 4)
        s_k    = s_k + blind_jump     if nothing was measured (all of it flushed to zero);
                 blind_jump = floor(log2(u_max) - margin - log2(u_min) - 1), which cannot
                 overflow what was below u_min / 2 (34 binades for fp16)
        s_k    = clip(s_k, log2(min_scale), log2(max_scale))

  The scales used in a step are therefore one step old (delayed scaling, as Transformer
  Engine's amax history). That is required for correctness: a module applied twice must
  use the same scale in both backward passes, which a scale computed inside each
  backward pass cannot guarantee. ``margin`` covers the staleness. An overflow skips
  the step and backs off the groups that saw non-finite values: the one that overflowed
  and those upstream that its non-finite cotangents reached (the groups nearer the loss
  are untouched); the next step's statistics set them all again.

``groups="global"`` (the default) is the same method with one group: every scale point
measures at the root scale (ratio 1, no conversions), giving one statistics-driven global
scale, the baseline that isolates what per-layer scales add (``groups="module"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.scipy.special import erfinv

from adaloss_jax import _formats, _policies, _transforms, _validation
from adaloss_jax._policies import LossScaleState

ROOT = ""
# Slots per statistics key: the calls of one module (or the measure-only points of one
# context) each get a slot, so that amax is a max over them; calls beyond the last slot
# add into it (a sum of amaxes: conservative).
_SLOTS = 4


def pow2(n) -> jax.Array:
    """``2.0 ** n`` in fp32, exactly, for integer-valued ``n`` (``jnp.exp2`` is not exact on
    CPU); inf above 2**127 and 0 below 2**-126 (as jitted ``jnp.ldexp`` on CPU, which
    flushes fp32 subnormals).

    Written as the exponent bits (4 scalar ops, against ~50 for ``jnp.ldexp``): every
    converted module boundary calls it.
    """
    n = jnp.clip(jnp.asarray(n), -127, 128).astype(jnp.int32)
    # Biased exponent n + 127 and a zero mantissa; n = -127 gives 0.0 and n = 128 inf.
    return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


# Statistics rows: 0 = where the cotangent enters a module (its output), 1 = where it
# leaves (its inputs). Columns:
_AMAX, _SUMSQ, _COUNT, _NONFINITE = range(4)
_NSTATS = 4
# statistic="quantile" appends a histogram of the cotangents' binades (counts of non-zero
# elements by floor(log2|x|) at the group's scale) to each row: _NBINS bins starting
# _HIST_BELOW binades below the format's smallest subnormal (the lowest bin also counts
# everything below it, the highest everything above).
_NBINS = 56
_HIST_BELOW = 16


def _width(scaler: AdaptiveScale) -> int:
    """Columns of a statistics row."""
    return _NSTATS + (_NBINS if scaler.statistic == "quantile" else 0)


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
        cotangent). Measured: gradients are far from normal (the largest value is
        ~2^10 sigma on a deep MLP), so "gaussian" flushes 3-5% of gradient elements
        where "amax" flushes ~0.01%. On the byte GPT (tiny-gradient regime, seed 0)
        "quantile" kept the global scale 5 binades lower than "amax" (2^30 vs 2^35: more
        headroom) at the same bits/byte (3.3068 both), for ~1.1x (global) to ~1.4x (per
        module) the step time on CPU; it buys headroom, not quality, so "amax" is the
        default.
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
        (fp8 e4m3fn's 18). Measured on the bench's byte GPT with e4m3 cotangents (tiny
        regime, seed 0): margin 4 flushed 9.8% of gradient elements and cost +0.12
        bits/byte against fp32; margin 2 flushed 5.8% and matched fp32; margin 1 skipped
        4 steps on overflow.
      grad_dtype: the format cotangents are stored in (``u_min``/``u_max`` come from it).
      groups: ``"global"`` (default: one statistics-driven scale for everything,
        measured at every module boundary) or ``"module"`` (one scale per
        parameter-owning module). Default chosen by measurement: on a 4-layer byte GPT
        (tiny-gradient regime, 3 seeds) and a 16-layer plain MLP both closed the gap to
        fp32 equally, and per-module costs ~1.2-1.3x step time on CPU against ~1.0x.
      initial_scale: scale of every group before the first statistics.
      min_scale / max_scale: bounds, powers of two.
      backoff: binades a group backs off by when its cotangents or gradients overflow.
      filter: ``(module_path: tuple[str, ...], module) -> bool``; modules it rejects get
        no scale point and run at their parent's scale. Default: every module that owns
        parameters.
      simulate: round every cotangent to ``grad_dtype`` where it enters a scale group,
        after scaling (a *simulation* of fp8 gradients in an fp16/fp32 model; values
        are rounded to the format and kept in the compute dtype).

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
    filter: Callable[[tuple[str, ...], Any], bool] | None = None
    simulate: bool = False

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
        _validation.check_int("backoff", self.backoff, minimum=1)
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
        if self.filter is not None and not callable(self.filter):
            raise TypeError(
                f"filter must be a callable (module_path, module) -> bool, got {self.filter!r}"
            )

    @property
    def format(self) -> _formats.FloatFormat:
        return _formats.float_format(self.grad_dtype)

    def group_of(self, module_path: tuple[str, ...]) -> str:
        return ROOT if self.groups == "global" else "/".join(module_path)


def adaptive(**kwargs) -> AdaptiveScale:
    """Builds an :class:`AdaptiveScale` (keyword arguments as its attributes).

    >>> adaptive(statistic="gaussian", threshold=1e-3).margin
    4
    """
    return AdaptiveScale(**kwargs)


class AdaptiveScaleState(NamedTuple):
    """State of :func:`adaptive_unscale`.

    Attributes:
      base: a :class:`LossScaleState`: ``loss_scale`` is the root scale (the one the loss
        is multiplied by) and its counters count applied and skipped steps exactly as the
        global scalers do.
      log2_scales: ``{group: fp32 scalar}``, ``s_k`` of each group.
      log2_amax: ``{group: fp32 scalar}``, ``log2`` of the group's unit-scale amax at the
        last step (``-inf`` when nothing was measured).
      overflowed: ``{group: bool}``, whether the group was non-finite at the last step.
    """

    base: LossScaleState
    log2_scales: dict
    log2_amax: dict
    overflowed: dict


# --------------------------------------------------------------------------- groups


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


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


def param_groups(params, scaler: AdaptiveScale) -> list[str]:
    """The scale groups of a parameter tree: the root and every module owning parameters."""
    return sorted({_key_group(k, scaler) for k in stats_keys(params)})


def _leaf_group(path: tuple[str, ...], active: set[str], scaler: AdaptiveScale) -> str:
    owner = path[:-1]
    for i in range(len(owner), 0, -1):
        g = scaler.group_of(owner[:i])
        if g in active:
            return g
    return ROOT


# ----------------------------------------------------------------------- scale points


class _PointConfig(NamedTuple):
    """Static configuration of a scale point (hashable: a custom_vjp nondiff argument)."""

    row: int  # 0: where the cotangent enters the module (its output); 1: where it leaves
    convert: bool  # False when the ratio is 1 by construction (same group on both sides)
    sumsq: bool  # whether the statistic needs the sum of squares (the gaussian rule)
    fmt_max: float  # the cotangent format's largest finite value
    simulate: Any = None  # a dtype to round entering cotangents to (fp8 simulation)
    slot: int = 0  # which slot of the statistics key this point writes
    hist_lo: int | None = None  # binade of the histogram's lowest bin; None: no histogram


def _binade_hist(cts: tuple[jax.Array, ...], factor, lo: int) -> jax.Array:
    """Counts of the non-zero elements of ``factor * ct`` by ``floor(log2|x|)``, in
    ``_NBINS`` bins from binade ``lo`` (clipped at both ends), as fp32.

    The binade is read from the fp32 exponent bits (exact for every fp16/fp8 value,
    subnormals included) and shifted by ``log2(factor)``, so nothing is multiplied.
    Measured on CPU: a scatter-add into the bins costs ~2.5x an amax pass, a
    compare-and-sum over the bins ~300x, so this scatters.
    """
    shift = jnp.frexp(factor)[1] - 1  # log2 of the power-of-two factor, exactly
    hist = jnp.zeros((_NBINS,), jnp.int32)
    for ct in cts:
        bits = jax.lax.bitcast_convert_type(ct.astype(jnp.float32), jnp.int32)
        binade = ((bits >> 23) & 0xFF) - 127 + shift
        idx = jnp.clip(binade - lo, 0, _NBINS - 1).reshape(-1)
        hist = hist.at[idx].add((ct != 0).reshape(-1).astype(jnp.int32))
    return hist.astype(jnp.float32)


def _stats(cts: tuple[jax.Array, ...], factor, cfg: _PointConfig) -> jax.Array:
    """Statistics of ``factor * ct`` (amax, sum of squares, count, non-finite flag, and
    the binade histogram when ``cfg.hist_lo`` is set).

    ``amax`` is taken on the cotangent as it is and multiplied by the (power-of-two)
    factor, which is exact; a converted value above the format's max would be inf, so
    it counts as non-finite. One read of each cotangent: non-finite elements enter the
    max as inf, so the max alone also answers "all finite?" (not ``max(|ct|)`` alone:
    XLA's CPU max reduction can drop a NaN). The amax of a non-finite cotangent is then
    inf, which the scale rule never reads (the group backs off instead).
    """
    amax = jnp.zeros((), jnp.float32)
    sumsq = jnp.zeros((), jnp.float32)
    for ct in cts:
        mag = jnp.where(jnp.isfinite(ct), jnp.abs(ct), jnp.asarray(jnp.inf, ct.dtype))
        amax = jnp.maximum(amax, jnp.max(mag, initial=0).astype(jnp.float32))
        if cfg.sumsq:
            c = ct.astype(jnp.float32)
            sumsq = sumsq + jnp.sum(c * c)
    amax = amax * factor
    sumsq = sumsq * factor * factor
    bad = jnp.logical_not(amax <= cfg.fmt_max).astype(jnp.float32)
    count = jnp.float32(sum(ct.size for ct in cts))
    row = jnp.stack([amax, sumsq, count, bad])
    if cfg.hist_lo is None:
        return row
    return jnp.concatenate([row, _binade_hist(cts, factor, cfg.hist_lo)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scale_point(cfg: _PointConfig, xs: tuple, ratio: jax.Array, dummy: jax.Array):
    """Identity on ``xs``; backward multiplies the cotangents by ``ratio`` and returns
    their statistics (measured at the module's scale) as ``dummy``'s cotangent."""
    del ratio, dummy
    return xs


def _scale_point_fwd(cfg, xs, ratio, dummy):
    del dummy
    return xs, ratio


def _scale_point_bwd(cfg, ratio, cts):
    if cfg.convert:
        converted = tuple((c.astype(jnp.float32) * ratio).astype(c.dtype) for c in cts)
    else:
        converted = cts
    if cfg.simulate is not None and cfg.row == 0:
        converted = tuple(c.astype(cfg.simulate).astype(c.dtype) for c in converted)
    # Row 0 measures after entering the module's scale, row 1 before leaving it.
    factor = ratio if (cfg.row == 0 and cfg.convert) else jnp.float32(1.0)
    stats = _reduce_over_mapped_axes(_stats(cts, factor, cfg), cts)
    # A pad, not ``zeros.at[slot, row].set``: XLA sees a scatter in the latter.
    pads = [(cfg.slot, _SLOTS - 1 - cfg.slot, 0), (cfg.row, 1 - cfg.row, 0), (0, 0, 0)]
    stats = jax.lax.pad(stats[None, None], jnp.float32(0.0), pads)
    return converted, jnp.zeros_like(ratio), stats


def _varying_axes(x) -> set:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return set(mat.varying)
    return set(getattr(aval, "vma", ()) or ())  # earlier releases


def _reduce_over_mapped_axes(stats: jax.Array, cts: tuple) -> jax.Array:
    """Under ``shard_map`` the cotangents may vary over mapped axes while the dummy does
    not; a custom_vjp cotangent must have its input's type, so reduce the statistics over
    those axes here (amax by max, sums by sum): they become global, as under SPMD jit."""
    axes = set()
    for c in cts:
        axes |= _varying_axes(c)
    if not axes:
        return stats
    axes = tuple(sorted(axes))
    amax = jax.lax.pmax(stats[_AMAX], axes)
    rest = jax.lax.psum(stats[_AMAX + 1 :], axes)
    return jnp.concatenate([amax[None], rest])


_scale_point.defvjp(_scale_point_fwd, _scale_point_bwd)


def _is_float(x) -> bool:
    return isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _apply_point(tree, cfg: _PointConfig, ratio, dummy):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    idx = [i for i, x in enumerate(leaves) if _is_float(x)]
    if not idx:
        return tree
    out = _scale_point(cfg, tuple(leaves[i] for i in idx), ratio, dummy)
    leaves = list(leaves)
    for i, x in zip(idx, out):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


class _Interceptor:
    """Puts scale points around module calls (trace time).

    A module call whose path is a scale group gets a full scale point: its cotangents
    are converted into the group's scale where they enter and back where they leave, and
    measured at both places. Any other module call (parameter-free, or rejected by the
    filter) gets a measure-only point on its output, counted in the enclosing group, so
    that a large cotangent inside a group (attention probabilities, say) is seen.
    Statistics go to the dummy of the module's own path (or the enclosing one's), one
    slot per call.
    """

    def __init__(self, scaler, log2_scales, dummies):
        self.scaler = scaler
        self.log2 = log2_scales
        self.dummies = dummies
        self.stack: list[tuple[str, tuple[str, ...]]] = []  # (group, module path)
        self.used: set[str] = set()  # statistics keys written
        self.calls: dict[str, int] = {}
        self.selected = 0  # scale points (not measure-only) inserted
        self.dtypes: set = set()  # dtypes of the floating module outputs seen
        sim = scaler.format.dtype if scaler.simulate else None
        hist_lo = None
        if scaler.statistic == "quantile":
            hist_lo = scaler.format.min_exponent - _HIST_BELOW
        self.cfg = _PointConfig(0, True, scaler.statistic == "gaussian", scaler.format.max, sim,
                                hist_lo=hist_lo)

    def __call__(self, next_fun, args, kwargs, context):
        """The ``flax.linen.intercept_methods`` entry point."""
        module = context.module
        if context.method_name == "setup" or module.scope is None:
            return next_fun(*args, **kwargs)
        return self.wrap(tuple(module.scope.path), module, next_fun, args, kwargs)

    def _slot(self, key: str) -> int:
        n = self.calls.get(key, 0)
        self.calls[key] = n + 1
        self.used.add(key)
        return min(n, _SLOTS - 1)

    def wrap(self, path, module, next_fun, args, kwargs):
        """Runs ``next_fun(*args, **kwargs)`` as a call of the module at ``path``."""
        if self.stack and self.stack[-1][1] == path:  # a method calling another one
            return next_fun(*args, **kwargs)
        key = "/".join(path)
        group = self.scaler.group_of(path)
        parent = self.stack[-1][0] if self.stack else ROOT
        selected = key in self.dummies and group in self.log2 and (
            self.scaler.filter is None or self.scaler.filter(path, module)
        )
        if not selected:
            out = next_fun(*args, **kwargs)
            self._note_dtypes(out)
            ctx_key = "/".join(self.stack[-1][1]) if self.stack else ROOT
            cfg = self.cfg._replace(row=0, convert=False, simulate=None,
                                    slot=self._slot(ctx_key))
            return _apply_point(out, cfg, jnp.float32(1.0), self.dummies[ctx_key])
        convert = group != parent
        into, back = self._ratio(group, parent), self._ratio(parent, group)
        dummy = self.dummies[key]
        slot = self._slot(key)
        args, kwargs = _apply_point(
            (args, kwargs), self.cfg._replace(row=1, convert=convert, slot=slot), back, dummy
        )
        self.selected += 1
        self.stack.append((group, path))
        try:
            out = next_fun(*args, **kwargs)
        finally:
            self.stack.pop()
        self._note_dtypes(out)
        return _apply_point(out, self.cfg._replace(row=0, convert=convert, slot=slot), into,
                            dummy)


    def _ratio(self, to: str, frm: str):
        """``S_to / S_from`` (not cached across calls: a value built inside a lifted
        transform such as ``nn.remat`` or ``nn.scan`` must not leak out of it)."""
        if to == frm:
            return jnp.float32(1.0)
        return pow2(self.log2[to] - self.log2[frm])

    def _note_dtypes(self, out) -> None:
        for x in jax.tree_util.tree_leaves(out):
            if _is_float(x):
                self.dtypes.add(jnp.dtype(x.dtype))

    def check(self) -> None:
        """After tracing: refuse a loss that called no module, or a filter that selected
        none; say once when no fp16/fp8 value crossed a module boundary."""
        if not self.calls:
            raise ValueError(
                "no Flax module was called inside the loss function; the scale points go "
                "around module calls, so call model.apply(...) (linen) or the model (NNX) "
                "inside it"
            )
        if self.selected == 0:
            raise ValueError(
                f"the filter {self.scaler.filter!r} selected no module that owns parameters: "
                f"no scale point was inserted; pass a filter that accepts at least one module "
                f"(or filter=None for all)"
            )
        narrow = {jnp.dtype(jnp.float16), jnp.dtype(self.scaler.format.dtype)}
        if not self.dtypes & narrow:
            _policies.notice_once(
                "wide-model",
                f"adaloss_jax: no float16 value crossed a module boundary (saw "
                f"{sorted(d.name for d in self.dtypes)}): bf16/fp32 compute needs no loss "
                f"scaling; adaloss_jax.no_scaling() (or no scaler) does the same for less",
            )


def stats_keys(params) -> list[str]:
    """Keys of the statistics channel: the root and every parameter-owning module path."""
    keys = {ROOT}
    for path in _leaf_paths(params):
        owner = path[:-1]
        for i in range(1, len(owner) + 1):
            keys.add("/".join(owner[:i]))
    return sorted(keys)


def _key_group(key: str, scaler: AdaptiveScale) -> str:
    """The scale group of a statistics key (a module path joined by "/")."""
    return scaler.group_of(tuple(key.split("/"))) if key else ROOT


def _dummies(params, scaler: AdaptiveScale) -> dict:
    shape = (_SLOTS, 2, _width(scaler))
    return {k: jnp.zeros(shape, jnp.float32) for k in stats_keys(params)}


def _used_stats(stats: dict, used: set[str]) -> dict:
    return {k: stats[k] for k in sorted(used | {ROOT})}


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


def adaptive_value_and_grad(
    fun: Callable[..., Any], scaler: AdaptiveScale, has_aux: bool = False
) -> Callable[..., tuple[Any, Any, dict]]:
    """Like ``jax.value_and_grad(fun)`` with per-module scale points inserted.

    ``fun(params, *args, **kwargs)`` must call the linen model's ``apply`` (any number of
    times). Returns ``g(opt_state, params, *args, **kwargs) -> (value, grads, stats)``:
    the unscaled loss (or ``(loss, aux)``), the *scaled* parameter gradients and the
    statistics (keyed by module path); pass both to the optimizer as
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)``.
    """
    _check_scaler(scaler)

    def wrapped(opt_state, params, *args, **kwargs):
        state = adaptive_state(opt_state)
        log2 = state.log2_scales
        used: set[str] = set()

        def scaled(params, dummies):
            icpt = _Interceptor(scaler, log2, dummies)
            with nn.intercept_methods(icpt):
                out = fun(params, *args, **kwargs)
            icpt.check()
            used.update(icpt.used)
            loss, aux = out if has_aux else (out, None)
            loss32 = jnp.asarray(loss).astype(jnp.float32)
            return loss32 * pow2(log2[ROOT]), (loss, aux)

        (_, (loss, aux)), (grads, stats) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True
        )(params, _dummies(params, scaler))
        stats = _used_stats(stats, used)
        return ((loss, aux) if has_aux else loss), grads, stats

    return wrapped


# ------------------------------------------------------------------------- optax side


def _reduce(x, op, axis_name):
    return x if axis_name is None else op(x, axis_name)


def adaptive_unscale(
    scaler: AdaptiveScale, *, axis_name: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """Unscales each parameter leaf by its own group's scale and updates the scales.

    Use as ``optax.chain(adaptive_unscale(scaler), skip_nonfinite(inner))`` and call
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with the
    outputs of :func:`adaptive_value_and_grad`. Skips are decided and signalled exactly
    as in :func:`adaloss_jax.unscale`; the scale rule is in this module's docstring.
    Without ``scale_stats`` only the root group is active (every leaf at the root scale).
    """
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

    def _quantile_rule(st, s_g, axis_name):
        """The quantile rule's scale for a group (``+inf`` where it has no answer)."""
        hist = _reduce(jnp.sum(st[..., _NSTATS:], axis=(0, 1)), jax.lax.psum, axis_name)
        below = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(hist)])
        # below[j] counts values under 2**(hist_lo + j) (at the group's scale s_g); the
        # largest j with below[j] <= T * n puts binade k at 2 u_min.
        k = hist_lo + jnp.sum(below <= scaler.threshold * below[-1]) - 1
        s_q = (s_g + e_min + 1 - k).astype(jnp.float32)
        # k == e_min: more than T of the values sit in the lowest binade the format
        # holds, where values rounded up from below u_min land and under which flushed
        # ones vanish: the tail is cut off by an unknown amount, so no answer (the amax
        # rule alone sets the scale and the next step measures the whole tail).
        return jnp.where((below[-1] > 0) & (k != e_min), s_q, jnp.inf)

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
            log2_amax={g: f32(-jnp.inf) for g in groups},
            overflowed={g: jnp.asarray(False) for g in groups},
        )

    def update_fn(updates, state, params=None, *, loss=None, scale_stats=None, **extra):
        del params, extra
        log2 = state.log2_scales
        stats = _group_stats({} if scale_stats is None else scale_stats, scaler)
        unknown = sorted(set(stats) - set(log2))
        if unknown:
            raise ValueError(
                f"scale_stats has groups {unknown[:5]} that this optimizer state does not know "
                f"(state groups: {sorted(log2)[:8]}...); the state was built for another model: "
                f"re-run tx.init(params) for this one"
            )
        active = set(stats) | {ROOT}
        paths = _leaf_paths(updates)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        leaf_groups = [_leaf_group(p, active, scaler) for p in paths]
        missing = sorted({g for g in leaf_groups if g not in log2})
        if missing:
            raise ValueError(
                f"gradient leaves belong to groups {missing[:5]} unknown to the optimizer state; "
                f"the state was built for another parameter tree: re-run tx.init(params)"
            )

        # Per-group amax (at the group's scale) and overflow of the parameter gradients.
        # One read per leaf: non-finite elements enter the max as inf (not max(|x|) alone:
        # XLA's CPU max reduction can drop a NaN), so p_amax is inf iff the group's
        # parameter gradients are not all finite.
        p_amax = {g: jnp.zeros((), jnp.float32) for g in active}
        inv = {g: pow2(-log2[g]) for g in sorted(set(leaf_groups))}
        out = []
        for g, leaf in zip(leaf_groups, leaves):
            x = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
            mag = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.asarray(jnp.inf, x.dtype))
            p_amax[g] = jnp.maximum(p_amax[g], jnp.max(mag, initial=0.0))
            out.append(x * inv[g])
        p_bad = {g: ~(a < jnp.inf) for g, a in p_amax.items()}
        updates = jax.tree_util.tree_unflatten(treedef, out)

        new_log2, new_amax, new_bad = dict(log2), dict(state.log2_amax), dict(state.overflowed)
        # Consecutive overflows back off exponentially harder: backoff * 2**skips_in_a_row.
        drop = scaler.backoff * pow2(jnp.minimum(state.base.notfinite_count, 4))
        # Recompute from statistics when the applied steps so far are a multiple of
        # `interval`; backoffs and blind jumps happen on any step.
        recompute = state.base.total_applied % scaler.interval == 0
        grads_finite = jnp.asarray(True)
        informative = jnp.asarray(False)
        for g in active:
            st = stats.get(g, jnp.zeros((1, 2, _width(scaler)), jnp.float32))
            amax = _reduce(jnp.maximum(jnp.max(st[..., _AMAX]), p_amax[g]), jax.lax.pmax,
                           axis_name)
            informative = informative | (amax > 0)
            bad = (jnp.sum(st[..., _NONFINITE]) > 0) | p_bad[g]
            bad = _reduce(bad.astype(jnp.int32), jax.lax.pmax, axis_name) > 0
            grads_finite = grads_finite & ~bad
            unit_log2_amax = jnp.log2(amax) - log2[g]  # -inf when nothing measured
            target = jnp.floor(log2_max - scaler.margin - unit_log2_amax)
            if scaler.statistic == "gaussian":
                sumsq = _reduce(jnp.sum(st[:, 0, _SUMSQ]), jax.lax.psum, axis_name)
                count = _reduce(jnp.sum(st[:, 0, _COUNT]), jax.lax.psum, axis_name)
                unit_log2_sigma = 0.5 * jnp.log2(sumsq / jnp.maximum(count, 1.0)) - log2[g]
                # The smallest power of two the normal model says is enough (ceil: floor
                # would allow up to 2T), never below 1 (the reference's alpha >= 1).
                under = jnp.maximum(jnp.ceil(gauss_c - unit_log2_sigma), 0.0)
                target = jnp.where(sumsq > 0, jnp.minimum(target, under), target)
            if scaler.statistic == "quantile":
                target = jnp.minimum(target, _quantile_rule(st, log2[g], axis_name))
            # amax == 0: everything flushed (or no gradient at all). Every value was below
            # u_min / 2, so jumping by `blind_jump` binades still cannot overflow.
            grown = log2[g] + blind_jump
            if scaler.interval > 1:  # measured scales held between recomputations
                target = jnp.where(recompute, target, log2[g])
            nxt = jnp.where(bad, log2[g] - drop, jnp.where(amax > 0, target, grown))
            new_log2[g] = jnp.clip(nxt, lo, hi).astype(jnp.float32)
            new_amax[g] = jnp.where(bad, new_amax[g], unit_log2_amax).astype(jnp.float32)
            new_bad[g] = bad

        loss_finite = (
            jnp.asarray(True) if loss is None else _transforms.all_finite(loss, axis_name=axis_name)
        )
        # A non-finite loss (forward overflow) is no reason to move any scale.
        new_log2 = {
            g: jnp.where(loss_finite, v, log2[g]) for g, v in new_log2.items()
        }
        # A step where everything flushed to zero carries no information: skip it (the
        # blind jump above has already raised the scales).
        base = _policies._count(state.base, grads_finite & informative, loss_finite)
        base = base._replace(loss_scale=pow2(new_log2[ROOT]))
        updates = _transforms.signal_skip(updates, base.last_applied)
        return updates, AdaptiveScaleState(base, new_log2, new_amax, new_bad)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _group_stats(stats: dict, scaler: AdaptiveScale) -> dict:
    """``{path key: (slots, 2, n)}`` -> ``{group: (m, 2, n)}``, all rows of each group."""
    rows: dict[str, list] = {}
    for key, st in stats.items():
        rows.setdefault(_key_group(key, scaler), []).append(
            jnp.reshape(st, (-1, 2, _width(scaler))))
    return {g: jnp.concatenate(v) for g, v in rows.items()}


def scale_summary(opt_state: Any) -> dict:
    """The adaptive state as plain Python data for logs (call outside jit).

    Keys: ``log2_group_scales``, ``log2_unit_amax``, ``overflowed`` (``{group: value}``)
    and ``group_log2_min_med_max`` over the non-root groups (the root if it is alone).
    """
    st = jax.device_get(adaptive_state(opt_state))
    groups = {g: float(v) for g, v in st.log2_scales.items()}
    vals = sorted(v for g, v in groups.items() if g) or [groups[ROOT]]
    mid = len(vals) // 2
    median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
    return {
        "log2_group_scales": groups,
        "log2_unit_amax": {g: float(v) for g, v in st.log2_amax.items()},
        "overflowed": {g: bool(v) for g, v in st.overflowed.items()},
        "group_log2_min_med_max": [vals[0], median, vals[-1]],
    }


def scale_table(opt_state: Any) -> str:
    """The per-group scales and last statistics as a text table (call outside jit)."""
    st = adaptive_state(opt_state)
    lines = [f"{'group':<40} {'log2 scale':>10} {'log2 unit amax':>15} {'overflowed':>10}"]
    for g in sorted(st.log2_scales):
        amax = float(st.log2_amax[g])
        lines.append(
            f"{(g or '(root)'):<40} {float(st.log2_scales[g]):>10.0f} "
            f"{amax:>15.1f} {bool(st.overflowed[g])!s:>10}"
        )
    return "\n".join(lines)
