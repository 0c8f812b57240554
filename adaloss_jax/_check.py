"""Check mode: compare adaptive-scaled gradients with an fp32 recomputation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from adaloss_jax import _formats, _grad, _groups, _tree
from adaloss_jax._adaptive_scaler import AdaptiveScale
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

    >>> print(GradientCheck(rows=[], disagreeing=[], rtol=0.02).disagreeing)
    []
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

    Args:
      loss_fn: the loss as trained (low precision).
      reference_loss_fn: the same loss computed in fp32.
      opt_state: the optimizer state (its scales are used; nothing is updated).
      params: the parameters.
      *args: the batch, as ``loss_fn`` takes it.
      **kwargs: keyword arguments of ``loss_fn``.
      rtol: the relative error above which a leaf disagrees.

    Returns:
      A :class:`GradientCheck` (its ``str`` is a table).

    Raises:
      TypeError: when a scaler is passed where the optimizer state goes (the 0.1
        signature).

    >>> import jax.numpy as jnp, optax
    >>> import adaloss_jax as alj
    >>> layer = alj.scale_group("dense")(lambda p, x: jnp.tanh(x @ p["w"].astype(x.dtype)))
    >>> params = {"dense": {"w": jnp.eye(4) / 2}}
    >>> loss = lambda dt: lambda p, x: jnp.sum(layer(p["dense"], x.astype(dt)).astype(
    ...     jnp.float32))
    >>> state = alj.adaptive_unscale(alj.adaptive(groups="module")).init(params)
    >>> state = state.with_log2_scales({"": 10, "dense": 10})
    >>> check = alj.diagnostics.check_gradients
    >>> report = check(loss(jnp.float16), loss(jnp.float32), state, params,
    ...                              jnp.ones((2, 4)))
    >>> report.disagreeing
    []
    >>> [(r["name"], r["group"], r["scale"]) for r in report.rows]
    [('dense/w', 'dense', 1024.0)]

    Note: ``rtol`` also catches plain fp16 rounding: a leaf can show a few percent of
    relative error with no underflow and ample headroom, the same at any power-of-two
    scale; read ``underflow_rate`` and ``headroom`` before blaming the scales. A leaf
    whose exact gradient is zero (e.g. the key bias of attention) shows
    fp16 rounding noise against an fp32 reference of about the same noise, so its
    relative error is large for any scaler; read such rows with that in mind.
    """
    if isinstance(opt_state, AdaptiveScale):
        raise TypeError(
            "check_gradients(loss_fn, reference_loss_fn, opt_state, params, *batch) reads the "
            "scaler from opt_state: drop the scaler argument")
    scaler = _grad.adaptive_state(opt_state).scaler
    results, used = jax.device_get(
        _compiled(loss_fn, reference_loss_fn, scaler)(opt_state, params, args, kwargs))
    rows, bad = [], []
    for path, st in zip(_tree.leaf_paths(params), results):
        name = _tree.name(path)
        group = _groups.leaf_group(path, set(used), scaler)
        row = {"name": name, "group": group or "(root)"}
        row.update({k: np.asarray(v).item() for k, v in st.items()})
        rows.append(row)
        if not row["rel_error"] <= rtol:
            bad.append(name)
    return GradientCheck(rows=rows, disagreeing=bad, rtol=rtol)


@functools.lru_cache(maxsize=8)
def _compiled(loss_fn, reference_loss_fn, scaler):
    """The jitted comparison, kept per (loss, reference, scaler): repeated checks of one
    run compile once. Returns each leaf's statistics and the groups in use (static
    names of a :class:`~adaloss_jax.GroupVector`)."""
    fmt = scaler.format

    @jax.jit
    def compute(opt_state, params, args, kwargs):
        _, grads, stats = _grad.adaptive_value_and_grad(loss_fn)(
            opt_state, params, *args, **kwargs
        )
        ref = jax.grad(reference_loss_fn)(params, *args, **kwargs)
        active = set(stats.log2_scales)
        out = []
        for path, g, r in zip(
            _tree.leaf_paths(grads),
            jax.tree_util.tree_leaves(grads),
            jax.tree_util.tree_leaves(ref),
        ):
            scale = _formats.pow2(stats.log2_scales[_groups.leaf_group(path, active, scaler)])
            out.append(_stats.tensor_stats(r, g, scale, fmt))
        return out, stats.log2_scales

    return compute
