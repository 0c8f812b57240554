"""Reading a scaler's state outside ``jit``: a table, a summary for logs, and what its
health bits mean. Every function takes whatever holds the state (an optimizer state, a
flax ``TrainState``, an ``nnx.Optimizer``) and works for global and adaptive scalers."""

from __future__ import annotations

import math
from typing import Any

import jax

from adaloss_jax import _common, _lookup, _tree
from adaloss_jax._layout import Layer, group_of
from adaloss_jax._state import (
    AdaptiveScaleState,
    Health,
)


def _groups(tree: Any) -> tuple[Any, list[tuple[str, float, float, bool]]]:
    """The scaler state and ``(group, log2 scale, log2 unit amax, overflowed)`` rows; a
    global scaler is one group, the root, with nothing measured. A stack's slots
    (``g[0]``, ``g[1]``, ...) are rows once one of them was measured; until then its
    own scale is."""
    st = jax.device_get(_lookup.scale_state(tree))
    if not isinstance(st, AdaptiveScaleState):
        overflowed = not bool(st.last_applied) and int(st.total_skipped) > 0
        return st, [(_tree.ROOT, math.log2(float(st.loss_scale)), -math.inf, overflowed)]
    rows = [(g, float(st.log2_scales[g]), float(st.log2_amax[g]), bool(st.overflowed[g]))
            for g in st.groups]
    # A group that may be a stack of layers has a slot per layer besides its own scale;
    # the ones its scans used are shown (the slots once any was measured, else the group).
    by_layer = {}
    for g, _, a, _ in rows:
        if isinstance(g, Layer):
            by_layer[g.group] = by_layer.get(g.group, False) or a > -math.inf
    measured = {g for g, _, a, _ in rows if a > -math.inf}
    rows = [r for r in rows if not (
        (isinstance(r[0], Layer) and not by_layer.get(r[0].group, True))
        or (by_layer.get(r[0]) and r[0] not in measured))]
    # A scale_group name above other groups (param_groups) is shown once a call used it;
    # then the groups under it, which no call uses, are not.
    base = group_of
    bases = {base(g) for g, _, _, _ in rows}
    under = lambda g, above: bool(above) and g.startswith(above + "/")
    return st, [r for r in rows if r[0] in measured or not (
        any(under(b, base(r[0])) for b in bases)
        or any(under(base(r[0]), base(m)) for m in measured))]


def _amax(a: float) -> float | None:
    """A log2 unit amax for people: rounded, ``None`` for nothing measured (``-inf``)."""
    return round(a, 2) if a > -math.inf else None


def scale_summary(tree: Any) -> dict:
    """The scales as plain, rounded Python data for logs.

    Args:
      tree: anything holding a scaler state (see :func:`adaloss_jax.scale_state`).

    Returns:
      ``log2_group_scales`` (whole binades for the adaptive rule), ``log2_unit_amax``
      (the rule's held peak of ``log2`` of the largest gradient magnitude the group
      measured, taken back to scale 1, to 0.01; ``None``: nothing measured yet, and
      always for a global scaler, which measures nothing) and ``overflowed`` (the group
      was blamed for an overflow at its last step; each ``{group: value}``, in model order, the
      root ``""`` first), and ``group_log2_min_med_max`` over the non-root groups (the
      root if it is alone).

    >>> import adaloss_jax as alj
    >>> summary = alj.diagnostics.scale_summary(alj.dynamic(initial_scale=2.0**10).init())
    >>> summary["log2_group_scales"]
    {'': 10.0}
    """
    _, rows = _groups(tree)
    scales = {g: round(s, 2) for g, s, _, _ in rows}
    vals = sorted(v for g, v in scales.items() if g) or [scales[_tree.ROOT]]
    mid = len(vals) // 2
    median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
    return {
        "log2_group_scales": scales,
        "log2_unit_amax": {g: _amax(a) for g, _, a, _ in rows},
        "overflowed": {g: o for g, _, _, o in rows},
        "group_log2_min_med_max": [vals[0], median, vals[-1]],
    }


TABLE_FOOTER = (
    "log2 scale: each group's gradients are computed at 2**(log2 scale) and divided by it.\n"
    "log2 unit amax: the peak the rule holds of log2 of the largest gradient magnitude the\n"
    "group measured, taken back to scale 1 (it sinks `decay` binades a step below a new\n"
    "measurement; '-': nothing measured yet; a global scaler measures nothing).\n"
    "overflowed: the group was blamed for an overflow at its last step (one that only\n"
    "received another group's non-finite values backs off with it, unblamed).")


def scale_table(tree: Any, *, legend: bool = True) -> str:
    """The scales and last statistics as a text table, one row per group.

    Args:
      tree: anything holding a scaler state (see :func:`adaloss_jax.scale_state`).
      legend: end with lines saying what each column means.

    Returns:
      The table, a string.

    >>> import adaloss_jax as alj
    >>> print(alj.diagnostics.scale_table(alj.static(2.0**12).init(), legend=False))
    group                                    log2 scale  log2 unit amax overflowed
    (root)                                           12               -      False
    """
    _, rows = _groups(tree)
    lines = [f"{'group':<40} {'log2 scale':>10} {'log2 unit amax':>15} {'overflowed':>10}"]
    for g, s, a, o in rows:
        shown = f"{a:.1f}" if a > -math.inf else "-"
        lines.append(f"{(g or '(root)'):<40} {s:>10.0f} {shown:>15} {o!s:>10}")
    return "\n".join(lines + ([TABLE_FOOTER] if legend else []))


