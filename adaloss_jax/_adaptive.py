"""Adaptive per-layer loss scaling (Zhao et al., arXiv 1910.12385), for any JAX model:
the gradient function and the Optax transformations.

One step, all inside one ``jax.jit``:

1. :func:`adaptive_value_and_grad` records the loss once with its module calls marked
   (:mod:`adaloss_jax._record`), finds where per-group scales live along the backward
   stream (:mod:`adaloss_jax._stream`), evaluates the recorded program with the scale
   points applied (:mod:`adaloss_jax._apply`) under ``jax.value_and_grad``, and decodes
   the statistics rows into per-group :class:`~adaloss_jax.ScaleStats`
   (:mod:`adaloss_jax._channel`). The scales come from the optimizer state, which also
   holds the scaler: the configuration is given once, to the optimizer.
2. :func:`adaptive_unscale` unscales each parameter leaf by the scale its group's
   gradients were computed at, checks finiteness, and sets the next scales with the
   pure rule of :func:`adaloss_jax._rule.adjust`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from adaloss_jax import (
    _apply,
    _channel,
    _common,
    _config,
    _formats,
    _lookup,
    _record,
    _rule,
    _skip,
    _stream,
    _tree,
)
from adaloss_jax._common import check_fingerprint, fingerprint, in_shard_map
from adaloss_jax._config import AdaptiveScale
from adaloss_jax._layout import GroupVector, Layer, check_names, layers, order, runs
from adaloss_jax._state import (
    HEALTH_FOREIGN_GRADS,
    AdaptiveScaleState,
    ScaleStats,
    initial_state,
)
from adaloss_jax._tree import ROOT

# ------------------------------------------------------------------------------ groups


def _owner_paths(params, max_depth: int | None = None) -> set[tuple[str, ...]]:
    """The module paths that own leaves directly (the top level's own leaves excluded),
    cut at ``max_depth``."""
    return {p[:-1][:max_depth] for p in _tree.leaf_paths(params) if len(p) > 1}


def _marked_above(params, max_depth: int | None = None) -> set[tuple[str, ...]]:
    """The paths marked with :func:`adaloss_jax.scale_group` that hold parameters only
    below them (``params["blk"] = {"a": ..., "b": ...}``): each is a group too, that a
    marked call takes for all the parameters under it (a framework's module at such a
    path is not, so a name marked elsewhere changes nothing for it)."""
    owners = _owner_paths(params, max_depth)
    return {m[:max_depth] for m in _record.MARKED
            if m[:max_depth] not in owners
            and any(o[:len(m)] == m and len(o) > len(m) for o in owners)}


def param_groups(params: Any, scaler: AdaptiveScale) -> list[str]:
    """The scale groups of a parameter tree, in model order.

    The root and, with ``groups="module"``, every module that owns parameters directly
    (or through modules deeper than ``max_depth``), every name marked with
    :func:`adaloss_jax.scale_group` that holds parameters nested below it (used where a
    marked call takes them; hidden from the diagnostics until then), and for a group
    that may be a stack of layers run by a scan (docs: concepts, stacks of layers) a slot
    per layer, ``g[0]``, ``g[1]``, ...

    Args:
      params: the parameters (any pytree; a linen ``{"params": ...}`` collection is
        looked through).
      scaler: the :class:`~adaloss_jax.AdaptiveScale`.

    Returns:
      Group names; the root is ``""``.

    >>> import jax.numpy as jnp
    >>> p = {"Dense_0": {"kernel": jnp.ones((2, 2))}, "Dense_1": {"kernel": jnp.ones(2)}}
    >>> param_groups(p, AdaptiveScale(groups="module"))
    ['', 'Dense_0', 'Dense_1']
    """
    groups = {ROOT} | {scaler.group_of(o) for o in _owner_paths(params) | _marked_above(params)}
    for g, n in stack_lengths(params, scaler).items():
        groups |= set(layers(g, n))
    check_names(list(groups))
    return order(groups)


MAX_STACK = 1024  # the deepest stack of layers that gets a scale per layer


def stack_lengths(params: Any, scaler: AdaptiveScale) -> dict[str, int]:
    """The groups that may be a stack of layers run by a scan, and their depth ``n``:
    every floating leaf of the group has at least two dimensions and the same leading
    one (``2 <= n <= MAX_STACK``), and the group holds a leaf of three or more
    dimensions or several leaves (one matrix alone, a plain layer's weight or an
    embedding, is not taken for a stack). Such a group gets a slot ``g[i]`` per layer
    besides its own scale: the gradient function uses the slots where the trace shows
    the leaves scanned over, and the group's own scale anywhere else."""
    if scaler.groups != "module":
        return {}
    shapes: dict[str, list] = {}
    marked = _marked_above(params)
    for path, leaf in zip(_tree.leaf_paths(params), jax.tree_util.tree_leaves(params)):
        if len(path) > 1 and _tree.is_float(leaf):
            for owner in [path[:-1]] + [m for m in marked if path[:len(m)] == m]:
                shapes.setdefault(scaler.group_of(owner), []).append(
                    tuple(getattr(leaf, "shape", ())))
    out = {}
    for g, ss in shapes.items():
        lead = {s[0] if len(s) >= 2 else None for s in ss}
        n = next(iter(lead))
        if (len(lead) == 1 and n is not None and 2 <= n <= MAX_STACK
                and (len(ss) > 1 or len(ss[0]) >= 3)):
            out[g] = n
    return out


def leaf_group(path: tuple[str, ...], active, scaler: AdaptiveScale) -> str:
    """The group a parameter leaf at ``path`` belongs to: its nearest enclosing module
    among the ``active`` groups, else the root."""
    owner = path[:-1]
    for i in range(len(owner), 0, -1):
        g = scaler.group_of(owner[:i])
        if g in active:
            return g
    return ROOT


# --------------------------------------------------------------------- the gradient


def _selector(scaler: AdaptiveScale, owners: set, deep: set, marked: set = frozenset()
              ) -> Callable:
    """``(path, module) -> "group" | "measure" | None`` for the recorder: a module that
    owns parameters is a group (so is a ``scale_group`` call at a ``marked`` path, above
    its parameters), any other call is measured and cut, and a module deeper
    than ``max_depth`` (added to ``deep``) or rejected by the filter gets no point."""

    def selects(path, module):
        if scaler.max_depth is not None and len(path) > scaler.max_depth:
            deep.add(path)
            return None
        if scaler.filter is not None and module is not None and not scaler.filter(path, module):
            return None
        return "group" if path in owners or (module is None and path in marked) else "measure"

    return selects


def _check_recording(rec: _record.Recording, scaler: AdaptiveScale, owners: set,
                     deep: set) -> set[str]:
    """The groups the loss calls, or an error naming what is wrong and the fix."""
    group_calls = {_tree.name(c.path) for c in rec.calls if c.group}
    if scaler.groups == "module":
        if not rec.reported:
            raise ValueError(
                "groups='module' found no module call inside the loss function: call the "
                "model inside it (model.apply(...) for linen; for NNX use "
                "adaloss_jax.flax.nnx_adaptive_value_and_grad, for Equinox "
                "adaloss_jax.equinox.eqx_adaptive_value_and_grad), or mark layer functions "
                "with adaloss_jax.scale_group(name) (pure JAX), or use groups='global'. "
                "Linen models are seen once adaloss_jax.flax can be imported.")
        if not group_calls and owners and scaler.filter is not None:
            raise ValueError(
                f"the filter {scaler.filter!r} selected no module that owns parameters: no "
                f"scale group was formed; pass a filter that accepts at least one module (or "
                f"filter=None for all)")
        if not group_calls and owners:  # (parameters owned by the root alone: one group)
            calls = sorted({_tree.name(c.path) or "(root)" for c in rec.calls})[:4]
            owned = sorted(_tree.name(o) for o in owners)[:4]
            raise ValueError(
                f"no module call matched a module that owns parameters (calls: {calls}; "
                f"parameters owned by: {owned}): no scale group was formed. Apply the model "
                f"to the parameters the loss is given, or to a sub-tree of them "
                f"(model.apply({{'params': params['student']}}, ...) is found by the identity "
                f"of its leaves; parameters rebuilt or cast before the call are not)")
    uncut = sorted({_tree.name(p[:scaler.max_depth]) for p in deep}
                   - {_tree.name(c.path) for c in rec.calls})
    if uncut:  # every module under it would run unmeasured (and, per module, ungrouped)
        k = scaler.max_depth
        raise ValueError(
            f"max_depth={k}: modules under {uncut[:4]} are called, but {uncut[0]!r} itself "
            f"is no module call (a list or dict of modules?), so no scale point would go "
            f"around them (and with groups='module' their parameters would get no group of "
            f"their own); pass max_depth={k + 1} (paths count every component, a list index "
            f"included), or a filter")
    return group_calls if scaler.groups == "module" else set()


def _wide(rec: _record.Recording, scaler: AdaptiveScale) -> bool:
    """Whether the scaler is off: ``compute_dtype`` says bf16/fp32, or, left ``None``,
    the model computes in bf16/fp32 only (no float16 or ``grad_dtype`` value crosses a
    module boundary, and nothing is simulated): then no gradient underflows, and the
    scaler turns itself off, as :func:`adaloss_jax.dynamic` does (says so once)."""
    if scaler.compute_dtype is not None:
        return not _formats.float_format(scaler.compute_dtype).needs_scaling
    narrow = {jnp.dtype(jnp.float16), jnp.dtype(scaler.format.dtype)}
    if scaler.simulate or not rec.calls or rec.dtypes & narrow:
        return False
    _common.notice_once("wide-model", WIDE_MODEL.format(
        seen=sorted(d.name for d in rec.dtypes)))
    return True


WIDE_MODEL = (
    "adaloss_jax: no float16 value crossed a module boundary (saw {seen}): bf16/fp32 "
    "compute needs no loss scaling, so the adaptive scaler is off: every scale stays 1 "
    "and only non-finite steps are skipped (as dynamic() becomes no_scaling()). For fp8 "
    "gradients simulated in a wider model pass simulate=True; to scale an fp32 model all "
    "the same, compute_dtype='float16'")


SAME_STEP_NONE = (
    "adaloss_jax: same-step scales (same_step, on by default with groups='module'): no "
    "module's region of this loss can choose its scale in the backward pass (every one "
    "has a point on its border inside a scan that is no stack of layers or a shard_map of "
    "the loss, in another checkpoint body or cond branch, or met twice), so every scale "
    "is the rule's, set from the steps before, as with same_step=False. Call the modules "
    "outside the scan (or checkpoint) that holds them, or pass same_step=False to say "
    "the delayed scales are meant")


def _plan(rec: _record.Recording, scaler: AdaptiveScale, owners: list,
          stacks: dict) -> _stream.Plan:
    keep = rec.rounding if scaler.simulate else frozenset()
    plan = _stream.analyse(rec.closed.jaxpr, rec.sizes, owners, keep=keep, stacks=stacks)
    if scaler.groups == "module":
        return plan
    # One group: every point measures at the root scale and converts nothing.
    root = lambda anchors: None if anchors is None else (ROOT,)
    return _stream.Plan(
        tuple(pp if pp.x is None else _stream.PointPlan(tuple(map(root, pp.x)),
                                                          tuple(map(root, pp.y)))
              for pp in plan.points),
        tuple(map(root, plan.params)))


def trace(fun, scaler: AdaptiveScale, params, args: tuple, kwargs: dict, hooks=()
          ) -> tuple[_record.Recording, _apply.Program, list[str]]:
    """Records ``fun(params, *args, **kwargs)`` and plans its scale points: the recording,
    the program to evaluate, and the groups it uses (the root first)."""
    owners_all = _owner_paths(params, scaler.max_depth)
    deep: set = set()
    marked = _marked_above(params, scaler.max_depth)
    rec = _record.record(fun, params, args, kwargs,
                         _selector(scaler, owners_all, deep, marked), hooks)
    if rec.n_params != len(jax.tree_util.tree_leaves(params)):
        raise TypeError("every parameter leaf must be an array (adaptive_value_and_grad "
                        "differentiates all of them)")
    active = {ROOT} | _check_recording(rec, scaler, owners_all, deep)
    floats = [i for i, x in enumerate(rec.dynamic[:rec.n_params]) if _tree.is_float(x)]
    owners = [leaf_group(rec.param_paths[i], active, scaler) for i in floats]
    stacks = stack_lengths(params, scaler)
    plan = _plan(rec, scaler, owners, stacks)
    program = _apply.Program(rec.closed, plan, scaler, rec.rounding, owners)
    # A group scanned over as a stack of layers is used as its slots, a scale per layer.
    for g in plan.stacked & active:
        active = (active - {g}) | set(layers(g, stacks[g]))
    return rec, program, sorted(active, key=_tree.natural)


def adaptive_value_and_grad(
    fun: Callable[..., Any], *, has_aux: bool = False, hooks=()
) -> Callable[..., tuple[Any, Any, ScaleStats]]:
    """``jax.value_and_grad(fun)`` with a scale point at every module boundary.

    ``fun(params, *args, **kwargs)`` calls the model: a linen model's ``apply`` (any
    number of times), or functions marked with :func:`adaloss_jax.scale_group`, under any
    composition of ``jax.vmap``, ``lax.scan``, ``jax.checkpoint``, ``lax.cond``,
    ``jax.jit`` and ``shard_map``. The scaler and the scales come from the optimizer
    state (:func:`adaptive_unscale` holds them).

    Args:
      fun: the loss, ``fun(params, *args, **kwargs) -> loss`` (or ``(loss, aux)``).
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      hooks: extra context-manager factories ``hook(receiver)`` that make a framework
        report its module calls (front ends register theirs on import).

    Returns:
      ``g(opt_state, params, *args, **kwargs) -> (value, grads, stats)``: the unscaled
      loss (or ``(loss, aux)``), the *scaled* parameter gradients and the
      :class:`~adaloss_jax.ScaleStats`, for
      ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)``.

    Raises:
      ValueError: at trace time, for a state of another model, an optimizer state
        without an adaptive scaler, or a loss in which no module call is seen (the
        message names the fix).

    >>> import jax, jax.numpy as jnp, optax
    >>> import adaloss_jax as alj
    >>> dense = alj.scale_group("dense")(lambda p, x: jnp.tanh(x @ p["w"]))
    >>> params = {"dense": {"w": jnp.eye(4, dtype=jnp.float16)}}
    >>> loss_fn = lambda p, x: jnp.mean(dense(p["dense"], x).astype(jnp.float32) ** 2)
    >>> tx = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module"))
    >>> opt_state = tx.init(params)
    >>> x = jnp.ones((2, 4), jnp.float16)
    >>> loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(opt_state, params, x)
    >>> sorted(stats.log2_scales)
    ['', 'dense']
    """
    if not callable(fun):
        raise TypeError(f"fun must be the loss function, got {fun!r}")

    def wrapped(opt_state, params, *args, **kwargs):
        state = adaptive_state(opt_state)
        scaler = state.scaler
        check_fingerprint(state.fingerprint, params, "the parameters",
                          "pass the optimizer state built by tx.init for these parameters")
        rec, program, groups = trace(fun, scaler, params, args, kwargs, hooks)
        missing = sorted(set(groups) - set(state.groups), key=_tree.natural)
        if missing:
            raise ValueError(
                f"the loss calls scale groups {missing[:5]} that the optimizer state does not "
                f"know (state groups: {list(state.groups)[:8]}); build the state with "
                f"tx.init on the parameters this loss is given, after the functions are "
                f"marked with adaloss_jax.scale_group (the state's groups are formed from "
                f"the names marked by then)")
        sites = program.sites()
        rest = rec.dynamic[rec.n_params:]
        treedef = jax.tree_util.tree_structure(params)

        def attempt(scales: GroupVector, prior: AdaptiveScaleState | None = None):
            """The loss, the scaled gradients and the statistics at ``scales`` (and,
            given the ``prior`` state, with the live regions choosing their own)."""
            used = _in_use(scales, groups)
            log2 = _Scales(scales)
            sigma, ratios = _apply.anchor_scales(log2, program.pairs(), used)
            dummies = [jnp.zeros((*s.lead, program.columns.width), jnp.float32)
                       for s in sites]
            live = program.live.groups if prior is not None else ()
            chosen = {g: jnp.zeros((), jnp.float32) for g in live}

            def scaled(param_values, dummies, chosen):
                inputs = {g: (_limits(prior, g), chosen[g]) for g in live}
                axes = () if prior is None or _bound(prior.axis_name) is None else (
                    prior.axis_name,)
                outs = program.evaluate([*param_values, *rest], dummies, ratios,
                                        (sigma, inputs, axes) if live else None)
                out = rec.output(outs)
                loss, aux = out if has_aux else (out, None)
                loss32 = jnp.asarray(loss).astype(jnp.float32)
                return loss32 * _formats.pow2(log2[ROOT]), (loss, aux)

            (_, value), (g_values, rows, chosen) = jax.value_and_grad(
                scaled, argnums=(0, 1, 2), has_aux=True)(rec.dynamic[:rec.n_params],
                                                        dummies, chosen)
            grads = jax.tree_util.tree_unflatten(treedef, g_values)
            actual = used
            if live:  # the scales the live regions chose, each from its own cotangent
                # (returned as their difference from the plan: a decider never reached
                # leaves its region at the plan)
                actual = GroupVector(groups, [prior.log2_scales[g] + chosen[g] if g in chosen
                                              else used[g] for g in groups], split=True)
            return value, grads, _decode(program, sites, rows, actual, scaler, used)

        if scaler.same_step and not program.live.groups and len(groups) > 1:
            _common.notice_once("same-step-none", SAME_STEP_NONE)
        if _wide(rec, scaler):
            (loss, aux), grads, stats = _unscaled(attempt, state)
        elif scaler.retries:
            (loss, aux), grads, stats = _until_applied(attempt, state)
        else:
            (loss, aux), grads, stats = attempt(state.log2_scales, state)
        if stats.grad_amax is None:  # (the retry loop measured it for its verdict)
            stats = dataclasses.replace(stats, grad_amax=_unscale(grads, stats, scaler,
                                                                  state)[1])
        stats = dataclasses.replace(stats, fingerprint=fingerprint(params),
                                    origin=(state.groups, scaler))
        return ((loss, aux) if has_aux else loss), grads, stats

    return wrapped


def _limits(prior: AdaptiveScaleState, g: str) -> jax.Array:
    """What a live region's decider bounds its choice by (:func:`_channel.decide`):
    ``[headroom, prior, planned]``, the prior being the rule's scale once the group
    was measured or overflowed (+inf before)."""
    planned = prior.log2_scales[g]
    measured = (prior.log2_amax[g] > -jnp.inf) | prior.overflowed[g]
    return jnp.stack([jnp.ceil(prior.headroom[g]), jnp.where(measured, planned, jnp.inf),
                      planned]).astype(jnp.float32)


def _decode(program: _apply.Program, sites, rows, used: GroupVector,
            scaler: AdaptiveScale, planned: GroupVector | None = None) -> ScaleStats:
    """The rows of one backward pass as per-group statistics (a stack's rows per layer);
    ``used``: the scale each group's gradients were computed at, ``planned``: the
    scales the plan set (they differ for the live regions; a fan-in's scale is the
    min of its anchors' planned ones)."""
    specs, values = [], []
    for r, s in zip(rows, sites):
        axes = [a for a in range(len(s.lead)) if a != s.layer_axis]
        values.append(_channel.reduce_rows(r, axes))
        specs += ([s.row] if s.layer_axis is None else  # a row per layer
                  [_channel.Row(_stream.at(s.row.y, i), _stream.at(s.row.x, i),
                                s.row.y_max, s.row.x_max) for i in range(s.lead[s.layer_axis])])
    return _channel.decode(specs, values, used, program.columns, scaler.format.max,
                           planned=planned if program.live.groups else None,
                           fmt_min=scaler.format.min_subnormal if scaler.groups == "global"
                           else None)  # (only one global scale reads ``flushed``)


def _unscaled(attempt: Callable, state: AdaptiveScaleState):
    """``attempt`` at scale 1 everywhere, with the verdict of no scaling: the scales stay
    1, a step is applied when its loss and gradients are finite."""
    one = GroupVector(state.groups, jnp.zeros_like(state.log2_scales.array))
    value, grads, stats = attempt(one)
    axis_name = _bound(state.axis_name)
    base = _common.count_step(
        state.base._replace(loss_scale=jnp.ones_like(state.base.loss_scale)),
        _common.all_finite(grads, axis_name=axis_name),
        _common.all_finite(value[0], axis_name=axis_name))
    verdict = {f: getattr(state, f) for f in RETRIED}
    verdict.update(log2_scales=one, base=base, health=state.health,
                   retries=jnp.zeros((), jnp.int32))
    return value, grads, dataclasses.replace(stats, verdict=verdict)


def _until_applied(attempt: Callable, state: AdaptiveScaleState):
    """``attempt(scales)`` at the state's scales, and again, up to ``scaler.retries``
    times, at the scales the rule sets while it would skip the step and moves a scale
    (an overflow backed off, a step far below its scale): one ``lax.while_loop``, its
    body compiled once, one pass when the scales are right. The statistics returned
    carry the rule's verdict on their pass (``ScaleStats.verdict``: the next state),
    which the optimizer applies as it is, without deciding twice.

    A step is still skipped when no scale could change it (a non-finite loss, NaN in
    the data: the rule holds every scale) or after ``retries`` retries. What the loss
    returns that is no array (a name, a count in ``aux``) is handed back as it is.
    """
    scaler, axis_name = state.scaler, _bound(state.axis_name)
    layout: dict = {}

    def arrays(out) -> list:
        leaves, treedef = jax.tree_util.tree_flatten(out)
        kept = tuple(isinstance(x, jax.Array) for x in leaves)
        layout.update(treedef=treedef, kept=kept,
                      other=[x for x, k in zip(leaves, kept) if not k])
        return [x for x, k in zip(leaves, kept) if k]

    def rebuilt(values: list):
        it, other = iter(values), iter(layout["other"])
        return jax.tree_util.tree_unflatten(
            layout["treedef"], [next(it) if k else next(other) for k in layout["kept"]])

    def judged(prior: AdaptiveScaleState):
        """A pass at ``prior``'s scales (its statistics holding their gradients' amax,
        measured once for the rule and the optimizer's check) and the rule's verdict."""
        value, grads, stats = attempt(prior.log2_scales, prior)
        verdict, grad_amax = _verdict(prior, grads, stats, value[0], axis_name)
        return (value, grads, dataclasses.replace(stats, grad_amax=grad_amax)), verdict

    def body(carry):
        k, _, prior, _, _ = carry
        out, verdict = judged(prior)
        moved = jnp.any(verdict.log2_scales.array != prior.log2_scales.array)
        done = verdict.base.last_applied | ~moved | (k >= scaler.retries)
        # A retry runs at the verdict's scales, counters untouched (no step was taken).
        nxt = prior.replace(**{f: getattr(verdict, f) for f in RETRIED})
        return k + 1, done, nxt, verdict, arrays(out)

    shapes = jax.eval_shape(lambda st: arrays(judged(st)[0]), state)
    init = (jnp.int32(0), jnp.asarray(False), state, state,
            [jnp.zeros(x.shape, x.dtype) for x in shapes])
    if in_shard_map():  # inside shard_map: the carry's types must be a fixed point
        for _ in range(3):
            typed = _typed_like(init, jax.eval_shape(body, init))
            if jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: a is b, typed,
                                                             init)):
                break
            init = typed
    passes, _, _, verdict, values = jax.lax.while_loop(lambda c: ~c[1], body, init)
    value, grads, stats = rebuilt(values)
    fields = {f: getattr(verdict, f) for f in (*RETRIED, "base", "health")}
    return value, grads, dataclasses.replace(stats, verdict={**fields, "retries": passes - 1})


