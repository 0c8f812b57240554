"""Where per-layer scales live along the backward stream: a pass over the traced program.

Scale points cut the program's dataflow graph. Autodiff sums and propagates cotangents
inside each connected piece that is left (a *region*: the values joined by any operation
other than a scale point, inside control flow and transforms too), so every region must
hold its cotangents at one scale; a scale point converts between the regions on its two
sides. This module finds the regions in the jaxpr of the loss, once per program
structure, and gives each one its *anchors*, the scale groups that set its scale::

    region holding the loss            -> {root}, or {seed} where its cotangent leaves
                                           it only through the casts of the model's
                                           outputs (its values all wide: see analyse)
    region using parameters of groups G -> G         (a module's interior: its own group;
                                           the root's parameters may anchor nothing)
    any other region                    -> union of the anchors of the regions its
                                           cotangents come from (the consumers' side of
                                           the scale points it feeds), to a fixed point
    nothing reaches it                  -> {root}
    scale of a region                   =  min over its anchors (log2 scales)

The root is no module with an interior: its parameters are read wherever the model
needs them, at its bottom (a GPT's position embedding added to the token embeddings) as
at its top, and anchoring all those regions at one scale makes one scale span the
model. Where scales are chosen in the backward pass, a region reading them takes its
anchors from its consumers like any other (the root's where only the loss's cotangent
reaches it), and the parameter converts into the root's scale as any parameter read
off its owner's scale does; but where that region cannot choose its scale in the pass
(it keeps the plan: a stream inside a scan of one layer) the parameter anchors it as
before, so the root's statistics hold it (``rooted``,
:func:`adaloss_jax._grad.trace`).

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
from typing import Any, NamedTuple

import jax.extend.core as jcore

from adaloss_jax import _jaxpr
from adaloss_jax._layout import Layer
from adaloss_jax._tree import ROOT, SEED, is_differentiable


class Steps(tuple):
    """Anchors that differ from layer to layer of a scanned stack: ``steps[i]`` are the
    anchors at slice ``i`` of the scan (its ``i``-th layer, whatever the direction)."""


def at(anchors, i: int):
    """The anchors at slice ``i``: ``anchors[i]`` for :class:`Steps`, else ``anchors``."""
    return anchors[i] if isinstance(anchors, Steps) else anchors


def _steps(per_slice: list):
    """:class:`Steps` of ``per_slice``, or its one value where every slice has the same."""
    return per_slice[0] if all(a == per_slice[0] for a in per_slice) else Steps(per_slice)


class PointPlan(NamedTuple):
    """Static plan of one scale point: per floating leaf, the anchors of the region on the
    producer side ``x`` (where the converted cotangent goes) and on the consumer side ``y``
    (where it arrives from); :class:`Steps` inside a scan over a stack of layers where
    they differ by layer. ``None`` for a point that is not applied: one the program
    does not hold whole (a trace a transform made and dropped), one only inside opaque
    equations (:mod:`adaloss_jax._jaxpr`), or one that would only repeat the measurement
    of the point feeding it (:func:`analyse`)."""

    x: tuple | None
    y: tuple | None  # None for a leaf computed from the parameters alone (no data): it
    # passes the point unmarked, as a parameter does


class Plan(NamedTuple):
    points: tuple[PointPlan, ...]  # by point number (trace order)
    params: tuple  # per parameter leaf: anchors of its uses (Steps for a scanned stack's)
    stacked: frozenset = frozenset()  # the groups that get a scale per layer
    scans: dict = {}  # id(scan equation) -> its length, for the scans over those groups


def _raw(k):
    return k[0] if type(k) is tuple else k


def _var(v) -> bool:
    v = _raw(v)
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
    """Unions the floating variables of a jaxpr into regions, cutting at scale points.

    A variable is keyed by itself, or inside a scan over a stack of layers by
    ``(variable, ((id(scan), slice),))``: such a scan's body is walked once per layer, as
    if it were unrolled, so that each layer's regions are its own. That scan is one over
    the leaves of groups in ``stacks`` (``{group: depth}``), each leaf read by nothing
    else and scanned over as it is (``xs``), with as many iterations as the group has
    layers; not inside another such scan.
    """

    def __init__(self, param_owners: Sequence[str | None] = (), stacks=None,
                 reach: set | None = None):
        self.uf = _UnionFind()
        # The variables whose value may reach the loss (None: all): an equation whose
        # outputs do not (an aux metric, a scanned stack's per-layer outputs nobody
        # reads) gets a zero cotangent, and joins none of the regions it reads.
        self.reach = reach
        self.reader = _jaxpr.Reader()
        self.ctx: tuple = ()
        # n -> per occurrence: (context, per leaf: (x key, y key))
        self.points: dict[int, list[tuple[tuple, list[tuple[object, object]]]]] = {}
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
        self.owners = list(param_owners)
        self.stacks = dict(stacks or {})
        self.param_of: dict = {}  # key of a parameter leaf as it is -> its index
        self.sliced: dict[int, dict[int, object]] = {}  # parameter -> slice -> key
        self.scans: dict[int, tuple[int, Any]] = {}  # id(scan) -> (length, equation)

    def key(self, v, ctx=None):
        ctx = self.ctx if ctx is None else ctx
        return (v, ctx) if ctx and not isinstance(v, jcore.Literal) else v

    def union(self, *vs) -> None:
        """Joins raw variables (in the current context) and keys (tuples, ``_NOWHERE``)."""
        self.uf.union(v if type(v) is tuple or v is _NOWHERE else self.key(v) for v in vs)

    def reaches(self, outs) -> bool:
        """Whether any of the raw variables ``outs`` may reach the loss."""
        return self.reach is None or any(_raw(v) in self.reach for v in outs
                                         if isinstance(_raw(v), jcore.Var))

    def _source(self, k) -> int:
        return _CONST if isinstance(_raw(k), jcore.Literal) else self.source.get(k, _DATA)

    def _mark(self, keys, source: int) -> None:
        for k in keys:
            if not isinstance(_raw(k), jcore.Literal | jcore.DropVar):
                self.source[k] = max(self.source.get(k, _CONST), source)

    def _computed(self, ins) -> int:
        return max((self._source(self.key(v)) for v in ins), default=_CONST)

    def walk(self, jaxpr, blob=None) -> None:
        key = self.key
        uses: dict = {}  # (by what may reach the loss: an aux metric's read is none)
        for v in [*(v for e in jaxpr.eqns if e.effects or self.reaches(e.outvars)
                    for v in e.invars), *(v for v in jaxpr.outvars if self.reaches([v]))]:
            if not isinstance(v, jcore.Literal):
                uses[v] = uses.get(v, 0) + 1
        point_out: dict = {}  # outputs of scale points in this jaxpr -> point number
        for eqn in jaxpr.eqns:
            kind = self.reader.kind(eqn)
            ins, outs = list(eqn.invars), list(eqn.outvars)
            if kind == _jaxpr.POINT:
                n = _jaxpr.point_number(eqn)
                pairs = [(key(v), key(o)) for v, o in zip(ins, outs)]
                for kv, ko in pairs:
                    self._mark([ko], self._source(kv))
                if blob is not None:  # inside an opaque derivative: no cut
                    self.union(blob, *ins, *outs)
                    self.blobbed.add(n)
                    continue
                # (a leaf computed from parameters alone, or one whose cotangent is
                # zero: its output does not reach the loss)
                passed = {i for i, (kv, _) in enumerate(pairs)
                          if self._source(kv) == _PARAMS or not self.reaches([outs[i]])}
                for i in passed:
                    self.union(*pairs[i])
                self.passed[n] = self.passed.get(n, passed) & passed
                self.points.setdefault(n, []).append((self.ctx, pairs))
                self.fed.setdefault(n, []).append(
                    [point_out.get(v) if uses.get(v) == 1 else None for v in ins])
                point_out.update(dict.fromkeys(outs, n))
                continue
            if kind == _jaxpr.PARAMS:
                self.param_pairs = [(key(v), key(o)) for v, o in zip(ins, outs)]
                self._mark(map(key, outs), _PARAMS)
                self.param_of.update({key(o): j for j, o in enumerate(outs)
                                      if uses.get(o) == 1})
                continue
            if kind in (_jaxpr.PLAIN, _jaxpr.OPAQUE) or blob is not None:
                self._mark(map(key, outs), self._computed(ins))
            if kind == _jaxpr.PLAIN:
                # Not walked: jax shares the jaxpr of, e.g., a jitted activation between
                # all its call sites, and its variables would join them.
                if blob is not None or self.reaches(outs):
                    self.union(*([] if blob is None else [blob]), *ins, *outs)
                continue
            subs = _jaxpr.subprograms(eqn)
            if blob is None and kind != _jaxpr.OPAQUE:
                self._structured(eqn, kind, [s.jaxpr for s in subs], uses)
                continue
            # One region for everything the equation touches, inside and out.
            rep = blob
            if rep is None:
                rep = next((key(v) for v in (*ins, *outs) if _var(v)), None)
            self.union(*([] if rep is None else [rep]), *ins, *outs)
            for sub in subs:
                if rep is not None:
                    self.union(rep, *sub.jaxpr.invars, *sub.jaxpr.outvars,
                               *sub.jaxpr.constvars)
                self.walk(sub.jaxpr, blob=rep if rep is not None else _NOWHERE)

    def _structured(self, eqn, kind, subs, uses) -> None:
        """Maps a higher-order equation's variables into its sub-jaxprs and walks them."""
        ins, outs = list(eqn.invars), list(eqn.outvars)
        if kind == _jaxpr.COND:
            ins = ins[1:]  # the branch index
        carry = range(0)
        if kind == _jaxpr.SCAN:  # the loop's carry: never counted as parameters alone
            sliced = self._layers(eqn, uses)
            if sliced:
                self._unrolled(eqn, subs[0], sliced)
                return
            nc = eqn.params["num_consts"]
            carry = range(nc, nc + eqn.params["num_carry"])
        for sub in subs:
            self._link(ins, sub.invars)
            self._link(outs, sub.outvars)
            for i, (v, u) in enumerate(zip(ins, sub.invars)):
                self._mark([self.key(u)], _DATA if i in carry else self._source(self.key(v)))
                if kind in (_jaxpr.INLINE, _jaxpr.REMAT) and uses.get(v) == 1:
                    j = self.param_of.get(self.key(v))
                    if j is not None:  # a parameter leaf, passed on as it is
                        self.param_of[self.key(u)] = j
            self._mark(map(self.key, sub.constvars), _CONST)
            if kind == _jaxpr.SCAN:
                self._link([sub.invars[i] for i in carry],
                           sub.outvars[:len(carry)])
            self.walk(sub)
        for i, v in enumerate(outs):
            self._mark([self.key(v)], _DATA if kind == _jaxpr.SCAN and i < len(carry)
                       else max(self._source(self.key(sub.outvars[i])) for sub in subs))

    def _layers(self, eqn, uses) -> dict[int, int]:
        """``{xs position: parameter}`` of a scan over a stack of layers, else ``{}``."""
        if self.ctx or not self.stacks:
            return {}
        p = eqn.params
        first = p["num_consts"] + p["num_carry"]
        found: dict[int, int] = {}
        for pos, v in enumerate(eqn.invars[first:]):
            if not isinstance(v, jcore.Literal) and uses.get(v) == 1:
                j = self.param_of.get(self.key(v))
                if j is not None:
                    found[pos] = j
        by_group: dict = {}
        for pos, j in found.items():
            by_group.setdefault(self.owners[j], []).append(pos)
        keep = {g for g, pos in by_group.items()
                if self.stacks.get(g) == p["length"] and len(pos) == self.owners.count(g)}
        return {pos: j for pos, j in found.items() if self.owners[j] in keep}

    def _unrolled(self, eqn, sub, sliced: dict[int, int]) -> None:
        """A scan over a stack of layers, walked once per layer: layer ``i``'s carry in is
        layer ``i - 1``'s carry out (the scan's initial carry for the first), each layer
        reads its own slice of the stacked parameters, and values stacked over the layers
        (other ``xs``, the outputs ``ys``) join every layer's."""
        p = eqn.params
        nc, ncar, n = p["num_consts"], p["num_carry"], p["length"]
        ins, outs = list(eqn.invars), list(eqn.outvars)
        outer = self.ctx
        self.scans[id(eqn)] = (n, eqn)
        prev = None
        for s in (range(n - 1, -1, -1) if p["reverse"] else range(n)):
            ctx = outer + ((id(eqn), s),)
            here = lambda v, c=ctx: self.key(v, c)  # noqa: E731
            for i, (v, u) in enumerate(zip(ins, sub.invars)):
                if nc <= i < nc + ncar:
                    src = self.key(v) if prev is None else self.key(sub.outvars[i - nc], prev)
                    self.uf.union([src, here(u)])
                    self._mark([here(u)], _DATA)
                elif i - nc - ncar in sliced:
                    self.sliced.setdefault(sliced[i - nc - ncar], {})[s] = here(u)
                    self._mark([here(u)], _PARAMS)
                else:
                    self.uf.union([self.key(v), here(u)])
                    self._mark([here(u)], self._source(self.key(v)))
            self._mark(map(here, sub.constvars), _CONST)
            self.ctx = ctx
            try:
                self.walk(sub)
            finally:
                self.ctx = outer
            for v, u in zip(outs[ncar:], sub.outvars[ncar:]):
                if self.reaches([v]):  # (per-layer outputs nobody reads: no join)
                    self.uf.union([self.key(v), here(u)])
                self._mark([self.key(v)], self._source(here(u)))
            prev = ctx
        for v, u in zip(outs[:ncar], sub.outvars[:ncar]):
            self.uf.union([self.key(v), self.key(u, prev)])
            self._mark([self.key(v)], _DATA)

    def _link(self, a: Sequence, b: Sequence) -> None:
        for u, v in zip(a, b):
            self.union(u, v)


