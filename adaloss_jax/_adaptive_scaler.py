"""The configuration of adaptive per-layer loss scaling: one frozen dataclass.

A scaler is given once, to the optimizer (:func:`adaloss_jax.adaptive_unscale` or
:func:`adaloss_jax.adaptive_scaled`); the optimizer state carries it, and the gradient
functions read it from there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from adaloss_jax import _formats, _tree, _validation

STATISTICS = ("amax", "gaussian", "quantile")
GROUPINGS = ("global", "module")
# Per module, the binades a step may run below its scale and still be applied, by the
# format: about as far below as a step flushed at most 1% more on every bench task
# measured (docs/results.md, section 4), and so the most a first same-step choice
# keeps free for the sums inside its module. Elsewhere, and never less: the step after
# one backoff, log2(factor) + 1.
_MODULE_RISE = {"float16": 16, "float8_e5m2": 10}


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class AdaptiveScale:
    """Adaptive per-layer loss scaling (Zhao et al., arXiv 1910.12385): its options.

    Build it with ``adaloss_jax.adaptive(...)`` (this class) and give it to the optimizer;
    every option is keyword-only and checked here, so a bad value fails before any trace.

    ========================= ================= ==========================================
    option                    default           when to change it
    ========================= ================= ==========================================
    ``groups``                ``"global"``      ``"module"``: one scale per module that
                                                owns parameters (fp8, deep stacks)
    ``grad_dtype``            ``"float16"``     the format cotangents are stored in (or
                                                simulated in): ``"float8_e4m3fn"``, ...
    ``simulate``              ``False``         round cotangents to ``grad_dtype`` where
                                                they enter a module (fp8 simulation)
    ``statistic``             ``"amax"``        ``"gaussian"`` (the reference's rule) or
                                                ``"quantile"`` (underflow share counted)
    ``threshold``             ``1e-3``          tolerated underflow share (gaussian,
                                                quantile)
    ``margin``                4 (2 for e4m3:    binades kept free below the format's max
                              under 30 binades)
    ``decay``                 1/16 (module),    binades a step the held amax peak sinks
                              inf (global)      by; ``math.inf``: this step's amax alone
    ``period``                ``1``             recompute scales every ``period`` steps
    ``initial_scale``         ``2**15`` (fp16), every group's scale before statistics
                              ``1.0`` (fp8)
    ``min_loss_scale``        ``2**-24``        lower bound of every scale
    ``max_loss_scale``        ``2**64``         upper bound of every scale
    ``factor``                ``16.0``          back-off factor of a group that overflowed
    ``max_rise``              per module 16     binades: a step whose statistics call for
                              (fp16), 10        a scale this much higher is not applied
                              (e5m2); else
                              log2(factor) + 1
    ``same_step``             ``None``: on for  each module's scale set from the
                              ``"module"`` with cotangent entering it, in the same
                              ``"amax"``        backward pass; ``False``: the rule's
                                                (last step's statistics)
    ``retries``               ``0``             passes a step may take again, at the
                                                scales its statistics set, before it is
                                                skipped (``4``: step 0 applied too)
    ``max_consecutive_skips`` ``16``            non-finite steps in a row before
                                                ``health`` flags them (and, where no
                                                group's overflow explains them, every
                                                group backs off)
    ``max_depth``             ``None``          scale points only around modules this
                                                deep (``1``: one scale per block)
    ``filter``                ``None``          ``(path, module) -> bool``: modules to scale
    ``compute_dtype``         ``None``          ``None``: off for a bf16/fp32 model, read
                                                from the trace; a dtype: as ``dynamic()``'s
    ========================= ================= ==========================================

    The rule each option enters is written out in the docs' concepts page ("The rule"),
    in full in the docstring of ``adaloss_jax._rule.adjust``.

    Attributes:
      groups: ``"global"`` (one statistics-driven scale for everything, measured at
        every module boundary) or ``"module"`` (one scale per module that owns parameters
        directly, persisting along the backward stream until a fan-in).
      grad_dtype: the format cotangents are stored in; ``u_min``/``u_max`` come from it.
      simulate: round every cotangent to ``grad_dtype`` where it enters a module that owns
        parameters, after its conversion (fp8 gradients simulated in an fp16/fp32 model).
      statistic: ``"amax"`` (largest scale that keeps each group ``margin`` binades below
        overflow), ``"gaussian"`` (the reference's rule: the smallest scale, at least 1,
        keeping a zero-mean normal model's underflow share under ``threshold``, capped by
        the amax rule) or ``"quantile"`` (the smallest scale that keeps at most
        ``threshold`` of the measured non-zero cotangents below ``2 u_min``, counted from
        a per-binade histogram, capped by the amax rule).
      threshold: ``T``, the tolerated underflow share of ``"gaussian"`` and ``"quantile"``.
      margin: binades kept free below the format's max (headroom for a scale one step
        old). ``None``: 4, or 2 for a format spanning fewer than 30 binades (e4m3's 18).
      decay: the amax rule uses a held peak that sinks by ``decay`` binades a step, so a
        scale rises slowly after a spike and falls at once. ``math.inf``: this step's amax
        alone. ``None``: 1/16 with ``groups="module"``, else ``math.inf``.
      period: recompute the scales from statistics only on steps where the applied steps
        so far are a multiple of ``period`` (the reference's every-``F``-iterations);
        backoffs and blind jumps happen on any step.
      initial_scale: every group's scale before the first statistics (a power of two).
        ``None``: ``2**15`` where ``grad_dtype`` is float16 (dynamic scaling's start: the
        root's region, which has no cotangent of its own to choose by, runs step 0 at
        it), else ``1.0`` (an fp8 format holds too few binades for one guess to fit).
      min_loss_scale: lower bound of every scale (a power of two).
      max_loss_scale: upper bound of every scale (a power of two).
      factor: a group that overflowed backs off by ``factor`` (a power of two > 1), and,
        while nothing of it was measured yet (no held peak), by ``factor ** (2 ** n)``
        where it was blamed at the ``n`` steps before too (capped at 4; a step with no
        finite loss, or whose non-finite values nobody overflowed at, neither counts
        nor ends the run; another group's overflow ends it).
      max_rise: a step whose own statistics call for a scale more than ``max_rise``
        binades above the one a group's gradients were computed at (the first step at
        ``initial_scale``, a step after more than one backoff) is skipped: the scales
        move, and the next step is computed at them. ``None``: ``log2(factor) + 1``: the
        step after a single backoff (back by ``log2(factor)``, plus a binade the
        statistics may have moved) is applied; where ``groups="module"``, ``16`` for
        float16 and ``10`` for e5m2: a step computed that far below its scale flushed at
        most 1% more than at its scale on every task measured (``docs/results.md``,
        section 4), and a first same-step choice keeps up to ``max_rise`` binades free
        for the sums inside its module (a kernel's over every token: in e5m2, whose
        largest value lies in float16's top binade, a kernel's gradient summed in the
        model's float16 has almost no room above the cotangent's format).
      same_step: ``True`` (the default where ``groups="module"`` and
        ``statistic="amax"``; ``None`` resolves to it there, else to ``False``): each
        module's region of the backward stream chooses its
        scale where the backward pass first reaches it (its call's output point), from
        the cotangent arriving there, in the same backward pass: the largest power of
        two keeping that cotangent ``margin`` binades and the learned headroom below
        the format's max, never above the scale the rule set for the step once the
        group was measured or overflowed (that scale holds the growth inside the
        module seen so far, and the back-off). The other points on the region's border
        receive the choice from it (docs: concepts, same-step scales), and the unscale
        divides by it. A fan-in (a residual stream, q/k/v's input) decides the same way
        at its last reader, never above its readers' rule scales once they were
        measured. A stack of layers in one scan decides a scale per layer (the
        regions inside a layer, a chain of layers, a stream every layer reads and adds
        to), and a scan over time (an RNN) a scale per region for all its steps, at
        the step the backward pass runs first. Regions whose border is not all in one
        scope (a point inside a ``shard_map`` of the loss, or in a scan nested in a
        scan over time; a ``checkpoint`` body or a ``cond``'s branches are in the
        scope around them) and the root where the loss's region is its own keep the
        rule's scale.
        Needs ``groups="module"`` and ``statistic="amax"``. ``False``: every scale is
        the rule's, set from the statistics of the steps before (and retried).
      retries: a step the rule would skip while it moves a scale (an overflow backed
        off, a step computed far below the scales its statistics call for, the first
        step at ``initial_scale``) is computed again inside the same step, at the new
        scales, up to this many times; only then is it skipped. A step no scale can
        change (a non-finite loss, NaN in the data) is skipped at once. ``0`` (the
        default): such a step is skipped, and the next runs at the scales it set (with
        same-step scales that is at most step 0 on the models measured: in fp8, or a
        loss of tiny magnitude). With retries the
        forward and backward pass sit in a ``lax.while_loop``: each retry costs one more
        pass, and even when there is none the loop costs compile time and, on a GPU, a
        read of its condition on the host that splits the step's command buffer (the
        measured costs: ``docs/results.md``, section 6).
      max_consecutive_skips: ``K``: after ``K`` steps in a row whose loss or gradients
        were not finite ``health`` says so, and where no group's overflow explains
        them every group backs off (a refused finite step ends the run).
      max_depth: scale points go only around calls of modules nested at most this deep
        (``"Block_0"`` is at depth 1, ``"Block_0/attn"`` at 2); a deeper module's
        parameters join its enclosing module's group. ``None``: every module.
      filter: ``(module_path, module) -> bool``; modules it rejects get no scale point and
        their parameters join the nearest selected enclosing group. ``None``: all.
      compute_dtype: the dtype the model computes in, as for
        :func:`adaloss_jax.dynamic`: for ``bfloat16`` or ``float32`` the scaler is off
        (every scale 1, no retry, only non-finite steps skipped); for ``float16`` or an
        fp8 format it scales. ``None``: read from the trace: off when no float16 or
        ``grad_dtype`` value crosses a module boundary and ``simulate`` is off (it says so
        once), else on. ``"float16"`` also makes an fp32 model scale (to study the
        scales, or exactness under them, without fp16 rounding).

    Raises:
      ValueError: for an option out of range, naming the option, the value and the fix.
      TypeError: for an option of the wrong type, naming the option, the value and the
        fix.

    >>> AdaptiveScale(groups="module", grad_dtype="float8_e4m3fn").margin
    2
    >>> AdaptiveScale()  # doctest: +NORMALIZE_WHITESPACE
    AdaptiveScale(groups='global', grad_dtype='float16', simulate=False, statistic='amax',
                  threshold=0.001, margin=4, decay=inf, period=1, initial_scale=2**15,
                  min_loss_scale=2**-24, max_loss_scale=2**64, factor=16.0, max_rise=5,
                  same_step=False, retries=0, max_consecutive_skips=16, max_depth=None, filter=None,
                  compute_dtype=None)
    """

    groups: str = "global"
    grad_dtype: Any = "float16"
    simulate: bool = False
    statistic: str = "amax"
    threshold: float = 1e-3
    margin: int | None = None
    decay: float | None = None
    period: int = 1
    initial_scale: float | None = None
    min_loss_scale: float = 2.0**-24
    max_loss_scale: float = 2.0**64
    factor: float = 16.0
    max_rise: int | None = None
    same_step: bool | None = None
    retries: int = 0
    max_consecutive_skips: int = 16
    max_depth: int | None = None
    filter: Callable[[tuple[str, ...], Any], bool] | None = None
    compute_dtype: Any = None

    __repr__ = _formats.dataclass_repr

    def __post_init__(self):
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic={self.statistic!r} is not known; pass one of "
                             f"{', '.join(map(repr, STATISTICS))}")
        if self.groups not in GROUPINGS:
            raise ValueError(f"groups={self.groups!r} is not known; pass 'module' or 'global'")
        fmt = _formats.float_format(self.grad_dtype, argname="grad_dtype")
        if not fmt.needs_scaling:
            raise ValueError(
                f"grad_dtype={fmt.name} has fp32's exponent range and needs no loss scaling; "
                f"use adaloss_jax.no_scaling() (or bf16 without a scaler)")
        t = _validation.check_positive_finite("threshold", self.threshold)
        if t >= 1:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold!r}; pass 1e-3")
        if self.margin is None:  # frozen: the resolved default is set once
            wide = math.log2(fmt.max / fmt.min_subnormal) >= 30
            object.__setattr__(self, "margin", 4 if wide else 2)
        _validation.check_int("margin", self.margin, minimum=0)
        if self.decay is None:
            object.__setattr__(self, "decay", 0.0625 if self.groups == "module" else math.inf)
        if (isinstance(self.decay, bool) or not isinstance(self.decay, int | float)
                or not self.decay > 0):
            raise ValueError(f"decay must be a positive number of binades (or math.inf), "
                             f"got {self.decay!r}")
        _validation.check_int("period", self.period, minimum=1)
        if self.initial_scale is None:  # frozen: the resolved default is set once
            object.__setattr__(self, "initial_scale",
                               2.0**15 if fmt.name == "float16" else 1.0)
        for option in ("initial_scale", "min_loss_scale", "max_loss_scale"):
            object.__setattr__(self, option,  # a float: 2**64 as an int overflows jnp
                               _validation.check_power_of_two(option, getattr(self, option)))
        if not self.min_loss_scale <= self.initial_scale <= self.max_loss_scale:
            raise ValueError(
                f"initial_scale={self.initial_scale!r} must lie in [min_loss_scale, "
                f"max_loss_scale] = [{_formats.pow2_repr(self.min_loss_scale)}, "
                f"{_formats.pow2_repr(self.max_loss_scale)}]; pass an initial_scale inside the "
                f"bounds")
        _validation.check_growth_factor("factor", self.factor)
        if self.max_rise is None:
            module = _MODULE_RISE.get(fmt.name, 0) if self.groups == "module" else 0
            object.__setattr__(self, "max_rise", max(module, self.backoff + 1))
        _validation.check_int("max_rise", self.max_rise, minimum=0)
        _validation.check_int("retries", self.retries, minimum=0)
        _validation.check_int("max_consecutive_skips", self.max_consecutive_skips, minimum=1)
        _validation.check_bool("simulate", self.simulate)
        if self.same_step is None:  # frozen: the resolved default is set once
            object.__setattr__(self, "same_step",
                               self.groups == "module" and self.statistic == "amax")
        _validation.check_bool("same_step", self.same_step)
        if self.same_step and (self.groups != "module" or self.statistic != "amax"):
            raise ValueError(
                f"same_step=True sets each module's scale from the amax of the cotangent "
                f"entering it, so it needs groups='module' and statistic='amax' (got "
                f"groups={self.groups!r}, statistic={self.statistic!r}); pass those, or "
                f"same_step=False")
        if self.max_depth is not None:
            _validation.check_int("max_depth", self.max_depth, minimum=1)
        if self.compute_dtype is not None:  # a canonical name: equal scalers compare equal
            object.__setattr__(self, "compute_dtype", _formats.float_format(
                self.compute_dtype, argname="compute_dtype").name)
        if self.filter is not None and not callable(self.filter):
            raise TypeError(
                f"filter must be a callable (module_path, module) -> bool, got {self.filter!r}")

    @property
    def format(self) -> _formats.FloatFormat:
        """The :class:`~adaloss_jax.formats.FloatFormat` of ``grad_dtype``."""
        return _formats.float_format(self.grad_dtype)

    @property
    def backoff(self) -> int:
        """``log2(factor)``: binades a group backs off by at its first overflow."""
        return round(math.log2(self.factor))

    def group_of(self, module_path: tuple[str, ...]) -> str:
        """The scale group a module at ``module_path`` belongs to (cut at ``max_depth``)."""
        if self.groups == "global":
            return _tree.ROOT
        return _tree.name(module_path[:self.max_depth])


def differences(ours: AdaptiveScale, theirs: AdaptiveScale, *, names=("this", "that")
                ) -> str:
    """The options two scalers set differently, as ``name: ours (this) vs theirs
    (that)``, joined by ``; `` (what a mismatch message lists instead of two reprs)."""
    this, that = names
    show = _formats.pow2_repr
    diff = [f"{f.name}={show(getattr(ours, f.name))} ({this}) vs "
            f"{show(getattr(theirs, f.name))} ({that})"
            for f in dataclasses.fields(AdaptiveScale)
            if getattr(ours, f.name) != getattr(theirs, f.name)]
    return "; ".join(diff) or "none (equal options)"


adaptive = AdaptiveScale