RETRIED = ("log2_scales", "log2_amax", "overflowed", "headroom", "ceiling")


def _bound(axis_name: str | None) -> str | None:
    """``axis_name`` where it is bound here (inside the ``shard_map`` it names), else
    None (a state built for a mapped step, used in an unmapped one)."""
    if axis_name is None:
        return None
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return None
    return axis_name


def _typed_like(tree, types):
    """``tree`` with each leaf made varying over the manual axes (inside ``shard_map``)
    that the matching leaf of ``types`` varies over, as a loop's carry must be."""

    def varying(x) -> frozenset:
        t = getattr(x, "manual_axis_type", None)
        if t is None:
            t = getattr(jax.typeof(x), "manual_axis_type", None)
        return frozenset(getattr(t, "varying", ()) or ())

    def cast(x, t):
        x = jnp.asarray(x)
        extra = varying(t) - varying(x)
        return jax.lax.pcast(x, tuple(sorted(extra)), to="varying") if extra else x

    return jax.tree_util.tree_map(cast, tree, types)


class _Scales(dict):
    """``log2[g]``: group ``g``'s log2 scale, read from the state when first asked for
    (a stack's slots are read as one vector, not one by one)."""

    def __init__(self, scales: GroupVector):
        super().__init__()
        self.scales = scales

    def __missing__(self, g):
        self[g] = value = self.scales[g]
        return value


