"""Where per-layer scales live along the backward stream: a pass over the traced program.

Scale points cut the program's dataflow graph. Autodiff sums and propagates cotangents
inside each connected piece that is left (a *region*: the values joined by any operation
other than a scale point, inside control flow and transforms too), so every region must
hold its cotangents at one scale; a scale point converts between the regions on its two
sides. This module finds the regions in the jaxpr of the loss, once per program
structure, and gives each one its *anchors*, the scale groups that set its scale::

    region holding the loss            -> {root}
    region using parameters of groups G -> G         (a module's interior: its own group)
    any other region                    -> union of the anchors of the regions its
                                           cotangents come from (the consumers' side of
                                           the scale points it feeds), to a fixed point
    nothing reaches it                  -> {root}
    scale of a region                   =  min over its anchors (log2 scales)

So a cotangent keeps the scale of the group it just left until it reaches a fan-in:
a value read by several consumers (residuals, q/k/v from one input, a module applied
several times, concatenation, a shared memory) is one region whose anchors are all the
consumers, and its branches meet at the smallest of their scales (the largest common
scale that none of them overflowed at). A parameter read in a region whose scale is not
its owner's (a tied embedding used as a head, a parent's parameter in a stream) passes a
conversion of its own, so every parameter gradient arrives at its owner group's scale.

Merging regions is always correct (one scale for more values), splitting them never is,
so any operation whose derivative the pass cannot see through (``custom_jvp``,
``custom_vjp``, unknown higher-order primitives) joins everything it touches, scale
points inside it included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax.extend.core as jcore
import jax.numpy as jnp

ROOT = ""
POINT_PREFIX = "_adaloss_point_"
PARAM_POINT = "_adaloss_params"

# Higher-order primitives whose sub-jaxpr maps its inputs and outputs one to one.
_POSITIONAL = {"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2",
               "shard_map", "named_call", "custom_lin"}
# Primitives whose derivative is user-defined: the pass joins everything they touch.
_OPAQUE = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}


class PointPlan(NamedTuple):
    """Static plan of one scale point: per floating leaf, the anchors of the region on the
    producer side ``x`` (where the converted cotangent goes) and on the consumer side ``y``
    (where it arrives from). ``None`` for a point the program does not hold whole (a
    trace a transform made and dropped, or pruned): it is no cut, and not applied; also
    for a point that would only repeat the measurement of the point feeding it
    (:func:`analyse`), which is not applied either."""

    x: tuple[tuple[str, ...], ...] | None
    y: tuple[tuple[str, ...], ...] | None


class Plan(NamedTuple):
    points: tuple[PointPlan, ...]  # by point number (trace order)
    params: tuple[tuple[str, ...] | None, ...]  # per parameter leaf: anchors of its uses


def _is_float(v) -> bool:
    aval = getattr(v, "aval", None)
    dtype = getattr(aval, "dtype", None)
    try:
        return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)
    except TypeError:  # extended dtypes (PRNG keys)
        return False


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, v):
        parent = self.parent
        parent.setdefault(v, v)
        root = v
        while parent[root] is not root:
            root = parent[root]
        while parent[v] is not root:
            parent[v], v = root, parent[v]
        return root

    def union(self, vs: Iterable) -> None:
        first = None
        for v in vs:
            if isinstance(v, jcore.Literal) or isinstance(v, jcore.DropVar) or not _is_float(v):
                continue
            r = self.find(v)
            if first is None:
                first = r
            elif r is not first:
                self.parent[r] = first


def _subjaxprs(params) -> list:
    out = []
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jcore.ClosedJaxpr):
                out.append(v.jaxpr)
            elif isinstance(v, jcore.Jaxpr):
                out.append(v)
    return out


class _Walker:
    """Unions the floating variables of a jaxpr into regions, cutting at scale points."""

    def __init__(self):
        self.uf = _UnionFind()
        self.points: dict[int, list[list[tuple[object, object]]]] = {}  # n -> occurrences
        self.param_pairs: list[tuple[object, object]] = []
        self.memo: dict = {}
        # n -> per occurrence, per leaf: the point whose output the leaf's input is, in
        # the same jaxpr and read by nothing else (None where it is not).
        self.fed: dict[int, list[list[int | None]]] = {}

    def walk(self, jaxpr, blob=None) -> None:
        uf = self.uf
        uses: dict = {}
        for v in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
            if not isinstance(v, jcore.Literal):
                uses[v] = uses.get(v, 0) + 1
        point_out: dict = {}  # outputs of scale points in this jaxpr -> point number
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            label = eqn.params.get("name", "") if name in ("jit", "pjit") else ""
            if isinstance(label, str) and label.startswith(POINT_PREFIX):
                pairs = list(zip(eqn.invars, eqn.outvars))
                if blob is not None:  # inside an opaque derivative: no cut
                    uf.union([blob] + [v for p in pairs for v in p])
                n = int(label[len(POINT_PREFIX):])
                self.points.setdefault(n, []).append(pairs)
                self.fed.setdefault(n, []).append(
                    [point_out.get(v) if blob is None and uses.get(v) == 1 else None
                     for v in eqn.invars])
                if blob is None:
                    point_out.update(dict.fromkeys(eqn.outvars, n))
                continue
            if label == PARAM_POINT:
                self.param_pairs = list(zip(eqn.invars, eqn.outvars))
                continue
            subs = _subjaxprs(eqn.params)
            if not subs or not any(self._has_points(sub) for sub in subs):
                # No scale point inside: like any primitive, everything it touches is one
                # region. (Not walked: jax shares the jaxpr of, e.g., a jitted activation
                # between all its call sites, and its variables would join them.)
                uf.union(([] if blob is None else [blob]) + list(eqn.invars)
                         + list(eqn.outvars))
                continue
            if blob is not None or not self._structured(eqn, name, subs):
                # One region for everything the equation touches, inside and out.
                rep = blob
                if rep is None:
                    cands = [v for v in (*eqn.invars, *eqn.outvars) if _floaty(v)]
                    rep = cands[0] if cands else None
                uf.union(([] if rep is None else [rep]) + list(eqn.invars) + list(eqn.outvars))
                for sub in subs:
                    if rep is None:
                        self.walk(sub)
                    else:
                        uf.union([rep, *sub.invars, *sub.outvars, *sub.constvars])
                        self.walk(sub, blob=rep)

    def _has_points(self, jaxpr) -> bool:
        key = id(jaxpr)
        if key not in self.memo:
            found = False
            for eqn in jaxpr.eqns:
                label = eqn.params.get("name", "")
                if isinstance(label, str) and label.startswith(POINT_PREFIX):
                    found = True
                    break
                if any(self._has_points(sub) for sub in _subjaxprs(eqn.params)):
                    found = True
                    break
            self.memo[key] = (found, jaxpr)  # keep jaxpr alive: ids stay unique
        return self.memo[key][0]

    def _structured(self, eqn, name, subs) -> bool:
        """Maps a known higher-order equation's variables into its sub-jaxprs and walks
        them; False where the structure is not the expected one (then it is opaque)."""
        if name in _OPAQUE:
            return False
        ins, outs = list(eqn.invars), list(eqn.outvars)
        if name in _POSITIONAL and len(subs) == 1:
            sub = subs[0]
            if len(sub.invars) != len(ins) or len(sub.outvars) != len(outs):
                return False
            self._link(ins, sub.invars)
            self._link(outs, sub.outvars)
            self.walk(sub)
            return True
        if name == "scan" and len(subs) == 1:
            sub = subs[0]
            nc, ncar = eqn.params["num_consts"], eqn.params["num_carry"]
            if len(sub.invars) != len(ins) or len(sub.outvars) != len(outs):
                return False
            self._link(ins, sub.invars)
            self._link(outs, sub.outvars)
            self._link(sub.invars[nc:nc + ncar], sub.outvars[:ncar])  # the loop's carry
            self.walk(sub)
            return True
        if name == "while":
            cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
            body, cond = eqn.params["body_jaxpr"].jaxpr, eqn.params["cond_jaxpr"].jaxpr
            carry = ins[cn + bn:]
            if len(body.invars) != bn + len(carry) or len(body.outvars) != len(outs):
                return False
            self._link(ins[cn:], body.invars)
            self._link(outs, body.outvars)
            self._link(body.invars[bn:], body.outvars)
            self._link(ins[:cn] + carry, cond.invars)
            self.walk(body)
            self.walk(cond)
            return True
        if name == "cond":
            for sub in subs:
                if len(sub.invars) != len(ins) - 1 or len(sub.outvars) != len(outs):
                    return False
            for sub in subs:
                self._link(ins[1:], sub.invars)
                self._link(outs, sub.outvars)
                self.walk(sub)
            return True
        return False

    def _link(self, a: Sequence, b: Sequence) -> None:
        for u, v in zip(a, b):
            self.uf.union([u, v])


def _floaty(v) -> bool:
    return not isinstance(v, jcore.Literal | jcore.DropVar) and _is_float(v)


def analyse(jaxpr, sizes: Sequence[int], param_owners: Sequence[str | None],
            loss_index: int = 0, keep: frozenset = frozenset()) -> Plan:
    """The plan of a traced loss.

    Args:
      jaxpr: the (open) jaxpr of the loss, traced with recording scale points
        (``POINT_PREFIX + str(n)``) and one ``PARAM_POINT`` over the parameter leaves.
      sizes: how many floating values each recorded scale point holds.
      param_owners: the scale group of each parameter leaf (``None`` for non-floating
        leaves), in the order of the parameter point's operands.
      loss_index: which output of the jaxpr is the loss.
      keep: points that must be applied even where they neither convert nor measure
        anything new (those that round cotangents to a simulated format).

    A point that would convert nothing and whose every input comes straight from
    another point (whose output nothing else reads) is left out of the applied program:
    the cotangent it would measure is the one that point measures, unchanged and with
    the same anchors (a parent module's boundary around a child's). It gets no plan, as
    a point the program does not hold (:class:`PointPlan`).
    """
    w = _Walker()
    w.walk(jaxpr)
    whole: dict[int, list] = {}
    for n, occurrences in w.points.items():
        if n < len(sizes) and all(len(p) == sizes[n] for p in occurrences):
            for other in occurrences[1:]:  # the same point reached twice: one plan
                for (x0, y0), (x1, y1) in zip(occurrences[0], other):
                    w.uf.union([x0, x1])
                    w.uf.union([y0, y1])
            whole[n] = occurrences[0]
        else:
            for pairs in occurrences:
                for x, y in pairs:
                    w.uf.union([x, y])
    find = w.uf.find

    def region(v):
        return find(v) if _floaty(v) else None

    fixed: dict = {}
    loss = jaxpr.outvars[loss_index]
    loss_region = region(loss)
    params_y = []
    for (x, y), owner in zip(w.param_pairs, param_owners):
        if owner is None or not _floaty(y):
            params_y.append(None)
            continue
        params_y.append(region(y))
        r = region(y)
        if r is not loss_region:
            fixed.setdefault(r, set()).add(owner)
        fixed[region(x)] = {owner}
    if loss_region is not None:
        fixed[loss_region] = {ROOT}

    # Cotangents flow from each point's y side into its x side.
    sources: dict = {}
    for pairs in whole.values():
        for x, y in pairs:
            rx, ry = region(x), region(y)
            if rx is None or ry is None or rx is ry:
                continue
            sources.setdefault(rx, set()).add(ry)
    anchors: dict = {r: set(a) for r, a in fixed.items()}
    changed = True
    while changed:
        changed = False
        for r, srcs in sources.items():
            if r in fixed:
                continue
            cur = anchors.setdefault(r, set())
            before = len(cur)
            for s in srcs:
                cur |= anchors.get(s, set())
            changed |= len(cur) != before

    def of(r) -> tuple[str, ...]:
        a = anchors.get(r) if r is not None else None
        return tuple(sorted(a)) if a else (ROOT,)

    points = []
    for n in range(len(sizes)):
        pairs = whole.get(n)
        if pairs is None:
            points.append(PointPlan(None, None))
            continue
        x = tuple(of(region(v)) for v, _ in pairs)
        y = tuple(of(region(v)) for _, v in pairs)
        fed = w.fed.get(n, [])
        if (n not in keep and x == y and len(fed) == 1 and fed[0]
                and all(a is not None and a in whole and len(w.points[a]) == 1
                        for a in fed[0])):
            points.append(PointPlan(None, None))  # a repeat of the point feeding it
            continue
        points.append(PointPlan(x=x, y=y))
    params = tuple(None if r is None else of(r) for r in params_y)
    return Plan(tuple(points), params)
