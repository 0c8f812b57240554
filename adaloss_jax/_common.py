"""The floor both scaler families stand on: step counters, notices, XLA helpers and the
parameter fingerprint.

The global scalers (``_global_scalers``, ``_global_transforms``) and the adaptive core
(``_adaptive_scaler``, ``_state``, ``_rule``, ``_grad``, ``_adaptive`` and what they use)
import from the floor (this module, ``_skip``, ``_lookup``, ``_tree``, ``_formats``) and
never from each other; ``_lookup`` finds either family's state because each registers
its class, and what reads a state's contents (``_diagnostics``, ``_check``,
``_checkpoint``) sits above both. ``tests/test_layering.py`` holds the import graph to
that.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from adaloss_jax import _tree


class LossScaleState(NamedTuple):
    """State of a global loss scale; an adaptive state keeps its step counters in one too
    (``AdaptiveScaleState.base``).

    Attributes:
      loss_scale: current scale, fp32 scalar, always a finite power of two > 0.
      finite_count: consecutive applied steps since the scale last changed
        (jmp ``counter``, flax ``fin_steps``, torch ``_growth_tracker``).
      hysteresis_left: gradient overflows still tolerated before the scale backs off.
      notfinite_count: consecutive steps whose loss or gradients were not finite (a
        global scaler skips exactly those; an adaptive scaler's refusal of a finite
        step computed far below its scale is skipped but ends the run).
      total_applied: steps whose update was applied.
      total_skipped: steps skipped (gradient overflow or non-finite loss; for an adaptive
        scaler also a finite step refused as underscaled, or with nothing measured).
      total_nonfinite_loss: of ``total_skipped``, those whose *loss* was non-finite.
      last_applied: whether the most recent step was applied (bool scalar).

    >>> st = counters(1024.0, 1)
    >>> float(st.loss_scale), int(st.total_applied), bool(st.last_applied)
    (1024.0, 0, True)
    """

    loss_scale: jax.Array
    finite_count: jax.Array
    hysteresis_left: jax.Array
    notfinite_count: jax.Array
    total_applied: jax.Array
    total_skipped: jax.Array
    total_nonfinite_loss: jax.Array
    last_applied: jax.Array


def _i32(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def counters(scale: float, hysteresis: int) -> LossScaleState:
    """A fresh :class:`LossScaleState`: ``scale``, no step counted yet."""
    return LossScaleState(
        loss_scale=jnp.asarray(scale, jnp.float32),
        finite_count=_i32(0),
        hysteresis_left=_i32(hysteresis),
        notfinite_count=_i32(0),
        total_applied=_i32(0),
        total_skipped=_i32(0),
        total_nonfinite_loss=_i32(0),
        last_applied=jnp.asarray(True),
    )


def count_step(state: LossScaleState, grads_finite, loss_finite,
               refused=False) -> LossScaleState:
    """Updates the step counters; the scale fields are left to the scaler. ``refused``:
    the step was finite but is not applied (an adaptive scaler's verdict): it counts as
    skipped, and ends a run of non-finite steps as an applied step does."""
    finite = jnp.logical_and(grads_finite, loss_finite)
    applied = jnp.logical_and(finite, jnp.logical_not(refused))
    skipped = jnp.logical_not(applied)
    return state._replace(
        notfinite_count=jnp.where(finite, 0, state.notfinite_count + 1),
        total_applied=state.total_applied + applied.astype(jnp.int32),
        total_skipped=state.total_skipped + skipped.astype(jnp.int32),
        total_nonfinite_loss=state.total_nonfinite_loss
        + jnp.logical_not(loss_finite).astype(jnp.int32),
        last_applied=applied,
    )


# -- notices ---------------------------------------------------------------------------

_NOTICED: set[str] = set()
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` of the innermost caller outside this package: a warning then
    points at the user's line, however deep inside the library it is raised."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def notice_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)``, at the user's line, the first time ``key``
    is seen in this process (one set of keys for the whole package)."""
    if key in _NOTICED:
        return
    _NOTICED.add(key)
    warnings.warn(message, category, stacklevel=user_stacklevel())


RENAMED = "{old} is deprecated and goes in 0.4; use {new}"


def warn_renamed(old: str, new: str) -> None:
    """The warning an old name gives for the one release it is kept (CHANGELOG.md lists
    the renames), at the user's line."""
    warnings.warn(RENAMED.format(old=old, new=new), DeprecationWarning,
                  stacklevel=user_stacklevel())


# -- XLA helpers -----------------------------------------------------------------------


def min_once(values: Sequence[jax.Array]) -> jax.Array:
    """The min of scalars, computed once in the compiled program.

    Not ``minimum(v0, minimum(v1, ...))`` (nor a reduction of their stack, which XLA
    rewrites into that chain): XLA copies a chain of scalar ops into every fusion that
    reads its result, so a value read in many places (a skip decision, read once per
    parameter leaf; a scale read by every conversion along a residual stream) grew the
    program quadratically, and the fusions, each with its own copy, could no longer
    share compiled kernels. A scatter into one slot is computed once and read as a
    scalar.
    """
    v = jnp.stack([jnp.asarray(x) for x in values])
    if v.shape[0] == 1:
        return v[0]
    return jax.ops.segment_min(v, jnp.zeros(v.shape, jnp.int32), 1, indices_are_sorted=True)[0]


def all_of(flags: Sequence[jax.Array]) -> jax.Array:
    """The AND of boolean scalars, computed once in the compiled program
    (:func:`min_once`)."""
    if not flags:
        return jnp.asarray(True)
    if len(flags) == 1:
        return jnp.asarray(flags[0], jnp.bool_)
    return min_once([jnp.asarray(f, jnp.bool_).astype(jnp.int32) for f in flags]) > 0


def all_finite(tree: Any, *, axis_name: str | None = None) -> jax.Array:
    """True iff every element of every leaf is finite (on every device of ``axis_name``).

    Under ``shard_map``/``pmap`` pass ``axis_name`` so all devices agree; under SPMD
    ``jit`` the arrays are global and nothing extra is needed.

    Args:
      tree: any pytree of arrays.
      axis_name: a mapped axis to agree across.

    Returns:
      A bool scalar.

    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = jax.tree_util.tree_leaves(tree)
    ok = all_of([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])
    if axis_name is not None:
        ok = jax.lax.pmin(ok.astype(jnp.int32), axis_name) > 0
    return ok


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Branch-free ``on_true if pred else on_false`` over matching pytrees.

    Args:
      pred: a bool scalar.
      on_true: a pytree, taken where ``pred`` holds.
      on_false: a pytree of the same structure, taken where it does not.

    Returns:
      The selected pytree (each leaf through ``jnp.where``).

    >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
    [0.0, 0.0]
    """
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def to_fp32(g: jax.Array) -> jax.Array:
    """``g`` in fp32 (or wider): unscaling in fp16 would flush exactly the small values
    scaling protected."""
    return g.astype(jnp.promote_types(g.dtype, jnp.float32))


def in_shard_map() -> bool:
    """Whether this trace is inside a ``shard_map`` (its mesh has manual axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(getattr(mesh, "manual_axes", ())) if mesh is not None else False


# -- which model a state belongs to ----------------------------------------------------


def fingerprint(tree: Any) -> str:
    """A short hash of a parameter tree's leaf paths and ranks, then (after a ``.``) one
    of its leaf shapes. Not dtypes (fp32 master parameters and their fp16 gradients
    match). The shapes are compared only outside ``shard_map``: inside it a sharded
    parameter's gradient is its shard, of the full parameter's rank and a smaller size,
    and a state built by ``tx.init`` on the full parameters must accept it."""
    leaves, paths = jax.tree_util.tree_leaves(tree), _tree.leaf_paths(tree)
    shapes = [tuple(getattr(x, "shape", ())) for x in leaves]
    digest = lambda v: hashlib.sha1(repr(list(zip(paths, v))).encode()).hexdigest()[:12]
    return f"{digest([len(s) for s in shapes])}.{digest(shapes)}"


def check_fingerprint(expected: str, tree_or_fingerprint: Any, what: str, fix: str) -> None:
    """Refuses, at trace time, ``what`` that belongs to another model than ``expected``
    (other leaf paths or ranks; outside ``shard_map`` other shapes too)."""
    got = (tree_or_fingerprint if isinstance(tree_or_fingerprint, str)
           else fingerprint(tree_or_fingerprint))
    (want_ranks, _, want_shapes), (got_ranks, _, got_shapes) = (
        expected.partition("."), got.partition("."))
    if got_ranks != want_ranks:
        raise ValueError(
            f"{what} belong to another model than this optimizer state (parameter paths or "
            f"ranks differ: fingerprint {got} != {expected}); {fix}")
    if want_shapes and got_shapes and got_shapes != want_shapes and not in_shard_map():
        raise ValueError(
            f"{what} have other shapes than the parameters this optimizer state was built "
            f"for (the same paths and ranks, other sizes: another width or vocabulary?); "
            f"{fix}")