def _in_use(scales: GroupVector, groups: list[str]) -> GroupVector:
    """The log2 scales of the groups in use, a stack's slots as its stored vector."""
    parts = []
    for a, _, stacked in runs(groups):
        parts.append(scales.stacked(groups[a].group) if stacked else scales[groups[a]])
    return GroupVector(groups, tuple(parts), split=True)


def adaptive_state(tree: Any) -> AdaptiveScaleState:
    """The :class:`~adaloss_jax.AdaptiveScaleState` inside an optimizer state (or a
    ``TrainState``, an ``nnx.Optimizer``), or an error naming how to build one."""
    state = _lookup.training_state(tree)
    if not isinstance(state, AdaptiveScaleState):
        raise ValueError(
            "the optimizer state holds a global scaler's state, not an adaptive one; build "
            "the optimizer with adaloss_jax.adaptive_scaled(inner, adaloss_jax.adaptive(...)) "
            "(or optax.chain(adaloss_jax.adaptive_unscale(scaler), inner)) for adaptive "
            "scaling, or use adaloss_jax.value_and_grad with a global scaler")
    return state


# ------------------------------------------------------------------------- optax side


OTHER_SCALER = (
    "this adaptive_unscale and the optimizer state were built with different scalers "
    "({diff}): re-run tx.init(params) with this transformation")
