"""Check mode: compare adaptive-scaled gradients with an fp32 recomputation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from adaloss_jax import _adaptive
from adaloss_jax.numerics import _stats, _table


@dataclasses.dataclass(frozen=True)
class GradientCheck:
    """Result of :func:`check_gradients`.

    Attributes:
      rows: one dict per parameter leaf: ``name``, ``group``, ``scale`` and the
        statistics of :func:`adaloss_jax.numerics.tensor_stats` (``rel_error``,
        ``underflow_rate``, ``headroom``, ...).
      disagreeing: names of the leaves whose relative error exceeds ``rtol``.
      rtol: the tolerance used.
    """

    rows: list[dict]
    disagreeing: list[str]
    rtol: float

    def __str__(self) -> str:
        cols = ("name", "group", "scale", "rel_error", "underflow_rate", "headroom")
        verdict = (
            "all leaves within rtol" if not self.disagreeing
            else f"{len(self.disagreeing)} leaves disagree: " + ", ".join(self.disagreeing)
        )
        return _table.format_table(self.rows, columns=cols) + f"\n# rtol={self.rtol}: {verdict}"


def check_gradients(
    loss_fn: Callable[..., Any],
    reference_loss_fn: Callable[..., Any],
    scaler: _adaptive.AdaptiveScale,
    opt_state: Any,
    params: Any,
    *args,
    rtol: float = 2e-2,
    **kwargs,
) -> GradientCheck:
    """Recomputes the step's gradients in fp32 and names the leaves that disagree.

    ``loss_fn`` is the low-precision loss as trained; ``reference_loss_fn`` the same loss
    computed in fp32 (e.g. with the model built with ``dtype=jnp.float32``), both called
    as ``f(params, *args, **kwargs)``. The adaptive gradients are taken with the scales in
    ``opt_state`` and unscaled per leaf; nothing is updated. Call it outside ``jit`` (it
    jits its own computation) every so often, not every step.

    Note: ``rtol`` also catches plain fp16 rounding: a leaf can show a few percent of
    relative error with no underflow and ample headroom, the same at any power-of-two
    scale; read ``underflow_rate`` and ``headroom`` before blaming the scales. A leaf
    whose exact gradient is zero (e.g. the key bias of attention) shows
    fp16 rounding noise against an fp32 reference of about the same noise, so its
    relative error is large for any scaler; read such rows with that in mind.
    """
    _adaptive._check_scaler(scaler)
    compute, leaf_groups = _compiled(loss_fn, reference_loss_fn, scaler)
    results = jax.device_get(compute(opt_state, params, args, kwargs))
    groups = leaf_groups[jax.tree_util.tree_structure(params)]
    rows, bad = [], []
    for path, group, st in zip(_adaptive._leaf_paths(params), groups, results):
        name = "/".join(path)
        row = {"name": name, "group": group or "(root)"}
        row.update({k: np.asarray(v).item() for k, v in st.items()})
        rows.append(row)
        if not row["rel_error"] <= rtol:
            bad.append(name)
    return GradientCheck(rows=rows, disagreeing=bad, rtol=rtol)


@functools.lru_cache(maxsize=8)
def _compiled(loss_fn, reference_loss_fn, scaler):
    """The jitted comparison, kept per (loss, reference, scaler): repeated checks of one
    run compile once."""
    fmt = scaler.format
    # Filled while tracing: which group each leaf belongs to, per parameter structure.
    leaf_groups: dict[Any, list[str]] = {}

    @jax.jit
    def compute(opt_state, params, args, kwargs):
        groups = leaf_groups[jax.tree_util.tree_structure(params)] = []
        _, grads, stats = _adaptive.adaptive_value_and_grad(loss_fn, scaler)(
            opt_state, params, *args, **kwargs
        )
        ref = jax.grad(reference_loss_fn)(params, *args, **kwargs)
        active = set(stats.log2_scales)
        out = []
        for path, g, r in zip(
            _adaptive._leaf_paths(grads),
            jax.tree_util.tree_leaves(grads),
            jax.tree_util.tree_leaves(ref),
        ):
            group = _adaptive._leaf_group(path, active, scaler)
            groups.append(group)
            scale = _adaptive.pow2(stats.log2_scales[group])
            out.append(_stats.tensor_stats(r, g, scale, fmt))
        return out

    return compute, leaf_groups
