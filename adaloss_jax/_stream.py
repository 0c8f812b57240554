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

from adaloss_jax import _jaxpr
from adaloss_jax._tree import ROOT, is_differentiable


class PointPlan(NamedTuple):
    """Static plan of one scale point: per floating leaf, the anchors of the region on the
    producer side ``x`` (where the converted cotangent goes) and on the consumer side ``y``
    (where it arrives from). ``None`` for a point that is not applied: one the program
    does not hold whole (a trace a transform made and dropped), one only inside opaque
    equations (:mod:`adaloss_jax._jaxpr`), or one that would only repeat the measurement
    of the point feeding it (:func:`analyse`)."""

    x: tuple[tuple[str, ...] | None, ...] | None
    y: tuple[tuple[str, ...] | None, ...] | None  # None for a leaf computed from the
    # parameters alone (no data): it passes the point unmarked, as a parameter does


class Plan(NamedTuple):
    points: tuple[PointPlan, ...]  # by point number (trace order)
    params: tuple[tuple[str, ...] | None, ...]  # per parameter leaf: anchors of its uses


def _var(v) -> bool:
    return not isinstance(v, jcore.Literal | jcore.DropVar) and is_differentiable(v)


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
            if not _var(v):
                continue
            r = self.find(v)
            if first is None:
                first = r
            elif r is not first:
                self.parent[r] = first


_NOWHERE = object()  # the region of an opaque equation that touches no floating value
_CONST, _PARAMS, _DATA = range(3)  # what a variable is computed from