OTHER_STATE = (
    "scale_stats were measured with another optimizer state than the one given to update "
    "({diff}): pass the statistics that adaptive_value_and_grad returned for this same "
    "optimizer state, as in loss, grads, stats = adaptive_value_and_grad(loss_fn)("
    "opt_state, params, ...); tx.update(grads, opt_state, params, loss=loss, "
    "scale_stats=stats)")


def _short(groups: tuple) -> str:
    shown = ", ".join(repr(g) for g in groups[:5]) + (", ..." if len(groups) > 5 else "")
    return f"[{shown}] ({len(groups)} group{'s' * (len(groups) != 1)})"


def _check_update(state: AdaptiveScaleState, scaler: AdaptiveScale, updates,
                  stats) -> None:
    if not isinstance(stats, ScaleStats):
        raise ValueError(
            "adaptive_unscale needs scale_stats=... (got "
            f"{type(stats).__name__}): the statistics that "
            "adaloss_jax.adaptive_value_and_grad returns with the scaled gradients, as in "
            "tx.update(grads, opt_state, params, loss=loss, scale_stats=stats). Gradients "
            "of an unscaled loss (plain jax.grad) need no adaptive_unscale; for a flax "
            "TrainState use adaloss_jax.flax.TrainState and train_step")
    if state.scaler != scaler:
        raise ValueError(OTHER_SCALER.format(
            diff=_config.differences(scaler, state.scaler, names=("transformation", "state"))))
    check_fingerprint(state.fingerprint, updates, "the gradients",
                      "pass the gradients of the parameters tx.init was called with, or "
                      "re-run tx.init(params) for this model")
    if stats.fingerprint:
        check_fingerprint(state.fingerprint, stats.fingerprint, "the scale_stats",
                          "pass the statistics adaptive_value_and_grad returned for this "
                          "model with this optimizer state")
    if stats.origin and stats.origin != (state.groups, state.scaler):
        groups, other = stats.origin
        diff = [] if groups == state.groups else [
            f"groups {_short(groups)} (statistics) vs {_short(state.groups)} (state)"]
        if other != state.scaler:
            diff.append(_config.differences(other, state.scaler,
                                            names=("statistics", "state")))
        raise ValueError(OTHER_STATE.format(diff="; ".join(diff)))
    unknown = sorted(set(stats.log2_scales) - set(state.groups), key=_tree.natural)
    if unknown:
        raise ValueError(
            f"scale_stats has groups {unknown[:5]} that this optimizer state does not know "
            f"(state groups: {list(state.groups)[:8]}...); the state was built for another "
            f"model: re-run tx.init(params) for this one")


