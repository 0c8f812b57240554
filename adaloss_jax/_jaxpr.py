"""How the library reads a traced loss: scale points and the higher-order equations around
them, as both the stream analysis (:mod:`adaloss_jax._stream`) and the evaluation that
applies the points (:mod:`adaloss_jax._apply`) see them.

A recording trace marks every scale point as a jitted identity named
``POINT_PREFIX + n`` (``n``: the point's number in trace order) and the parameter leaves
as one jitted identity named ``PARAM_POINT``. Every equation falls in one of these kinds:

=========== ==================================================== =======================
kind        equations                                            what happens to points
=========== ==================================================== =======================
POINT       a recorded scale point                               applied
PARAMS      the parameter point                                  conversions of params
PLAIN       anything without a point inside                      nothing to do
INLINE      ``jit``/``pjit``, ``closed_call``, ``core_call``     applied (inlined)
REMAT       ``checkpoint`` (``jax.checkpoint``, ``nn.remat``)    applied, rematerialised
SCAN        ``scan`` (``lax.scan``, ``fori_loop``, ``nn.scan``) applied per iteration
COND        ``cond`` (``lax.cond``, ``lax.switch``)              applied in each branch
SHARD_MAP   ``shard_map``                                        applied per device
OPAQUE      any other equation with a point inside: a user's     not applied: the points
            ``custom_jvp``/``custom_vjp`` (its own derivative     inside are identities
            rule replaces autodiff's), ``while`` (not reverse-   and the equation joins
            differentiable), unknown primitives                  one region
=========== ==================================================== =======================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.extend.core as jcore

POINT_PREFIX = "_adaloss_point_"
PARAM_POINT = "_adaloss_params"

POINT, PARAMS, PLAIN, INLINE, REMAT, SCAN, COND, SHARD_MAP, OPAQUE = (
    "point", "params", "plain", "inline", "remat", "scan", "cond", "shard_map", "opaque")

_INLINE = {"jit", "pjit", "closed_call", "core_call"}
_REMAT = {"checkpoint", "remat", "remat2"}


def _label(eqn) -> str:
    if eqn.primitive.name not in ("jit", "pjit"):
        return ""
    label = eqn.params.get("name", "")
    return label if isinstance(label, str) else ""


def point_number(eqn) -> int | None:
    """``n`` for a recorded scale point, else None."""
    label = _label(eqn)
    return int(label[len(POINT_PREFIX):]) if label.startswith(POINT_PREFIX) else None


class Sub(NamedTuple):
    """A sub-program of an equation: its open jaxpr and the constants it closes over."""

    jaxpr: Any
    consts: list


def _sub(value) -> Sub | None:
    if isinstance(value, jcore.ClosedJaxpr):
        return Sub(value.jaxpr, list(value.consts))
    if isinstance(value, jcore.Jaxpr) and not value.constvars:
        return Sub(value, [])
    return None


def subprograms(eqn) -> list[Sub]:
    """The sub-programs of a higher-order equation, in the order of its parameters."""
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr):
                out.append(_sub(v) or Sub(v, None))
    return out


# Higher-order equations whose derivative is autodiff's of their sub-jaxprs.
_AUTODIFFED = _INLINE | _REMAT | {"scan", "cond", "shard_map"}


def reaching(jaxpr, outputs: Sequence[int]) -> set:
    """The variables of ``jaxpr`` and of its equations' sub-jaxprs (by identity) whose
    value may reach its outputs ``outputs`` (by position): the loss, not ``aux``.

    Conservative: an equation that may reach them reads all its inputs, but for one
    whose derivative is autodiff's of sub-jaxprs that each take its operands and give
    its outputs one by one (a ``jit``'s, a scale point's, ``checkpoint``'s, ``scan``'s
    body with every carry counted, ``cond``'s branches after the index,
    ``shard_map``'s): it reads those its sub-jaxprs' reaching outputs read. One with an
    effect reads all, and so does a ``custom_vjp``/``custom_jvp`` (its own rule may
    send a cotangent to an input its outputs do not depend on). A sub-jaxpr shared
    by several equations counts what reaches them at any. The other variables (what
    only ``aux`` or nothing reads: a scale point's output that a module reading only
    its input's shape ignores, as Flax's ``DenseParams`` inside ``OptimizedLSTMCell``)
    get a zero cotangent from every step, not a value that flushed."""
    reach: set = set()

    def walk(j, wanted: list[bool]) -> None:
        need = {v for v, w in zip(j.outvars, wanted) if w and isinstance(v, jcore.Var)}
        for e in reversed(j.eqns):
            outs = [isinstance(o, jcore.Var) and o in need for o in e.outvars]
            if not (any(outs) or e.effects):
                continue
            reach.update(o for o, w in zip(e.outvars, outs) if w)
            carry = e.params.get("num_carry", 0) if e.primitive.name == "scan" else 0
            skip = 1 if e.primitive.name == "cond" else 0  # (its index: always read)
            ins = list(e.invars)
            subs = [sub.jaxpr for sub in subprograms(e)]
            mapped = (e.primitive.name in _AUTODIFFED and bool(subs) and not e.effects
                      and all(len(b.outvars) == len(outs) and len(b.invars) == len(ins) - skip
                              for b in subs))
            for body in subs:
                walk(body, [w or i < carry for i, w in enumerate(outs)]
                     if mapped else [True] * len(body.outvars))
            if mapped:
                ins = ins[:skip] + [v for i, v in enumerate(ins[skip:])
                                    if any(b.invars[i] in reach for b in subs)]
            need.update(v for v in ins if isinstance(v, jcore.Var))
        reach.update(need)

    walk(jaxpr, [i in set(outputs) for i in range(len(jaxpr.outvars))])
    return reach


class Reader:
    """Classifies equations (:func:`kind`), remembering which sub-jaxprs hold points."""

    def __init__(self):
        self._memo: dict[int, tuple[bool, Any]] = {}

    def has_points(self, jaxpr) -> bool:
        key = id(jaxpr)
        if key not in self._memo:
            found = any(point_number(e) is not None
                        or any(self.has_points(s.jaxpr) for s in subprograms(e))
                        for e in jaxpr.eqns)
            self._memo[key] = (found, jaxpr)  # keeps jaxpr alive: ids stay unique
        return self._memo[key][0]

    def kind(self, eqn) -> str:
        if point_number(eqn) is not None:
            return POINT
        if _label(eqn) == PARAM_POINT:
            return PARAMS
        subs = subprograms(eqn)
        if not any(self.has_points(s.jaxpr) for s in subs):
            return PLAIN
        name = eqn.primitive.name
        if any(s.consts is None for s in subs):  # an open jaxpr with constants
            return OPAQUE
        n_in, n_out = len(eqn.invars), len(eqn.outvars)
        if len(subs) == 1:
            sub = subs[0].jaxpr
            same = len(sub.invars) == n_in and len(sub.outvars) == n_out
            if name in _INLINE and same:
                return INLINE
            if name in _REMAT and same:
                return REMAT
            if name == "scan" and same:
                return SCAN
            if name == "shard_map" and same:
                return SHARD_MAP
        if name == "cond" and all(len(s.jaxpr.invars) == n_in - 1
                                  and len(s.jaxpr.outvars) == n_out for s in subs):
            return COND
        return OPAQUE


def nested_jit(eqn):
    """The jaxpr of a nested ``jit`` (a ``ClosedJaxpr``: constants allowed) or
    ``checkpoint`` (an open ``Jaxpr`` without constants) equation, else ``None``. (Both
    take and return what the equation does.)"""
    inner = eqn.params.get("jaxpr")
    if eqn.primitive.name in ("jit", "pjit") and isinstance(inner, jcore.ClosedJaxpr):
        return inner
    if (eqn.primitive.name in _REMAT and isinstance(inner, jcore.Jaxpr)
            and not inner.constvars):
        return inner
    return None


def open_jaxpr(inner):
    """The open ``Jaxpr`` of a sub-jaxpr as an equation holds it (closed or open)."""
    return inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner


def cast_bodies(eqn) -> list:
    """The sub-jaxprs a cast of the loss is looked for in (:func:`widening_casts`), as the
    equation holds them (``ClosedJaxpr`` or open ``Jaxpr``): a nested ``jit`` or
    ``checkpoint``'s, a ``scan``'s or ``shard_map``'s body, a ``cond``'s branches; ``[]``
    for any other equation. Each takes the equation's operands in order (a ``cond`` less
    its index)."""
    inner = nested_jit(eqn)
    if inner is not None:
        return [inner]
    inner = eqn.params.get("jaxpr")
    if (eqn.primitive.name == "shard_map" and isinstance(inner, jcore.Jaxpr)
            and not inner.constvars):
        return [inner]
    if eqn.primitive.name == "scan" and isinstance(inner, jcore.ClosedJaxpr):
        return [inner]
    if eqn.primitive.name == "cond":
        return list(eqn.params["branches"])
    return []


def with_cast_body(eqn, b: int, jaxpr):
    """``eqn`` with its sub-jaxpr ``b`` of :func:`cast_bodies` replaced by the open
    ``jaxpr`` (same inputs and outputs; the constants kept)."""
    inner = cast_bodies(eqn)[b]
    if isinstance(inner, jcore.ClosedJaxpr):
        jaxpr = jcore.ClosedJaxpr(jaxpr, inner.consts)
    if eqn.primitive.name == "cond":
        branches = list(eqn.params["branches"])
        branches[b] = jaxpr
        return eqn.replace(params={**eqn.params, "branches": tuple(branches)})
    return eqn.replace(params={**eqn.params, "jaxpr": jaxpr})


def widening_casts(jaxpr, narrow, reader: Reader | None = None) -> list[tuple[int, ...]]:
    """The equations that cast a value computed after a scale point from a ``narrow``
    float dtype to float32 or float64 (``x.astype(jnp.float32)`` on a model's output, in
    the loss): in the backward pass, where the cotangent is cast down to the narrow
    dtype. Each as its path: ``(i,)`` for equation ``i`` of ``jaxpr``'s top level,
    ``(i, b, j, ...)`` for equation ``j`` inside sub-jaxpr ``b`` of the equation at
    ``i`` (:func:`cast_bodies`: a jitted or rematerialised loss, a jitted cross-entropy,
    a cross-entropy computed chunk by chunk in a ``scan`` or per device in a
    ``shard_map``, a ``cond``'s branch), and so on down."""
    return _casts(jaxpr, narrow, reader or Reader(), set(), ())[0]


def _casts(jaxpr, narrow, reader: Reader, after: set, prefix: tuple) -> tuple[list, set]:
    """The casts under ``prefix`` (:func:`widening_casts`), and the variables computed
    from a point's outputs (``after``: those among the inputs)."""
    after = set(after)
    found: list[tuple[int, ...]] = []
    for i, eqn in enumerate(jaxpr.eqns):
        kind = reader.kind(eqn)
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        bodies = (cast_bodies(eqn) if kind in (PLAIN, INLINE, REMAT, SCAN, COND, SHARD_MAP)
                  else [])
        if bodies:  # walked inside: a cast there is found at its own place
            operands = eqn.invars[1:] if eqn.primitive.name == "cond" else eqn.invars
            carry = range(0)
            if eqn.primitive.name == "scan":
                nc = eqn.params["num_consts"]
                carry = range(nc, nc + eqn.params["num_carry"])
            for b, inner in enumerate(bodies):
                body = open_jaxpr(inner)
                start = {u for v, u in zip(operands, body.invars)
                         if isinstance(v, jcore.Var) and v in after}
                while True:  # (a scan's carry computed after a point: its next iteration)
                    got, inner_after = _casts(body, narrow, reader, start, prefix + (i, b))
                    more = {body.invars[c] for j, c in enumerate(carry)
                            if isinstance(body.outvars[j], jcore.Var)
                            and body.outvars[j] in inner_after} - start
                    if not more:
                        break
                    start |= more
                found += got
                after.update(o for o, u in zip(eqn.outvars, body.outvars)
                             if isinstance(u, jcore.Var) and u in inner_after)
            continue
        if kind not in (PLAIN, PARAMS) or any(v in after for v in ins):
            after.update(eqn.outvars)
        if (eqn.primitive.name == "convert_element_type" and ins and ins[0] in after
                and ins[0].aval.dtype in narrow
                and eqn.outvars[0].aval.dtype.name in ("float32", "float64")):
            found.append(prefix + (i,))
    return found, after


def region_var(jaxpr, path: tuple[int, ...], reader: Reader | None = None):
    """A variable of ``jaxpr``'s walked program in the region of the cast at ``path``
    (:func:`widening_casts`): the cast's output, or where the path enters an equation
    with no point inside (not walked: one region), a variable that equation reads or
    writes."""
    reader = reader or Reader()
    eqn = jaxpr.eqns[path[0]]
    if len(path) == 1:
        return eqn.outvars[0]
    if reader.kind(eqn) == PLAIN:
        return next((v for v in (*eqn.outvars, *eqn.invars) if isinstance(v, jcore.Var)
                     and not isinstance(v, jcore.DropVar)), eqn.outvars[0])
    return region_var(open_jaxpr(cast_bodies(eqn)[path[1]]), path[2:], reader)