class _Walker:
    """Unions the floating variables of a jaxpr into regions, cutting at scale points."""

    def __init__(self):
        self.uf = _UnionFind()
        self.reader = _jaxpr.Reader()
        self.points: dict[int, list[list[tuple[object, object]]]] = {}  # n -> occurrences
        self.blobbed: set[int] = set()  # points met inside an opaque equation
        self.param_pairs: list[tuple[object, object]] = []
        # n -> per occurrence, per leaf: the point whose output the leaf's input is, in
        # the same jaxpr and read by nothing else (None where it is not).
        self.fed: dict[int, list[list[int | None]]] = {}
        # What each variable is computed from: parameters alone (a point passes such a
        # leaf unmarked, as it passes the parameters themselves), data (the loss's other
        # inputs, closed-over values, a loop's carry), or neither (constants). A variable
        # of a jaxpr walked several times keeps the most data-like answer.
        self.source: dict = {}
        self.passed: dict[int, set[int]] = {}  # n -> its leaves that pass unmarked

    def _source(self, v) -> int:
        return _CONST if isinstance(v, jcore.Literal) else self.source.get(v, _DATA)

    def _mark(self, vs, source: int) -> None:
        for v in vs:
            if not isinstance(v, jcore.Literal | jcore.DropVar):
                self.source[v] = max(self.source.get(v, _CONST), source)

    def _computed(self, ins) -> int:
        return max((self._source(v) for v in ins), default=_CONST)

    def walk(self, jaxpr, blob=None) -> None:
        uf = self.uf
        uses: dict = {}
        for v in [*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars]:
            if not isinstance(v, jcore.Literal):
                uses[v] = uses.get(v, 0) + 1
        point_out: dict = {}  # outputs of scale points in this jaxpr -> point number
        for eqn in jaxpr.eqns:
            kind = self.reader.kind(eqn)
            ins, outs = list(eqn.invars), list(eqn.outvars)
            if kind == _jaxpr.POINT:
                n = _jaxpr.point_number(eqn)
                pairs = list(zip(ins, outs))
                for v, o in pairs:
                    self._mark([o], self._source(v))
                if blob is not None:  # inside an opaque derivative: no cut
                    uf.union([blob] + ins + outs)
                    self.blobbed.add(n)
                    continue
                passed = {i for i, (v, _) in enumerate(pairs) if self._source(v) == _PARAMS}
                for i in passed:
                    uf.union(pairs[i])
                self.passed[n] = self.passed.get(n, passed) & passed
                self.points.setdefault(n, []).append(pairs)
                self.fed.setdefault(n, []).append(
                    [point_out.get(v) if uses.get(v) == 1 else None for v in ins])
                point_out.update(dict.fromkeys(outs, n))
                continue
            if kind == _jaxpr.PARAMS:
                self.param_pairs = list(zip(ins, outs))
                self._mark(outs, _PARAMS)
                continue
            if kind in (_jaxpr.PLAIN, _jaxpr.OPAQUE) or blob is not None:
                self._mark(outs, self._computed(ins))
            if kind == _jaxpr.PLAIN:
                # Not walked: jax shares the jaxpr of, e.g., a jitted activation between
                # all its call sites, and its variables would join them.
                uf.union(([] if blob is None else [blob]) + ins + outs)
                continue
            subs = _jaxpr.subprograms(eqn)
            if blob is None and kind != _jaxpr.OPAQUE:
                self._structured(eqn, kind, [s.jaxpr for s in subs])
                continue
            # One region for everything the equation touches, inside and out.
            rep = blob
            if rep is None:
                rep = next((v for v in (*ins, *outs) if _var(v)), None)
            uf.union(([] if rep is None else [rep]) + ins + outs)
            for sub in subs:
                if rep is not None:
                    uf.union([rep, *sub.jaxpr.invars, *sub.jaxpr.outvars,
                              *sub.jaxpr.constvars])
                self.walk(sub.jaxpr, blob=rep if rep is not None else _NOWHERE)

    def _structured(self, eqn, kind, subs) -> None:
        """Maps a higher-order equation's variables into its sub-jaxprs and walks them."""
        ins, outs = list(eqn.invars), list(eqn.outvars)
        if kind == _jaxpr.COND:
            ins = ins[1:]  # the branch index
        carry = range(0)
        if kind == _jaxpr.SCAN:  # the loop's carry: never counted as parameters alone
            nc = eqn.params["num_consts"]
            carry = range(nc, nc + eqn.params["num_carry"])
        for sub in subs:
            self._link(ins, sub.invars)
            self._link(outs, sub.outvars)
            for i, (v, u) in enumerate(zip(ins, sub.invars)):
                self._mark([u], _DATA if i in carry else self._source(v))
            self._mark(sub.constvars, _CONST)
            if kind == _jaxpr.SCAN:
                self._link([sub.invars[i] for i in carry],
                           sub.outvars[:len(carry)])
            self.walk(sub)
        for i, v in enumerate(outs):
            self._mark([v], _DATA if kind == _jaxpr.SCAN and i < len(carry)
                       else max(self._source(sub.outvars[i]) for sub in subs))

    def _link(self, a: Sequence, b: Sequence) -> None:
        for u, v in zip(a, b):
            self.uf.union([u, v])


def analyse(jaxpr, sizes: Sequence[int], param_owners: Sequence[str | None],
            loss_index: int = 0, keep: frozenset = frozenset()) -> Plan:
    """The plan of a traced loss.

    Args:
      jaxpr: the (open) jaxpr of the loss, traced with recording scale points and one
        parameter point (:mod:`adaloss_jax._jaxpr`).
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
        return find(v) if _var(v) else None

    fixed: dict = {}
    loss = jaxpr.outvars[loss_index]
    loss_region = region(loss)
    params_y = []
    for (x, y), owner in zip(w.param_pairs, param_owners):
        if owner is None or not _var(y):
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
        passed = w.passed.get(n, set())
        x = tuple(None if i in passed else of(region(v)) for i, (v, _) in enumerate(pairs))
        y = tuple(None if i in passed else of(region(v)) for i, (_, v) in enumerate(pairs))
        fed = w.fed.get(n, [])
        feeders = [a for i, a in enumerate(fed[0]) if i not in passed] if len(fed) == 1 else []
        if (n not in keep and x == y and feeders
                and all(a is not None and a in whole and len(w.points[a]) == 1
                        and a not in w.blobbed for a in feeders)):
            points.append(PointPlan(None, None))  # a repeat of the point feeding it
            continue
        points.append(PointPlan(x=x, y=y))
    params = tuple(None if r is None else of(r) for r in params_y)
    return Plan(tuple(points), params)