def _unscale(updates, stats: ScaleStats, scaler: AdaptiveScale, state: AdaptiveScaleState):
    """Each leaf in fp32 divided by its group's scale (a stack of layers: each slice by
    its layer's), and each state group's largest gradient magnitude at that scale (inf
    where a gradient is not finite)."""
    active = set(stats.log2_scales.names)
    stacked = {s.group for s in active if isinstance(s, Layer)}
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    leaf_groups = [leaf_group(p, active | stacked, scaler)
                   for p in _tree.leaf_paths(updates)]
    inv = {g: _formats.pow2(-(stats.log2_scales.stacked(g) if g in stacked
                              else stats.log2_scales[g]))
           for g in sorted(set(leaf_groups), key=_tree.natural)}
    out, leaf_max, index = [], [], []
    for g, leaf in zip(leaf_groups, leaves):
        x = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
        # Non-finite elements enter the max as inf (XLA's CPU max can drop a NaN).
        mag = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.asarray(jnp.inf, x.dtype))
        if g in stacked:  # slice i of the leaf is layer i's
            n = inv[g].shape[-1]
            leaf_max.append(jnp.max(mag.reshape(n, -1), axis=1, initial=0.0))
            index += [state.groups.index(s) for s in layers(g, n)]
            out.append(x * inv[g].reshape((n,) + (1,) * (x.ndim - 1)))
            continue
        leaf_max.append(jnp.max(mag, initial=0.0)[None])
        index.append(state.groups.index(g))
        out.append(x * inv[g])
    ng = len(state.groups)
    p_amax = jnp.zeros((ng,), jnp.float32)
    if leaves:
        p_amax = jax.ops.segment_max(jnp.concatenate(leaf_max).astype(jnp.float32),
                                     jnp.asarray(index), ng)
        p_amax = jnp.maximum(p_amax, 0.0)
    return jax.tree_util.tree_unflatten(treedef, out), p_amax