def status_line(tree: Any, *, warn: bool = True) -> str:
    """One line on the scaler for a training log: whether the last step was applied, the
    scales' range, the skipped steps, the retried passes and the health.

    Args:
      tree: anything holding a scaler state (see :func:`adaloss_jax.scale_state`).
      warn: also issue what :func:`check_health` finds as warnings (once each), so a run
        of skipped steps is not silent in a loop that logs this line.

    Returns:
      A line such as ``applied | scale 2^3..2^14 (3 groups) | skipped 1/41, 0
      non-finite in a row | retried 2 | ok``.

    >>> import adaloss_jax as alj
    >>> alj.diagnostics.status_line(alj.dynamic(initial_scale=2.0**10).init())
    'applied | scale 2^10 | skipped 0/0, 0 non-finite in a row | ok'
    """
    st, rows = _groups(tree)
    scales = [s for g, s, _, _ in rows if g] or [s for _, s, _, _ in rows]
    lo, hi = min(scales), max(scales)
    span = f"2^{lo:g}" if lo == hi else f"2^{lo:g}..2^{hi:g}"
    if isinstance(st, AdaptiveScaleState):
        span += f" ({len(scales)} group{'s' * (len(scales) != 1)})"
    applied, skipped = int(st.total_applied), int(st.total_skipped)
    parts = ["applied" if bool(st.last_applied) else "SKIPPED", f"scale {span}",
             f"skipped {skipped}/{applied + skipped}, "
             f"{int(st.notfinite_count)} non-finite in a row"]
    if isinstance(st, AdaptiveScaleState) and int(st.total_retries):
        parts.append(f"retried {int(st.total_retries)}")
    problems = check_health(tree, warn=warn)
    parts.append(f"{len(problems)} problem(s): see check_health" if problems else "ok")
    return " | ".join(parts)


_HEALTH_TEXT = {
    Health.SKIPPING: (
        "{k}+ steps in a row were not finite. If the loss is finite, something non-finite "
        "appears in the backward pass at any scale (log or sqrt of 0, inf * 0, a division "
        "by 0): find it with adaloss_jax.diagnostics.check_gradients or jax.debug_nans; "
        "scaling cannot fix it."
    ),
    Health.PINNED_LOW: (
        "a group overflowed at min_loss_scale, so backing it off cannot help: its backward "
        "pass makes non-finite values at any scale, or min_loss_scale is too high for this "
        "model; lower min_loss_scale or fix the non-finite operation."
    ),
    Health.NOTHING_MEASURED: (
        "nothing was measured at max_loss_scale: the gradients are exactly zero (the loss "
        "does not depend on the parameters, or everything is frozen); check that the loss "
        "function returns a loss computed from params."
    ),
    Health.SPAN: (
        "one global scale cannot hold this model's gradients: their amax at the module "
        "boundaries spread over more binades than grad_dtype holds, so the smallest "
        "flush to zero whatever the scale (the step is applied with them flushed). Give "
        "each module its own scale: adaloss_jax.adaptive(groups='module', ...)."
    ),
    Health.FOREIGN_GRADS: (
        "the gradients handed to tx.update are not the ones its scale_stats were measured "
        "with (their largest magnitude per group differs): they are unscaled by scales "
        "they were not computed at. Pass the grads and stats of the same "
        "adaloss_jax.adaptive_value_and_grad call, unchanged (not jax.grad's gradients, not "
        "clipped, not accumulated over microbatches before the scaler: see the gradient "
        "accumulation page)."
    ),
}
_SKIPPING_LIMIT = 16  # a global scaler's state has no limit of its own: the adaptive default


def check_health(tree: Any, *, warn: bool = True) -> list[str]:
    """What the scaler state says is wrong, with the fix.

    An adaptive state's ``health`` bits are explained; a global scaler's state is judged
    by its run of skipped steps, all non-finite (16 in a row, the adaptive default).

    Args:
      tree: anything holding a scaler state (see :func:`adaloss_jax.scale_state`).
      warn: also issue each message as a ``RuntimeWarning``, once per process.

    Returns:
      One message per problem; empty when all is well.

    >>> import adaloss_jax as alj
    >>> alj.diagnostics.check_health(alj.dynamic().init())
    []
    """
    st, _ = _groups(tree)
    k = int(st.notfinite_count)
    if isinstance(st, AdaptiveScaleState):
        bits = int(st.health)
    else:
        bits = Health.SKIPPING if k >= _SKIPPING_LIMIT else 0
    msgs = [t.format(k=k) for b, t in _HEALTH_TEXT.items() if bits & b]
    if warn:
        for m in msgs:
            _common.notice_once(f"health: {m}", f"adaloss_jax: {m}", RuntimeWarning)
    return msgs
