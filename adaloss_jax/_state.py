"""The state of adaptive scaling and the statistics a backward pass hands to it.

Both are pytrees of arrays with static metadata: the group names, the scaler the state
was built with, and a fingerprint of the parameters it belongs to. So a state knows its
configuration (the gradient functions read the scaler from it) and refuses gradients or
statistics of another model at trace time.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from adaloss_jax import _lookup
from adaloss_jax._adaptive_scaler import AdaptiveScale
from adaloss_jax._common import LossScaleState, counters, fingerprint
from adaloss_jax._layout import GroupVector


class Health(enum.IntFlag):
    """The bits of :attr:`AdaptiveScaleState.health` (0 when all is well);
    ``Health(int(state.health))`` reads them, :func:`adaloss_jax.diagnostics.check_health` explains
    them with the fix.

    >>> Health(3)
    <Health.SKIPPING|PINNED_LOW: 3>
    """

    SKIPPING = 1  # at least max_consecutive_skips non-finite steps in a row
    PINNED_LOW = 2  # a group overflowed at min_loss_scale
    NOTHING_MEASURED = 4  # nothing measured in the step, a group at max_loss_scale
    FOREIGN_GRADS = 8  # tx.update got other gradients than its scale_stats came with
    SPAN = 16  # one global scale flushed a module's cotangent entirely




class Handed:
    """The gradient leaves a gradient function returned with its statistics, held by
    weak reference (:attr:`ScaleStats.handed`): an optimizer handed these very arrays (in
    the same trace, or the same eager call) knows they are the ones measured, and does
    not measure them again. Static data of the statistics' tree, equal to every other
    ``Handed`` so that no jit retraces for it."""

    __slots__ = ("refs",)

    def __init__(self, leaves):
        try:
            self.refs = tuple(weakref.ref(x) for x in leaves)
        except TypeError:  # a leaf that takes no weak reference: never the same
            self.refs = None

    def same(self, leaves) -> bool:
        """Whether ``leaves`` are the very arrays (or tracers) handed back."""
        return (self.refs is not None and len(leaves) == len(self.refs)
                and all(r() is x for r, x in zip(self.refs, leaves)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Handed)

    def __hash__(self) -> int:
        return hash(Handed)

    def __repr__(self) -> str:
        return "Handed(...)"


def _static(**kw):
    return dataclasses.field(metadata={"static": True}, **kw)


@dataclasses.dataclass(frozen=True)
class AdaptiveScaleState:
    """State of :func:`adaloss_jax.adaptive_unscale`.

    Attributes:
      base: a :class:`~adaloss_jax.LossScaleState`: ``loss_scale`` is the root scale (the
        one the loss is multiplied by), and its counters count applied and skipped steps
        as the global scalers' do. Its fields read on this state too
        (``state.loss_scale``, ``state.last_applied``, ``state.total_applied``, ...).
      log2_scales: :class:`GroupVector` of fp32 scalars, ``log2`` of each group's scale.
      log2_amax: :class:`GroupVector` of fp32, ``log2`` of the group's held amax peak at
        unit scale (``-inf`` before anything was measured; kept as it was at a step
        whose loss was not finite, as the other fields are).
      overflowed: :class:`GroupVector` of int32, the steps in a row the group was blamed
        for an overflow (0: not at its last step; a step that held the group, its loss
        not finite, the group unused, or non-finite values nobody overflowed at,
        neither counts nor ends the run): the harder back-off of a group nothing was
        measured of reads it.
      headroom: :class:`GroupVector` of fp32, binades each group keeps free besides
        ``margin``, learned from its own overflows (growth inside a module that the
        statistics at its boundaries do not see) and given back slowly.
      ceiling: :class:`GroupVector` of fp32, the lowest log2 scale the group overflowed
        at since its last finite statistics (``inf``: none); a blind jump goes at most
        halfway to it, and the next finite statistics turn it into headroom.
      total_retries: int32, passes the gradient function took again inside a step
        (``AdaptiveScale.retries``) over the run.
      health: int32 bit set of :class:`Health`, 0 when all is well: ``SKIPPING`` (at
        least ``max_consecutive_skips`` non-finite steps in a row: their loss or
        gradients were not finite), ``PINNED_LOW`` (a group overflowed at
        ``min_loss_scale``), ``NOTHING_MEASURED`` (nothing was measured in the step,
        and a group sat at ``max_loss_scale``), ``SPAN`` (one global scale, held down
        by the largest gradients, flushed a module's cotangent entirely),
        ``FOREIGN_GRADS`` (the gradients handed to ``update`` were not the ones its
        ``scale_stats`` were measured with).
        :func:`adaloss_jax.diagnostics.check_health` explains them.
      scaler: the :class:`~adaloss_jax.AdaptiveScale` the state was built with (static).
      fingerprint: the parameter paths, ranks and shapes the state was built for
        (static).
      axis_name: the mapped axis statistics are reduced over (static; the optimizer's
        ``axis_name``), so a retried pass decides alike on every device.

    >>> import adaloss_jax as alj
    >>> st = alj.adaptive_unscale(alj.adaptive(groups="module")).init({"a": {"w": jnp.ones(2)}})
    >>> st.groups, float(st.log2_scales["a"]), int(st.total_applied)
    (('', 'a'), 15.0, 0)
    """

    base: LossScaleState
    log2_scales: GroupVector
    log2_amax: GroupVector
    overflowed: GroupVector
    headroom: GroupVector
    ceiling: GroupVector
    health: jax.Array
    total_retries: jax.Array
    scaler: AdaptiveScale = _static()
    fingerprint: str = _static()
    axis_name: str | None = _static(default=None)

    @property
    def groups(self) -> tuple[str, ...]:
        """The scale groups, in model order (the root ``""`` first)."""
        return self.log2_scales.names

    def replace(self, **changes) -> AdaptiveScaleState:
        """A copy with some fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def with_log2_scales(self, log2: Mapping[str, Any]) -> AdaptiveScaleState:
        """A copy with the groups in ``log2`` set to those log2 scales (integers), the
        root's ``loss_scale`` included: a warm start, or a test's chosen scales.

        >>> import adaloss_jax as alj
        >>> tx = alj.adaptive_unscale(alj.adaptive(groups="module"))
        >>> st = tx.init({"a": {"w": jnp.ones(2)}}).with_log2_scales({"a": 7})
        >>> float(st.log2_scales["a"]), float(st.log2_scales[""])
        (7.0, 15.0)
        """
        unknown = sorted(set(log2) - set(self.groups))
        if unknown:
            raise KeyError(f"no scale groups {unknown} in this state (groups: "
                           f"{list(self.groups)})")
        values = [jnp.asarray(log2[g], jnp.float32) if g in log2 else self.log2_scales[g]
                  for g in self.groups]
        return self.replace(log2_scales=GroupVector(self.groups, values, split=True),
                            base=self.base._replace(loss_scale=jnp.exp2(values[0])))

    def __getattr__(self, name):
        # The counters read as on a global scaler's state: state.total_applied, ...
        if name in LossScaleState._fields:
            return getattr(self.base, name)
        raise AttributeError(f"AdaptiveScaleState has no attribute {name!r}")


jax.tree_util.register_dataclass(
    AdaptiveScaleState,
    data_fields=["base", "log2_scales", "log2_amax", "overflowed", "headroom", "ceiling",
                 "health", "total_retries"],
    meta_fields=["scaler", "fingerprint", "axis_name"],
)

_lookup.register(AdaptiveScaleState, unscale="adaptive_unscale", scaled="adaptive_scaled")


@dataclasses.dataclass(frozen=True)
class ScaleStats:
    """What a backward pass measured, per scale group in use, handed by
    :func:`adaloss_jax.adaptive_value_and_grad` to :func:`adaloss_jax.adaptive_unscale`.

    Attributes:
      log2_scales: the scale each group's gradients were computed at (the one they are
        unscaled by).
      amax: the largest measured cotangent magnitude at the group's scale (inf if a value
        was not finite), in units of ``grad_dtype``: a value held in a wider format counts
        ``u_max / u_max(its format)`` times less.
      bad: whether an overflow started at the group's scale (only those groups back off).
      sumsq: sum of squares (``statistic="gaussian"``), or ``None``.
      count: element count (``statistic="gaussian"``), or ``None``.
      hist: per-binade histogram at the group's scale (``statistic="quantile"``; an array
        ``(NBINS, groups)``), or ``None``.
      nonfinite: whether any measured value or conversion was not finite.
      flushed: whether a cotangent arrived at a scale point non-zero and flushed
        entirely where it is stored, below half of ``grad_dtype``'s smallest value.
      starved: per group, whether a cotangent on its way into it arrived zero, or
        non-zero and flushed entirely where it is stored (its statistics miss what was
        lost and all that was computed from it): the rule raises it by at most the
        jump that cannot overflow what was lost.
      lost_amax: per group, log2 of the largest value at unit scale (as ``amax``) that
        was measured before it was lost on the way into the group: where it flushed,
        on the wide side of a cast that flushed it, or upstream of cotangents that
        arrived as zeros; ``-inf`` where none was. The rule never leaves a starved
        group where that value would flush again.
      own: per group, whether it measured something in rows other than those of a
        fan-in that chose its own scale in the backward pass (converted at that choice,
        not at the group's scale) and held where a value may flush (not in float32's
        range): ``False`` for a module whose output's cotangent is stopped
        (``stop_gradient``, a frozen branch) though its input is such a fan-in, or for
        the root of a float32 model simulating fp8. The rule does not refuse a step as
        computed below the scale of a group that measured nothing of its own.
      adopted: per group, whether its scale was a live fan-in's choice (a group with no
        region of its own, its parameters read only in that fan-in: their gradients
        computed at the choice). Nothing was computed at a scale of its own: the rows of
        other fan-ins it anchors ran at their scales, set by its planned one, and the rule
        counts it as measuring nothing of its own (:attr:`own`); ``None`` where no group
        adopted one.
      verdict: where the gradient function may retry a step (``AdaptiveScale.retries``):
        the rule's next state for the pass these statistics are of (its array fields
        but ``total_retries``) and ``retries``, the passes taken again; the optimizer
        applies it as it is. ``None`` with ``retries=0`` (the optimizer decides).
      grad_amax: each state group's largest gradient magnitude at its scale, of the
        gradients returned with these statistics (over the state's groups; inf where one
        is not finite): the optimizer checks that it is handed those gradients (unless
        ``handed`` shows they are the very arrays).
      handed: the gradients returned with these statistics, by weak reference
        (:class:`Handed`, static): handed the same arrays, the optimizer does not measure
        them again for that check.
      fingerprint: the parameters the statistics were measured for (static).
      origin: the state's groups and scaler they were measured with (static): another
        optimizer state refuses them.

    >>> import adaloss_jax as alj
    >>> dense = alj.scale_group("d")(lambda p, x: x @ p["w"])
    >>> params = {"d": {"w": jnp.eye(2, dtype=jnp.float16)}}
    >>> st = alj.adaptive_unscale(alj.adaptive(groups="module")).init(params)
    >>> loss_fn = lambda p, x: jnp.sum(dense(p["d"], x)).astype(jnp.float32)
    >>> x = jnp.ones((1, 2), jnp.float16)
    >>> _, _, stats = alj.adaptive_value_and_grad(loss_fn)(st, params, x)
    >>> float(stats.log2_scales["d"]), float(stats.amax["d"])  # chosen in the pass
    (11.0, 2048.0)
    """

    log2_scales: GroupVector
    amax: GroupVector
    bad: GroupVector
    nonfinite: jax.Array
    sumsq: GroupVector | None = None
    count: GroupVector | None = None
    hist: GroupVector | None = None
    flushed: jax.Array | None = None
    starved: GroupVector | None = None
    lost_amax: GroupVector | None = None
    own: GroupVector | None = None
    adopted: GroupVector | None = None
    verdict: dict | None = None
    grad_amax: jax.Array | None = None
    fingerprint: str = _static(default="")
    origin: tuple = _static(default=())
    handed: Handed | None = _static(default=None)


jax.tree_util.register_dataclass(
    ScaleStats,
    data_fields=["log2_scales", "amax", "bad", "nonfinite", "sumsq", "count", "hist",
                 "flushed", "starved", "lost_amax", "own", "adopted", "verdict",
                 "grad_amax"],
    meta_fields=["fingerprint", "origin", "handed"],
)


def initial_state(params: Any, scaler: AdaptiveScale, groups: list[str]) -> AdaptiveScaleState:
    """Every group at ``initial_scale``, nothing measured yet."""
    n = len(groups)
    s0 = math.log2(scaler.initial_scale)  # (exact: XLA's float32 log2 of 2**15 is not)
    return AdaptiveScaleState(
        base=counters(scaler.initial_scale, 1),
        log2_scales=GroupVector(groups, jnp.full((n,), s0, jnp.float32), split=True),
        log2_amax=GroupVector(groups, jnp.full((n,), -jnp.inf, jnp.float32)),
        overflowed=GroupVector(groups, jnp.zeros((n,), jnp.int32)),
        headroom=GroupVector(groups, jnp.zeros((n,), jnp.float32)),
        ceiling=GroupVector(groups, jnp.full((n,), jnp.inf, jnp.float32)),
        health=jnp.zeros((), jnp.int32),
        total_retries=jnp.zeros((), jnp.int32),
        scaler=scaler,
        fingerprint=fingerprint(params),
    )