def _foreign(received: jax.Array, measured: jax.Array, axis_name: str | None) -> jax.Array:
    """Whether the gradients handed to ``update`` (their per-group largest magnitude at
    scale, ``received``) are not those the statistics came with (``measured``): another
    magnitude by more than 2x, or finite where those were not. Under a bound
    ``axis_name`` the gradients may have been summed or averaged over its devices since,
    so only a magnitude beyond ``2 n`` times the largest measured on any device counts."""
    if axis_name is None:
        finite_r, finite_m = received < jnp.inf, measured < jnp.inf
        apart = (received > 2 * measured) | (measured > 2 * received)
        return jnp.any((finite_r != finite_m) | (finite_r & finite_m & apart))
    n = jax.lax.axis_size(axis_name)
    top = jax.lax.pmax(measured, axis_name)
    beyond = jnp.any((received < jnp.inf) & (received > 2 * n * top))
    return jax.lax.pmax(beyond.astype(jnp.int32), axis_name) > 0


def _verdict(state: AdaptiveScaleState, grads, stats: ScaleStats, loss,
             axis_name) -> tuple[AdaptiveScaleState, jax.Array]:
    """The rule's next state for one pass (its gradients and statistics), and each state
    group's largest gradient magnitude at its scale on this device."""
    _, p_amax = _unscale(grads, stats, state.scaler, state)
    return _rule.adjust(state, _measured(state, stats, p_amax, loss, axis_name)), p_amax


