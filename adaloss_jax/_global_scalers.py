"""Global loss scalers: frozen configs with pure, branch-free update rules.

A scaler is static configuration (hashable, never traced); its mutable part lives
in :class:`LossScaleState`, a NamedTuple of arrays, so every field survives
``jax.tree_util`` flatten/unflatten, ``jit`` and checkpointing, and no configuration
can be lost on the way (jmp's ``DynamicLossScale`` drops ``min_loss_scale`` when
flattened).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from adaloss_jax import _formats, _validation
from adaloss_jax._common import LossScaleState, count_step, counters, notice_once


@dataclasses.dataclass(frozen=True, repr=False)
class NoLossScale:
    """No scaling: scale 1, for bf16/fp32 compute (no underflow to fix).

    Steps with non-finite gradients or loss are still skipped and counted.

    Attributes:
      reason: why scaling is off (shown by ``repr``); informational only.

    >>> st = NoLossScale().adjust(NoLossScale().init(), grads_finite=False)
    >>> float(st.loss_scale), int(st.total_skipped)
    (1.0, 1)
    """

    reason: str = "no scaling requested"

    __repr__ = _formats.dataclass_repr

    @property
    def hysteresis(self) -> int:
        return 1

    def init(self) -> LossScaleState:
        return counters(1.0, 1)

    def adjust(self, state: LossScaleState, grads_finite, loss_finite=True) -> LossScaleState:
        return count_step(state, jnp.asarray(grads_finite), jnp.asarray(loss_finite))


@dataclasses.dataclass(frozen=True, repr=False)
class StaticLossScale:
    """A fixed loss scale (jmp ``StaticLossScale``).

    Attributes:
      loss_scale: the scale, a power of two.

    >>> float(StaticLossScale(2.0**8).init().loss_scale)
    256.0
    >>> StaticLossScale()
    StaticLossScale(loss_scale=2**15)
    """

    loss_scale: float = 2.0**15

    __repr__ = _formats.dataclass_repr

    def __post_init__(self):
        object.__setattr__(self, "loss_scale",  # a float: 2**64 as an int overflows jnp
                           _validation.check_power_of_two("loss_scale", self.loss_scale))

    @property
    def hysteresis(self) -> int:
        return 1

    def init(self) -> LossScaleState:
        return counters(self.loss_scale, 1)

    def adjust(self, state: LossScaleState, grads_finite, loss_finite=True) -> LossScaleState:
        return count_step(state, jnp.asarray(grads_finite), jnp.asarray(loss_finite))


@dataclasses.dataclass(frozen=True, repr=False)
class DynamicLossScale:
    """Dynamic global loss scale with bounds and hysteresis.

    The rule, per step (``applied = grads_finite and loss_finite``)::

        if applied:
            finite_count += 1
            if consecutive_hysteresis: hysteresis_left = hysteresis
            if finite_count == period:          # the period-th finite step in a row
                loss_scale = min(loss_scale * factor, max_loss_scale)
                finite_count = 0
                hysteresis_left = hysteresis
        elif loss_finite:                       # gradient overflow: skip, maybe back off
            finite_count = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:
                loss_scale = max(loss_scale / factor, min_loss_scale)
        else:                                   # forward pass overflowed: skip only
            pass                                # the loss scale cannot fix it

    Growth happens on the ``period``-th consecutive finite step, as in jmp
    (``period``) and torch ``GradScaler`` (``growth_interval``). flax's
    ``DynamicScale(growth_interval=G)`` grows one step later, on the ``(G+1)``-th;
    it equals this rule with ``period = G + 1``.

    ``hysteresis_left`` refills only when the scale grows (Megatron-LM's rule), or after
    every applied step with ``consecutive_hysteresis=True`` (DeepSpeed's option). Once it
    is 0, every further overflow backs off until the next refill. ``hysteresis=1`` is the
    classic rule of jmp/flax/torch: back off on every overflow.

    Attributes:
      initial_scale: starting scale (jmp ``loss_scale``, flax ``scale``).
      period: consecutive finite steps per growth (jmp ``period``, torch
        ``growth_interval``).
      factor: growth and back-off factor, a power of two (jmp ``factor``).
      min_loss_scale: lower bound (jmp ``min_loss_scale``, flax ``minimum_scale``).
      max_loss_scale: upper bound; the scale can never reach inf.
      hysteresis: overflows tolerated before backing off (Megatron ``hysteresis``).
      consecutive_hysteresis: refill the hysteresis after every applied step.

    >>> scaler = DynamicLossScale(initial_scale=2.0**4, period=2)
    >>> st = scaler.init()
    >>> for finite in (True, True, False):
    ...     st = scaler.adjust(st, finite)
    >>> float(st.loss_scale), int(st.total_skipped)   # grew to 2**5, backed off to 2**4
    (16.0, 1)
    >>> DynamicLossScale()  # doctest: +NORMALIZE_WHITESPACE
    DynamicLossScale(initial_scale=2**15, period=2000, factor=2.0, min_loss_scale=1.0,
                     max_loss_scale=2**64, hysteresis=1, consecutive_hysteresis=False)
    """

    initial_scale: float = 2.0**15
    period: int = 2000
    factor: float = 2.0
    min_loss_scale: float = 1.0
    max_loss_scale: float = 2.0**64
    hysteresis: int = 1
    consecutive_hysteresis: bool = False

    __repr__ = _formats.dataclass_repr

    def __post_init__(self):
        object.__setattr__(self, "initial_scale",  # a float: 2**64 as an int overflows jnp
                           _validation.check_power_of_two("initial_scale", self.initial_scale))
        _validation.check_int("period", self.period, minimum=1)
        object.__setattr__(self, "factor", _validation.check_growth_factor("factor", self.factor))
        object.__setattr__(self, "min_loss_scale",  # a float: 2**64 as an int overflows jnp
                           _validation.check_power_of_two("min_loss_scale", self.min_loss_scale))
        object.__setattr__(self, "max_loss_scale",  # a float: 2**64 as an int overflows jnp
                           _validation.check_power_of_two("max_loss_scale", self.max_loss_scale))
        if self.min_loss_scale > self.max_loss_scale:
            raise ValueError(
                f"min_loss_scale={self.min_loss_scale!r} is larger than "
                f"max_loss_scale={self.max_loss_scale!r}; swap them or widen the range"
            )
        if not self.min_loss_scale <= self.initial_scale <= self.max_loss_scale:
            raise ValueError(
                f"initial_scale={self.initial_scale!r} lies outside [min_loss_scale, "
                f"max_loss_scale] = [{_formats.pow2_repr(self.min_loss_scale)}, "
                f"{_formats.pow2_repr(self.max_loss_scale)}]; pass an initial_scale inside the "
                f"bounds"
            )
        _validation.check_int("hysteresis", self.hysteresis, minimum=1)
        _validation.check_bool("consecutive_hysteresis", self.consecutive_hysteresis)

    def init(self) -> LossScaleState:
        return counters(self.initial_scale, self.hysteresis)

    def adjust(self, state: LossScaleState, grads_finite, loss_finite=True) -> LossScaleState:
        """Returns the next state (pure, branch-free, jit-able)."""
        grads_finite = jnp.asarray(grads_finite)
        loss_finite = jnp.asarray(loss_finite)
        applied = jnp.logical_and(grads_finite, loss_finite)
        overflow = jnp.logical_and(loss_finite, jnp.logical_not(grads_finite))
        scale = state.loss_scale

        count = state.finite_count + 1
        grow = jnp.logical_and(applied, count >= self.period)
        grown = jnp.minimum(scale * self.factor, self.max_loss_scale)

        hyst = jnp.where(overflow, jnp.maximum(state.hysteresis_left - 1, 0), state.hysteresis_left)
        backoff = jnp.logical_and(overflow, hyst == 0)
        shrunk = jnp.maximum(scale / self.factor, self.min_loss_scale)
        refill = grow | (applied & self.consecutive_hysteresis)
        hyst = jnp.where(refill, self.hysteresis, hyst)

        new_scale = jnp.where(grow, grown, jnp.where(backoff, shrunk, scale))
        finite_count = jnp.where(
            applied, jnp.where(grow, 0, count), jnp.where(overflow, 0, state.finite_count)
        )
        state = state._replace(
            loss_scale=new_scale.astype(jnp.float32),
            finite_count=finite_count.astype(jnp.int32),
            hysteresis_left=hyst.astype(jnp.int32),
        )
        return count_step(state, grads_finite, loss_finite)


GlobalScaler = NoLossScale | StaticLossScale | DynamicLossScale


def _notice_no_scaling(fmt: _formats.FloatFormat) -> None:
    notice_once(
        fmt.name,
        f"adaloss_jax: compute_dtype={fmt.name} has fp32's exponent range, so gradients do "
        f"not underflow and need no loss scaling; using NoLossScale (scale 1). "
        f"Loss scaling is for float16 and fp8.",
    )


def _resolve(compute_dtype: Any, scaler: GlobalScaler) -> GlobalScaler:
    fmt = _formats.float_format(compute_dtype, argname="compute_dtype")
    if fmt.needs_scaling:
        return scaler
    _notice_no_scaling(fmt)
    return NoLossScale(reason=f"compute_dtype={fmt.name} needs no loss scaling")


def no_scaling() -> NoLossScale:
    """No loss scaling (scale 1); non-finite steps are still skipped and counted.

    Returns:
      A :class:`NoLossScale`.

    >>> float(no_scaling().init().loss_scale)
    1.0
    """
    return NoLossScale()


def static(loss_scale: float = 2.0**15, *, compute_dtype: Any = "float16") -> GlobalScaler:
    """A fixed power-of-two loss scale; a no-op (with a one-time notice) unless the
    compute dtype is float16 or fp8.

    Args:
      loss_scale: the scale, a power of two.
      compute_dtype: the dtype the model computes in; for bf16 or fp32 the result is
        :class:`NoLossScale`.

    Returns:
      A :class:`StaticLossScale` (or :class:`NoLossScale`).

    Raises:
      ValueError: for a scale that is not a positive power of two in fp32's range.

    >>> static(2.0**10).loss_scale
    1024.0
    """
    return _resolve(compute_dtype, StaticLossScale(loss_scale))


def dynamic(*, compute_dtype: Any = "float16", **options: Any) -> GlobalScaler:
    """Dynamic global loss scaling: ``DynamicLossScale(**options)`` where
    ``compute_dtype`` needs scaling.

    Args:
      compute_dtype: the dtype the model computes in.
      **options: fields of :class:`DynamicLossScale` (``initial_scale``, ``period``,
        ``factor``, ``min_loss_scale``, ``max_loss_scale``, ``hysteresis``,
        ``consecutive_hysteresis``: documented there, its defaults where omitted).

    Returns:
      A :class:`DynamicLossScale`, or :class:`NoLossScale` for bf16/fp32 compute.

    Raises:
      ValueError: for an option out of range (not a power of two, bounds that do not
        hold ``initial_scale``), naming it and the fix.
      TypeError: for an option of the wrong type, or no option of
        :class:`DynamicLossScale`, naming it and the fix.

    Scaling is activated only for float16 and fp8 ``compute_dtype`` (Keras 3's
    choice): for bfloat16 or float32 this returns :class:`NoLossScale` and says so once.

    >>> dynamic(period=100)  # doctest: +NORMALIZE_WHITESPACE
    DynamicLossScale(initial_scale=2**15, period=100, factor=2.0, min_loss_scale=1.0,
                     max_loss_scale=2**64, hysteresis=1, consecutive_hysteresis=False)
    """
    known = [f.name for f in dataclasses.fields(DynamicLossScale)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"dynamic() got unknown option(s) {unknown}; its options are "
                        f"compute_dtype and the fields of DynamicLossScale: {known}")
    return _resolve(compute_dtype, DynamicLossScale(**options))
