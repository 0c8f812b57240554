"""The gradient function of adaptive scaling: :func:`adaptive_value_and_grad` records the
loss once with its module calls marked (:mod:`adaloss_jax._record`), finds where the
per-group scales live along the backward stream (:mod:`adaloss_jax._stream`), evaluates
the recorded program with the scale points applied (:mod:`adaloss_jax._apply`) under
``jax.value_and_grad``, and decodes the statistics rows into per-group
:class:`~adaloss_jax.ScaleStats` (:mod:`adaloss_jax._channel`); with retries, inside one
``lax.while_loop`` that asks :mod:`adaloss_jax._decide` for the rule's verdict on each
pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from adaloss_jax import (
    _apply,
    _common,
    _decide,
    _formats,
    _groups,
    _jaxpr,
    _live,
    _lookup,
    _record,
    _stream,
    _tree,
)
from adaloss_jax._adaptive_scaler import AdaptiveScale
from adaloss_jax._common import check_fingerprint, fingerprint, in_shard_map
from adaloss_jax._layout import GroupVector, layers, runs
from adaloss_jax._state import (
    AdaptiveScaleState,
    Handed,
    ScaleStats,
)
from adaloss_jax._tree import ROOT, state_group


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


NO_MODULE_CALL = (
    "groups='module' found no module call inside the loss function: call the model inside "
    "it (model.apply(...) for linen; for NNX use "
    "adaloss_jax.flax.nnx_adaptive_value_and_grad, for Equinox "
    "adaloss_jax.equinox.eqx_adaptive_value_and_grad), or mark layer functions with "
    "adaloss_jax.scale_group(name) (pure JAX), or use groups='global'. Linen models are "
    "seen once adaloss_jax.flax can be imported.")
FILTER_SELECTS_NOTHING = (
    "the filter {filter!r} selected no module that owns parameters: no scale group was "
    "formed; pass a filter that accepts at least one module (or filter=None for all)")
NO_OWNER_CALLED = (
    "no module call matched a module that owns parameters (calls: {calls}; parameters "
    "owned by: {owned}): no scale group was formed. Apply the model to the parameters the "
    "loss is given, or to a sub-tree of them (model.apply({{'params': "
    "params['student']}}, ...) is found by the identity of its leaves; parameters rebuilt "
    "or cast before the call are not)")
DEPTH_CUTS_A_CONTAINER = (
    "max_depth={k}: modules under {uncut} are called, but {first!r} itself is no module "
    "call (a list or dict of modules?), so no scale point would go around them (and with "
    "groups='module' their parameters would get no group of their own); pass "
    "max_depth={deeper} (paths count every component, a list index included), or a filter")
UNKNOWN_GROUPS = (
    "the loss calls scale groups {missing} that the optimizer state does not know (state "
    "groups: {known}); build the state with tx.init on the parameters this loss is given, "
    "after the functions are marked with adaloss_jax.scale_group (the state's groups are "
    "formed from the names marked by then)")
GLOBAL_STATE = (
    "the optimizer state holds a global scaler's state, not an adaptive one; build the "
    "optimizer with adaloss_jax.adaptive_scaled(inner, adaloss_jax.adaptive(...)) (or "
    "optax.chain(adaloss_jax.adaptive_unscale(scaler), inner)) for adaptive scaling, or use "
    "adaloss_jax.value_and_grad with a global scaler")


def _check_recording(rec: _record.Recording, scaler: AdaptiveScale, owners: set,
                     deep: set) -> set[str]:
    """The groups the loss calls, or an error naming what is wrong and the fix."""
    group_calls = {_tree.name(c.path) for c in rec.calls if c.group}
    if scaler.groups == "module":
        if not rec.reported:
            raise ValueError(NO_MODULE_CALL)
        if not group_calls and owners and scaler.filter is not None:
            raise ValueError(FILTER_SELECTS_NOTHING.format(filter=scaler.filter))
        if not group_calls and owners:  # (parameters owned by the root alone: one group)
            calls = sorted({_tree.name(c.path) or "(root)" for c in rec.calls})[:4]
            owned = sorted(_tree.name(o) for o in owners)[:4]
            raise ValueError(NO_OWNER_CALLED.format(calls=calls, owned=owned))
    uncut = sorted({_tree.name(p[:scaler.max_depth]) for p in deep}
                   - {_tree.name(c.path) for c in rec.calls})
    if uncut:  # every module under it would run unmeasured (and, per module, ungrouped)
        k = scaler.max_depth
        raise ValueError(DEPTH_CUTS_A_CONTAINER.format(k=k, uncut=uncut[:4], first=uncut[0],
                                                       deeper=k + 1))
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
    "has a point on its border inside a shard_map of the loss or a scan nested in a scan "
    "that is no stack of layers, or met twice, or is one region with the loss's: a loss "
    "that reads the parameters themselves, such as a penalty sum(p ** 2), joins every "
    "module's interior with it), so every scale is the rule's, set "
    "from the steps before, as with same_step=False. Call the modules outside the "
    "shard_map (or the inner scan) that holds them, put a weight penalty in the "
    "optimizer (optax.adamw, optax.add_decayed_weights), or pass same_step=False to say "
    "the delayed scales are meant")


def _plan(rec: _record.Recording, scaler: AdaptiveScale, owners: list,
          stacks: dict, rooted: frozenset | None = None) -> _stream.Plan:
    keep = rec.rounding if scaler.simulate else frozenset()
    plan = _stream.analyse(rec.closed.jaxpr, rec.sizes, owners, keep=keep, stacks=stacks,
                           casts=frozenset(rec.casts), rooted=rooted)
    if scaler.groups == "module":
        return plan
    # One group: every point measures at the root scale and converts nothing.
    root = lambda anchors: None if anchors is None else (ROOT,)
    return _stream.Plan(
        tuple(pp if pp.x is None else _stream.PointPlan(tuple(map(root, pp.x)),
                                                          tuple(map(root, pp.y)))
              for pp in plan.points),
        tuple(map(root, plan.params)))


def _root_casts(rec: _record.Recording, scaler: AdaptiveScale, owners: list,
                stacks: dict) -> _record.Recording:
    """``rec`` with a point after each cast of the loss that widens a model's output
    (``logits.astype(jnp.float32)``) in the region holding the loss: it measures the
    root's cotangent before the cast narrows it, so the root's statistics hold what the
    cast flushes (or overflows) at its scale, and the rule sets the root's scale from
    them at once instead of jumping blind."""
    narrow = {jnp.dtype(jnp.float16), jnp.dtype(scaler.format.dtype)}
    jaxpr = rec.closed.jaxpr
    casts = _jaxpr.widening_casts(jaxpr, narrow)
    if not casts:
        return rec
    inside = _stream.in_loss_region(jaxpr, rec.sizes, owners,
                                    [_jaxpr.region_var(jaxpr, i) for i in casts], stacks=stacks)
    return _record.mark_casts(rec, [i for i, k in zip(casts, inside) if k])


def trace(fun, scaler: AdaptiveScale, params, args: tuple, kwargs: dict, hooks=()
          ) -> tuple[_record.Recording, _apply.Program, list[str]]:
    """Records ``fun(params, *args, **kwargs)`` and plans its scale points: the recording,
    the program to evaluate, and the groups it uses (the root first)."""
    owners_all = _groups.owner_paths(params, scaler.max_depth)
    deep: set = set()
    marked = _groups.marked_above(params, scaler.max_depth)
    rec = _record.record(fun, params, args, kwargs,
                         _selector(scaler, owners_all, deep, marked), hooks)
    if rec.n_params != len(jax.tree_util.tree_leaves(params)):
        raise TypeError("every parameter leaf must be an array (adaptive_value_and_grad "
                        "differentiates all of them)")
    active = {ROOT} | _check_recording(rec, scaler, owners_all, deep)
    floats = [i for i, x in enumerate(rec.dynamic[:rec.n_params]) if _tree.is_float(x)]
    owners = [_groups.leaf_group(rec.param_paths[i], active, scaler) for i in floats]
    stacks = _groups.stack_lengths(params, scaler)
    rec = _root_casts(rec, scaler, owners, stacks)
    # With same-step scales the root's parameters anchor no region, but those read
    # where the region cannot choose its scale in the pass (_stream.analyse's rooted).
    plan = _plan(rec, scaler, owners, stacks, frozenset() if scaler.same_step else None)
    program = _apply.Program(rec.closed, plan, scaler, rec.rounding, owners, rec.casts)
    if scaler.same_step:
        stuck = frozenset(i for i, pair in enumerate(program.param_pairs)
                          if pair and pair[0] == (ROOT,)
                          and not _live.reads_a_choice(program.live, i, pair))
        if stuck:
            plan = _plan(rec, scaler, owners, stacks, stuck)
            program = _apply.Program(rec.closed, plan, scaler, rec.rounding, owners,
                                     rec.casts)
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
            raise ValueError(UNKNOWN_GROUPS.format(missing=missing[:5],
                                                   known=list(state.groups)[:8]))
        rest = rec.dynamic[rec.n_params:]
        treedef = jax.tree_util.tree_structure(params)

        def attempt(scales: GroupVector, prior: AdaptiveScaleState | None = None):
            """The loss, the scaled gradients and the statistics at ``scales`` (and,
            given the ``prior`` state, with the live regions choosing their own)."""
            used = _in_use(scales, groups)
            log2 = _Scales(scales)
            sigma, ratios = _apply.anchor_scales(log2, program.pairs(), used)
            dummies = program.dummies()
            live = program.live.groups if prior is not None else ()
            fanins = program.live.fanins if prior is not None else ()
            # (the fan-ins' zeros apart: a pytree's dict keys must sort)
            chosen = ({g: jnp.zeros((), jnp.float32) for g in live},
                      [jnp.zeros((), jnp.float32) for _ in fanins])
            limits = _limits(prior, live, fanins) if live or fanins else {}

            def scaled(param_values, dummies, chosen):
                inputs = {g: (limits[g], chosen[0][g]) for g in live}
                inputs.update({a: (limits[a], c) for a, c in zip(fanins, chosen[1])})
                axes = () if prior is None or _decide.bound(prior.axis_name) is None else (
                    prior.axis_name,)
                outs = program.evaluate([*param_values, *rest], dummies, ratios,
                                        (sigma, inputs, axes) if live or fanins else None)
                out = rec.output(outs)
                loss, aux = out if has_aux else (out, None)
                loss32 = jnp.asarray(loss).astype(jnp.float32)
                return loss32 * _formats.pow2(log2[ROOT]), (loss, aux)

            (_, value), (g_values, rows, chosen) = jax.value_and_grad(
                scaled, argnums=(0, 1, 2), has_aux=True)(rec.dynamic[:rec.n_params],
                                                        dummies, chosen)
            grads = jax.tree_util.tree_unflatten(treedef, g_values)
            actual = used
            moved = dict(zip(fanins, chosen[1]))
            adopts = program.live.adopts if fanins else {}
            if live or adopts:  # the scales the live regions chose, each from its own
                # cotangent (returned as their difference from the plan: a decider never
                # reached leaves its region at the plan), and those a group adopts from
                # the fan-in its parameters are read in (its plan ``sigma``, moved)
                def scale(g):
                    if g in chosen[0]:
                        return prior.log2_scales[g] + chosen[0][g]
                    if g in adopts:
                        return sigma[adopts[g]] + moved[adopts[g]]
                    return used[g]

                actual = GroupVector(groups, [scale(g) for g in groups], split=True)
            stats = program.decode(rows, actual, planned=used, moved=moved)
            if adopts:
                stats = dataclasses.replace(stats, adopted=GroupVector(
                    groups, jnp.asarray([g in adopts for g in groups])))
            return value, grads, stats

        if scaler.same_step and not program.live.any and len(groups) > 1:
            _common.notice_once("same-step-none", SAME_STEP_NONE)
        if _wide(rec, scaler):
            (loss, aux), grads, stats = _unscaled(attempt, state)
        elif scaler.retries:
            (loss, aux), grads, stats = _until_applied(attempt, state)
        else:
            (loss, aux), grads, stats = attempt(state.log2_scales, state)
        if stats.grad_amax is None:  # (the retry loop measured it for its verdict)
            stats = dataclasses.replace(stats, grad_amax=_decide.unscale(grads, stats,
                                                                         state)[1])
        stats = dataclasses.replace(stats, fingerprint=fingerprint(params),
                                    origin=(state.groups, scaler),
                                    handed=Handed(jax.tree_util.tree_leaves(grads)))
        return ((loss, aux) if has_aux else loss), grads, stats

    return wrapped


def _limits(prior: AdaptiveScaleState, live, fanins=()) -> dict:
    """What each live region's decider bounds its choice by (:func:`_channel.decide`):
    ``{g: [headroom, prior, planned]}``, the prior being the rule's scale once the group
    was measured or overflowed (+inf before). A live fan-in's (``fanins``, keyed by
    their anchor sets) combine its anchors': the most headroom any keeps, the lowest
    prior, and its planned scale, the min of theirs (as
    :func:`adaloss_jax._apply.anchor_scales` computes it: the step runs at ``prior``'s
    scales, a stream's layers included); each anchor's statistics hold the
    fan-in's rows, so the lowest prior holds the growth measured along it.

    Computed for every group at once as one table, and read out by one slice per live
    group that only its decider's conditional reads: XLA's CPU backend compiles each
    distinct fused kernel once, and a slice's index makes its body distinct, so a slice
    fused into the kernels downstream would make each of them a kernel per group, each
    compiled on its own."""
    planned = prior.log2_scales.array
    measured = (prior.log2_amax.array > -jnp.inf) | (prior.overflowed.array > 0)
    table = jnp.stack([jnp.ceil(prior.headroom.array), jnp.where(measured, planned, jnp.inf),
                       planned]).astype(jnp.float32)
    names = prior.log2_scales.names
    out = {g: table[:, names.index(g)] for g in live}
    for a in fanins:
        cols = table[:, jnp.asarray([names.index(g) for g in a], jnp.int32)]
        out[a] = jnp.stack([jnp.max(cols[0]), jnp.min(cols[1]), jnp.min(cols[2])])
    return out


def _unscaled(attempt: Callable, state: AdaptiveScaleState):
    """``attempt`` at scale 1 everywhere, with the verdict of no scaling: the scales stay
    1, a step is applied when its loss and gradients are finite."""
    one = GroupVector(state.groups, jnp.zeros_like(state.log2_scales.array))
    value, grads, stats = attempt(one)
    axis_name = _decide.bound(state.axis_name)
    base = _common.count_step(
        state.base._replace(loss_scale=jnp.ones_like(state.base.loss_scale)),
        _common.all_finite(grads, axis_name=axis_name),
        _common.all_finite(value[0], axis_name=axis_name))
    verdict = {f: getattr(state, f) for f in RETRIED}
    verdict.update(log2_scales=one, base=base, retries=jnp.zeros((), jnp.int32))
    return value, grads, dataclasses.replace(stats, verdict=verdict)


def _until_applied(attempt: Callable, state: AdaptiveScaleState):
    """``attempt(scales)`` at the state's scales, and again, up to ``scaler.retries``
    times, at the scales the rule sets while it would skip the step and moves a scale
    (an overflow backed off, a step far below its scale): one ``lax.while_loop``, its
    body compiled once, one pass when the scales are right. The pass is traced once:
    the loop's body replays its jaxpr (inside ``shard_map``, where the carry's types are
    settled first, the body traces it again). The statistics returned
    carry the rule's verdict on their pass (``ScaleStats.verdict``: the next state),
    which the optimizer applies as it is, without deciding twice.

    A step is still skipped when no scale could change it (a non-finite loss, NaN in
    the data: the rule holds every scale) or after ``retries`` retries. What the loss
    returns that is no array (a name, a count in ``aux``) is handed back as it is.
    """
    scaler, axis_name = state.scaler, _decide.bound(state.axis_name)
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
        verdict, grad_amax = _decide.verdict(prior, grads, stats, value[0], axis_name)
        return (value, grads, dataclasses.replace(stats, grad_amax=grad_amax)), verdict

    def flat_judged(prior: AdaptiveScaleState):
        out, verdict = judged(prior)
        return arrays(out), verdict

    # One trace of a pass (the program and its backward pass): its output types are the
    # carry's, and the loop's body replays it.
    closed, shapes = jax.make_jaxpr(flat_judged, return_shape=True)(state)
    out_tree = jax.tree_util.tree_structure(shapes)

    def replay(prior: AdaptiveScaleState):
        flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts,
                                   *jax.tree_util.tree_leaves(prior))
        return jax.tree_util.tree_unflatten(out_tree, flat)

    def body(carry):
        k, _, prior, _, _ = carry
        values, verdict = replay(prior) if not in_shard_map() else flat_judged(prior)
        moved = jnp.any(verdict.log2_scales.array != prior.log2_scales.array)
        done = verdict.base.last_applied | ~moved | (k >= scaler.retries)
        # A retry runs at the verdict's scales, counters untouched (no step was taken).
        nxt = prior.replace(**{f: getattr(verdict, f) for f in RETRIED})
        return k + 1, done, nxt, verdict, values

    init = (jnp.int32(0), jnp.asarray(False), state, state,
            [jnp.zeros(x.shape, x.dtype) for x in shapes[0]])
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


def _typed_like(tree, types):
    """``tree`` with each leaf made varying over the manual axes (inside ``shard_map``)
    that the matching leaf of ``types`` varies over, as a loop's carry must be."""

    def varying(x) -> frozenset:  # (x: an array, or a ShapeDtypeStruct of eval_shape)
        t = getattr(jax.typeof(x), "manual_axis_type", None)
        return frozenset(getattr(t, "varying", ()) or ())

    def cast(x, t):
        x = jnp.asarray(x)
        extra = varying(t) - varying(x)
        return jax.lax.pcast(x, tuple(sorted(extra)), to="varying") if extra else x

    return jax.tree_util.tree_map(cast, tree, types)


class _Scales(dict):
    """``log2[g]``: group ``g``'s log2 scale, read from the state when first asked for
    (a stack's slots are read as one vector, not one by one); the loss's seed,
    :data:`~adaloss_jax._tree.SEED`, runs at the root's."""

    def __init__(self, scales: GroupVector):
        super().__init__()
        self.scales = scales

    def __missing__(self, g):
        self[g] = value = self.scales[state_group(g)]
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
        raise ValueError(GLOBAL_STATE)
    return state