def _reduce(x, op, axis_name):
    return x if axis_name is None or x is None else op(x, axis_name)


def _measured(state: AdaptiveScaleState, stats: ScaleStats, p_amax, loss,
              axis_name) -> _rule.Measured:
    """The step's statistics as vectors over the state's groups, reduced over devices."""
    ng = len(state.groups)
    idx = jnp.asarray([state.groups.index(g) for g in stats.log2_scales.names], jnp.int32)

    def full(v, fill, dtype):  # the group axis last, as in a GroupVector
        if v is None:
            return None
        shape = v.array.shape[:-1] + (ng,)
        return jnp.full(shape, fill, dtype).at[..., idx].set(v.array.astype(dtype))

    active = jnp.zeros((ng,), jnp.bool_).at[idx].set(True)
    p_amax = _reduce(p_amax, jax.lax.pmax, axis_name)
    p_nonfinite = ~(p_amax < jnp.inf)
    amax = _reduce(jnp.maximum(full(stats.amax, 0.0, jnp.float32), p_amax), jax.lax.pmax,
                   axis_name)
    bad = _reduce(full(stats.bad, False, jnp.bool_).astype(jnp.int32), jax.lax.pmax,
                  axis_name) > 0
    nonfinite = _reduce((stats.nonfinite | jnp.any(p_nonfinite)).astype(jnp.int32),
                        jax.lax.pmax, axis_name) > 0
    loss_finite = (jnp.asarray(True) if loss is None
                   else _common.all_finite(loss, axis_name=axis_name))
    used = jnp.where(active, full(stats.log2_scales, 0.0, jnp.float32),
                     state.log2_scales.array)
    return _rule.Measured(
        active=active, used=used, amax=amax, bad=bad, param_nonfinite=p_nonfinite,
        grads_finite=~nonfinite, loss_finite=loss_finite,
        sumsq=_reduce(full(stats.sumsq, 0.0, jnp.float32), jax.lax.psum, axis_name),
        count=_reduce(full(stats.count, 0.0, jnp.float32), jax.lax.psum, axis_name),
        hist=_reduce(None if stats.hist is None else full(stats.hist, 0.0, jnp.float32).T,
                     jax.lax.psum, axis_name),
        flushed=None if stats.flushed is None else _reduce(
            stats.flushed.astype(jnp.int32), jax.lax.pmax, axis_name) > 0)