def analyse(jaxpr, sizes: Sequence[int], param_owners: Sequence[str | None],
            loss_index: int = 0, keep: frozenset = frozenset(), stacks=None,
            casts: frozenset = frozenset(), rooted: frozenset | None = None) -> Plan:
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
      stacks: ``{group: depth}`` of the groups that have a slot ``group[i]`` per layer
        (:func:`adaloss_jax._groups.stack_lengths`).
      casts: the points on the wide side of a cast of the loss
        (:func:`adaloss_jax._record.mark_casts`).
      rooted: the root's parameters (by index) that anchor the region they are read
        in, as a module's do (``None``: all of them); the others anchor nothing.

    The region holding the loss is anchored by :data:`~adaloss_jax._tree.SEED`, not
    the root, where every point with the loss's region on a side is such a cast, with
    the loss's region on its consumer side and another on its producer side, and no
    parameter is read there: its cotangents are then all measured in the wide dtype
    before a cast narrows them, so the loss's seed scale (the root's scale from the
    state) loses nothing there, and the root's own regions (the cast's narrow side: a
    region whose cotangents come from the loss's region alone is anchored by the root)
    may choose their scale in the same backward pass, at the cast
    (:mod:`adaloss_jax._live`).

    A point that would convert nothing and whose every input comes straight from
    another point (whose output nothing else reads) is left out of the applied program:
    the cotangent it would measure is the one that point measures, unchanged and with
    the same anchors (a parent module's boundary around a child's). It gets no plan, as
    a point the program does not hold (:class:`PointPlan`).

    In a scan over a stack of layers (:class:`_Walker`) slice ``i`` of a group's
    parameters is anchored by the group's slot ``group[i]``, and each region of the
    body has anchors per layer, as in the same layers unrolled: a point there gets
    :class:`Steps` where they differ from layer to layer.
    """
    w, whole = _walked(jaxpr, sizes, param_owners, stacks, loss_index)
    find = w.uf.find

    def region(v):
        return find(v) if _var(v) else None

    fixed: dict = {}
    loss = jaxpr.outvars[loss_index]
    loss_region = region(loss)
    read_in_loss = False  # a parameter read in the loss's region
    params_y = []
    for j, ((x, y), owner) in enumerate(zip(w.param_pairs, param_owners)):
        if owner is None or not _var(y):
            params_y.append(None)
            continue
        uses = [y] if j not in w.sliced else list(w.sliced[j].values())
        names = [owner] if j not in w.sliced else [Layer(owner, i) for i in w.sliced[j]]
        for u, name in zip(uses, names):
            r = region(u)
            if r is loss_region:
                read_in_loss = True
            elif name != ROOT or rooted is None or j in rooted:
                fixed.setdefault(r, set()).add(name)
        params_y.append(y if j not in w.sliced else w.sliced[j])
        fixed[region(x)] = {owner}
    if loss_region is not None:
        seeded = not read_in_loss and _left_by_casts(whole, region, loss_region, casts)
        fixed[loss_region] = {SEED if seeded else ROOT}

    # Cotangents flow from each point's y side into its x side.
    sources: dict = {}
    for layers in whole.values():
        for pairs in layers.values():
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
            for s in srcs:  # (from the loss's region, seeded or not: the root)
                got = anchors.get(s, set())
                cur |= {ROOT} if SEED in got else got
            changed |= len(cur) != before

    def of(r) -> tuple[str, ...]:
        a = anchors.get(r) if r is not None else None
        return tuple(sorted(a)) if a else (ROOT,)

    def side(layers, i, k):  # the anchors of leaf i's side k, per layer where they vary
        if None in layers:
            return of(region(layers[None][i][k]))
        return _steps([of(region(layers[s][i][k])) for s in range(len(layers))])

    points = []
    for n in range(len(sizes)):
        layers = whole.get(n)
        if layers is None:
            points.append(PointPlan(None, None))
            continue
        passed = w.passed.get(n, set())
        size = len(next(iter(layers.values())))
        x = tuple(None if i in passed else side(layers, i, 0) for i in range(size))
        y = tuple(None if i in passed else side(layers, i, 1) for i in range(size))
        fed = w.fed.get(n, [])
        feeders = [a for i, a in enumerate(fed[0]) if i not in passed] if len(fed) == 1 else []
        if (n not in keep and x == y and feeders
                and all(a is not None and a in whole and len(w.points[a]) == 1
                        and a not in w.blobbed for a in feeders)):
            points.append(PointPlan(None, None))  # a repeat of the point feeding it
            continue
        points.append(PointPlan(x=x, y=y))
    params = []
    for u in params_y:
        if u is None:
            params.append(None)
        elif isinstance(u, dict):
            params.append(Steps([of(region(u[s])) for s in range(len(u))]))
        else:
            params.append(of(region(u)))
    stacked = frozenset(param_owners[j] for j in w.sliced)
    scans = {k: n for k, (n, _) in w.scans.items()}
    return Plan(tuple(points), tuple(params), stacked, scans)


def _left_by_casts(whole: dict, region, loss_region, casts: frozenset) -> bool:
    """Whether some point has the loss's region on a side and every such point is a
    cast of the loss (``casts``) converting from it into another region."""
    found = False
    for n, layers in whole.items():
        for pairs in layers.values():
            for x, y in pairs:
                rx, ry = region(x), region(y)
                if loss_region is not rx and loss_region is not ry:
                    continue
                if n not in casts or ry is not loss_region or rx is loss_region:
                    return False
                found = True
    return found


def _walked(jaxpr, sizes: Sequence[int], param_owners: Sequence[str | None], stacks,
            loss_index: int = 0) -> tuple[_Walker, dict[int, dict]]:
    """The walked program (its regions in ``uf``) and, per point held as recorded, its
    pairs of keys per occurrence (by layer along a stack)."""
    w = _Walker(param_owners, stacks, _jaxpr.reaching(jaxpr, [loss_index]))
    w.walk(jaxpr)
    whole: dict[int, dict] = {}  # n -> {slice or None: per leaf (x key, y key)}
    for n, occurrences in w.points.items():
        if not (n < len(sizes) and all(len(p) == sizes[n] for _, p in occurrences)):
            for _, pairs in occurrences:
                for x, y in pairs:
                    w.uf.union([x, y])
            continue
        by_ctx: dict = {}
        for ctx, pairs in occurrences:
            by_ctx.setdefault(ctx, []).append(pairs)
        scans = {c[0][0] for c in by_ctx if c}
        per_layer = (() not in by_ctx and len(scans) == 1
                     and len(by_ctx) == w.scans[next(iter(scans))][0])
        groups = list(by_ctx.values()) if per_layer else [[p for ps in by_ctx.values()
                                                          for p in ps]]
        for same in groups:  # the same point reached twice (in one layer): one plan
            for other in same[1:]:
                for (x0, y0), (x1, y1) in zip(same[0], other):
                    w.uf.union([x0, x1])
                    w.uf.union([y0, y1])
        whole[n] = ({c[0][1]: by_ctx[c][0] for c in by_ctx} if per_layer
                    else {None: groups[0][0]})
    return w, whole


def in_loss_region(jaxpr, sizes: Sequence[int], param_owners: Sequence[str | None],
                   candidates: Sequence, loss_index: int = 0, stacks=None) -> list[bool]:
    """For each of ``candidates`` (variables of the jaxpr's top level): whether it lies
    in the region holding the loss (anchored by the root alone, :func:`analyse`)."""
    w, _ = _walked(jaxpr, sizes, param_owners, stacks, loss_index)
    loss = jaxpr.outvars[loss_index]
    if not _var(loss):
        return [False] * len(candidates)
    r = w.uf.find(loss)
    return [_var(v) and w.uf.find(v) is r for v in candidates]