def adaptive_unscale(
    scaler: AdaptiveScale | None = None, *, axis_name: str | None = None
) -> optax.GradientTransformationExtraArgs:
    """Unscales each parameter leaf by its own group's scale and sets the next scales.

    Use as ``optax.chain(adaptive_unscale(scaler), inner)`` (a skipped step hands
    ``inner`` a zero gradient) or, to skip exactly, :func:`adaptive_scaled`. Call
    ``tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)`` with the
    outputs of :func:`adaptive_value_and_grad`. Per step::

        updates = fp32(grads) / S_k          # S_k: the scale leaf's group k was computed at
        state   = adjust(state, statistics)  # the rule: adaloss_jax._rule.adjust
        if not state.last_applied: updates = -0.0 everywhere   # the skip signal

    Args:
      scaler: the :class:`~adaloss_jax.AdaptiveScale` (default ``AdaptiveScale()``); the
        state keeps it, and :func:`adaptive_value_and_grad` reads it from there.
      axis_name: a mapped axis (``shard_map``/``pmap``) to reduce statistics and
        finiteness over, so every device picks the same scales and skip decision.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`~adaloss_jax.AdaptiveScaleState`.

    Raises:
      ValueError: at trace time, without ``scale_stats``, or for gradients, statistics
        or a state of another model or scaler.

    >>> import jax.numpy as jnp
    >>> tx = adaptive_unscale(AdaptiveScale(groups="module"))
    >>> state = tx.init({"Dense_0": {"kernel": jnp.ones((2, 2))}})
    >>> state.groups
    ('', 'Dense_0')
    """
    scaler = AdaptiveScale() if scaler is None else scaler
    _check_scaler(scaler)

    def init_fn(params):
        if not jax.tree_util.tree_leaves(params):
            raise ValueError(
                "params has no leaves: adaptive_unscale keys its scale groups by the modules "
                "that own parameters; pass the model's parameters to tx.init")
        return initial_state(params, scaler, param_groups(params, scaler)).replace(
            axis_name=axis_name)

    def update_fn(updates, state, params=None, *, loss=None, scale_stats=None, **extra):
        del params, extra
        _check_update(state, scaler, updates, scale_stats)
        if scale_stats.verdict is None:
            state, _ = _verdict(state, updates, scale_stats, loss, axis_name)
        else:  # decided inside the gradient function, after its retries
            verdict = dict(scale_stats.verdict)
            retries = _reduce(verdict.pop("retries"), jax.lax.pmax, axis_name)
            state = state.replace(**verdict, total_retries=state.total_retries + retries)
        updates, received = _unscale(updates, scale_stats, scaler, state)
        if scale_stats.grad_amax is not None:
            foreign = _foreign(received, scale_stats.grad_amax, _bound(axis_name))
            state = state.replace(
                health=state.health | jnp.where(foreign, HEALTH_FOREIGN_GRADS, 0))
        return _skip.signal_skip(updates, state.base.last_applied), state

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

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      scaler: the :class:`~adaloss_jax.AdaptiveScale` (default ``AdaptiveScale()``).
      axis_name: as for :func:`adaptive_unscale`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    >>> import optax, jax.numpy as jnp
    >>> tx = adaptive_scaled(optax.adamw(1e-3), AdaptiveScale())
    >>> adaloss_state = tx.init({"w": jnp.ones(3)})[0]
    >>> float(adaloss_state.loss_scale)
    1.0
    """
    return optax.chain(adaptive_unscale(scaler, axis_name=axis_name),
                       _skip.skip_nonfinite(inner))


def _check_scaler(scaler) -> None:
    if not isinstance(scaler, AdaptiveScale):
        raise TypeError(
            f"scaler must be an AdaptiveScale from adaloss_jax.adaptive(), got {scaler!r} of "
            f"type {type(scaler).__name__}")
