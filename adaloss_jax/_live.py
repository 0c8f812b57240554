"""Same-step scales (``AdaptiveScale(same_step=True)``): which regions of the backward
stream choose their scale from the cotangent in hand, and who tells the others.

A module's region (anchors ``(g,)``, :mod:`adaloss_jax._stream`) is *live* when the
backward pass can set its scale where the cotangent enters it::

    entries of g  = the converting points with producer side (g,): its call's output
                    point, and a child's input point where the cotangent comes back
    decider of g  = the entry last in the forward order (first in the backward pass)
    border of g   = the other converting points with (g,) on a side (the other entries
                    included), and the parameter conversions into or out of (g,)
    live          = g is no stack slot, nor the root where it anchors the loss's region
                    (no cotangent enters that region: it starts from the loss's seed;
                    the root is live where that region is the seed's,
                    :data:`~adaloss_jax._tree.SEED`, left only through casts: its
                    entries are then those casts and any other way into it (where a
                    parameter of the root's anchors a region that could not choose
                    its own scale, :mod:`adaloss_jax._stream`), and it decides at the
                    last of them in the forward order, as a module called twice), and
                    its decider and whole border sit
                    in one scope of the recorded program (its top level with nested jits,
                    checkpoint bodies and cond branches inlined, a branch after the one
                    before it), each met once (not inside a scan or shard_map of the
                    loss: there a point's backward pass runs per iteration or device,
                    and a scan decides as below; a scan of one iteration over no stack
                    is its body run once, in the scope around it), the decider
                    strictly after the rest

A decider in a cond branch not taken never runs: its choice, read by every point of its
border as a token's cotangent, is then zero, the plan, on every side (as for a module
whose output reaches nothing). So where the last entry lies in a cond's branch, every
other branch of that cond with entries gets a decider too, at its own last entry (its
border in that branch all before it; else that branch keeps the plan), and so on in
the conds nested there (:func:`_branch_deciders`): whichever branch runs, the region
decides in it.

So a module called twice is decided at its second call, whose backward pass runs first;
the first call's cotangent enters at that scale (an overflow there backs off as any).

A fan-in (a value read by several modules: a residual stream, one input of q, k and v;
anchors of several groups, each a whole group or one layer's slot of a stack read at a
point outside its scan, :func:`fan_in`) is live by the same rule, known by its anchor
set (not where that set is itself one layer's part of anchors that vary by layer, or a
whole stacked group or one met per layer reads it: its border lies in a scan's body):
it decides at its last entry in the forward order (a residual stream at its last
reader, the head or the block above), from the cotangent arriving there, and the other
readers' exits into it convert at that choice. Its limits combine its anchors'
(``adaloss_jax._grad._limits``): until they were measured it chooses from the
cotangent in hand alone, which it puts halfway down the span of the dtype it is held in
(:func:`adaloss_jax._channel.halfway`: its growth below the decider is unmeasured);
after, never above the min of their rule scales, the scale it would have run at
planned. Its choice is no group's
scale (a parameter read in it converts to its owner's at its own conversion, which
takes the choice as a token), so it goes to the statistics' decoding only, as its
set's scale.

A stack of layers in one scan decides too, a scale per layer (``Live.layers``):

    inside a layer  = the body's sites analysed as above, every layer's own slot of a
                      stacked group as one group (:func:`symbol`): its regions decide
                      in the body, where every layer runs the same program
    a chain         = the body's one converting point is every layer's exit into the
                      layer executed next (:class:`Chain`): each layer decides there,
                      and the next layer's choice rides in the scan's carry
    a stream        = a value every layer reads and adds to (a residual stream, a
                      highway's carry; a fan-in per layer, its readers from that layer
                      on) that one point of the body, its exit, converts into the next
                      layer's (:func:`_stream`): it decides per layer at its exit as a
                      chain's layer does, the body's other regions as above, and a way
                      into the first layer inside the body (a block's input point)
                      takes the choice of the region before the scan from a token that
                      leaves the scan from the first layer, or, where it is that
                      region's last entry (its whole border before the scan), decides
                      it at the first layer, the tokens emitted for it entering the scan

A scan over time (no stack: every iteration reads the same parameters, an RNN's cell)
decides too, a scale per region for every iteration (``Live.recurs``), since the
parameter gradients are summed over the iterations:

    inside        = a region whose every entry is in the body, analysed as one program
                    there, its border in the body or before the scan (in the scan's
                    scope, met once, a parameter conversion included): its decider
                    chooses at the iteration the backward pass runs first (the last
                    executed), and its choice rides in the carry to the others (the
                    tokens emitted for it before the scan are the carry's first, so
                    the last iteration's choice reaches them); elsewhere it reads the
                    carried choice, its measurement unused
    after         = a region deciding after the scan whose border reaches into the body
                    (the head reading the cell's output): its border there counts as at
                    the scan's place, and every iteration emits a token for it, stacked
                    out of the scan and summed, so its choice reaches every iteration

The decider measures the arriving cotangent (at the scale of its consumer side) and
chooses ``g``'s log2 scale (:func:`adaloss_jax._channel.decide`). Every border point
that converts into or out of ``g`` needs that choice in its own backward pass, which
runs later: in the forward pass it emits a zero *token* that the decider takes as an
input, and the decider's backward pass returns its choice as that token's cotangent
(each token is read once, so nothing sums it). A decider whose own consumer side is
another live region gets that region's choice the same way.

Everything here is static: it reads the plan's anchors and the order of the points.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

from adaloss_jax._layout import Layer
from adaloss_jax._stream import Steps
from adaloss_jax._tree import ROOT, SEED


class Chain(NamedTuple):
    """A stack of layers scanned as a chain: one point of the scan's body is the exit of
    every layer (its ``x`` side the layer, its ``y`` side the layer executed next, or
    after the last one the stack's consumer), and no other point of the body converts.

    Each layer decides there, at its exit, from the cotangent arriving from the layer
    executed next, whose choice reaches it through a token in the scan's carry: the
    body takes the carried token (the layer's own, emitted by the previous layer's exit)
    and carries on the one its exit emits for the next layer. The first layer's token
    is the sum of those the points before the scan emitted for it; the last layer's
    goes on to its consumer's decider (``last``: its one group, or its anchor set where
    several modules read the stack's output, a fan-in; ``None``: nobody takes it, and
    that side reads the plan), or, where the consumer is the first layer of a stack scanned
    straight after it (this stack's exit its way in), into that stack's carry, as the
    first token of its own (:func:`_exits`)."""

    slots: tuple[str, ...]  # the layers' groups, by slice
    decider: tuple  # the site key of the layers' exit, in the body
    first: int  # the slice executed first (the last one for a reversed scan)
    last: Any  # the group or fan-in deciding after the scan that takes the final token
    # (or the first layer of the stack scanned straight after it)


CHAIN_X, CHAIN_Y = "<layer>", "<next layer>"  # the two sides of a chain's exit, in its body
FOLLOW = "<layer, or before the first>"  # a stream's way in, in its body (:func:`_stream`)


class Live(NamedTuple):
    """The live regions of a program (static).

    Attributes:
      groups: the live groups, sorted (a chain's layers included).
      deciders: ``{site key: group}``, the point that chooses each group's scale
        (:data:`CHAIN_X` for a chain's exit, a layer's :func:`symbol` inside a scan).
      needs: ``{site key: groups}``: the live groups whose chosen scale the site's
        backward pass needs (a token each), for every site that needs one.
      chains: ``{scan equation id: Chain}``.
      layers: ``{scan equation id: {name: slots}}``: per scan over a stack, the live
        groups its body decides, a scale per layer: its chain's layers
        (:data:`CHAIN_X`), or the regions inside one layer (by :func:`symbol`).
      names: ``{site key: (x, y)}``: the group names of the two sides of a point
        inside such a body (:func:`region_key` names the others, a way into a stream's
        first layer before its scan included: that layer's anchor set is a fan-in,
        :func:`_stream`, its own region key).
      fanins: the live fan-ins, each by its anchor set (:func:`fan_in`), sorted; a
        stream's layers (:func:`_stream`) included.
      streams: the site keys of the streams' exits (deciders of a fan-in per layer).
      ways_in: ``{site key: group}``: a stream's way in inside its body whose side
        before the first layer is a live region (``group``, deciding after the scan):
        its token leaves the scan from the first layer.
      opens: ``{site key: group}``: a stream's way in inside its body that decides the
        region before the first layer (``group``: no entry of it after the scan, its
        whole border before it), at the layer executed first, from the cotangent
        arriving there; the tokens emitted for it before the scan enter the scan.
      recurs: ``{scan equation id: (inside, after)}``: per scan over time
        (:class:`Recur`), the live regions deciding in its body (their deciders carry
        their choice from iteration to iteration) and those deciding after it that its
        body's points need (a token per iteration, stacked out of the scan).
      adopts: ``{group: fan-in}``: a group with no region of its own whose parameters
        are all read in one live fan-in (:func:`_adoptions`): its scale is the fan-in's
        choice, and its parameters' gradients are not converted.
    """

    groups: tuple[str, ...] = ()
    deciders: dict = {}
    needs: dict = {}
    chains: dict = {}
    layers: dict = {}
    names: dict = {}
    fanins: tuple = ()
    streams: frozenset = frozenset()
    ways_in: dict = {}
    opens: dict = {}
    recurs: dict = {}
    adopts: dict = {}

    @property
    def any(self) -> bool:
        """Whether anything decides in the backward pass."""
        return bool(self.groups or self.fanins)


class Scan(NamedTuple):
    """A scan over a stack of layers as the analysis sees it."""

    id: int  # the scan equation's id
    at: tuple  # its (scope, position) in the forward order
    length: int
    reverse: bool
    keys: frozenset  # the site keys of its body
    top: frozenset  # those met at the body's own top level (nested jits inlined)
    order: tuple = ()  # ``(key, (scope, position))`` of the body's sites, in its order


class Recur(NamedTuple):
    """A scan over time (no stack of layers, more than one iteration, met at the top
    level) as the analysis sees it."""

    id: int  # the scan equation's id
    at: tuple  # its (scope, position) in the forward order
    keys: frozenset  # the site keys of its body
    order: tuple = ()  # ``(key, (scope, position))`` of the body's sites, in its order


PARAMS_KEY = "params"  # the key of parameter conversion ``i`` is ``(PARAMS_KEY, i)``


def _param_sites(params: Sequence) -> list[tuple]:
    """The parameter conversions as sites ``(key, (own, uses), True)``, where a
    conversion's place in the program matters as a point's does."""
    return [((PARAMS_KEY, i), pair, True) for i, pair in enumerate(params) if pair]


def reads_a_choice(live: Live, i: int, pair) -> bool:
    """Whether parameter ``i``'s conversion ``pair`` (own, uses) converts from a scale
    chosen in the backward pass: the region it is read in decides, or is a stack's
    first layer whose choice reaches it (:func:`_param_sites`)."""
    uses = region_key(pair[1])
    return uses is not None and uses in live.needs.get((PARAMS_KEY, i), ())


def single(anchors) -> str | None:
    """The group of a one-group anchor set (``None`` for a fan-in, or per-layer
    anchors)."""
    if not isinstance(anchors, Steps) and anchors is not None and len(anchors) == 1:
        return anchors[0]
    return None


def fan_in(anchors) -> tuple | None:
    """A fan-in's anchor set as its own live key: plain anchors of several groups, each
    a whole group or one layer's slot of a stack (a value read by a stack's layer at a
    point outside its scan: a residual stream that enters a scanned stack), else
    ``None``."""
    if (isinstance(anchors, tuple) and not isinstance(anchors, Steps) and len(anchors) > 1
            and all(type(g) is str or _slot(g) for g in anchors)):
        return anchors
    return None


def _slot(g) -> bool:
    """Whether ``g`` is one layer's slot of a stacked group (not a body's symbol)."""
    return isinstance(g, Layer) and g.index is not None


def region_key(anchors, fanins: bool = True):
    """What a side's region is known by among the live ones: its one group
    (:func:`single`), or a fan-in's anchor set (:func:`fan_in`, where ``fanins``)."""
    g = single(anchors)
    return g if g is not None or not fanins else fan_in(anchors)


def _per_layer(anchors) -> list[str]:
    """The groups of per-layer anchors (:class:`~adaloss_jax._stream.Steps`), else
    none."""
    return [g for a in anchors for g in a] if isinstance(anchors, Steps) else []


def symbol(anchors):
    """Per-layer anchors whose slice ``i`` is the stacked group ``g``'s own slot
    ``g[i]`` as the one-group anchors ``("g[*]",)``: inside a scan's body, where every
    slice runs the same program, a layer's own region is one region. Others as given."""
    if isinstance(anchors, Steps) and all(len(a) == 1 for a in anchors):
        slots = [a[0] for a in anchors]
        g = getattr(slots[0], "group", None)
        if all(isinstance(s, Layer) and (s.group, s.index) == (g, i)
               for i, s in enumerate(slots)):
            return (Layer(g, None),)
    return anchors


def _run(scan: Scan) -> list[int]:
    """The slices of ``scan``'s stack in the order its layers execute."""
    return list(range(scan.length - 1, -1, -1) if scan.reverse else range(scan.length))


def _relays(y, x, run) -> bool:
    """Whether per-layer sides ``x`` (a layer's) and ``y`` (what it converts into) pass
    each layer on to the layer executed next."""
    return all(y[i] == x[j] for i, j in zip(run, run[1:]))


def _exits(scans: Sequence[Scan], every: Sequence[tuple], counts: Counter) -> dict:
    """``{site key: (scan, the slice of its last layer)}``: per scan over a stack, the
    one point of its body, met once at its top level, that converts every layer into
    the layer executed next (a chain's or a stream's exit, :func:`_chain`,
    :func:`_stream`), where it has exactly one."""
    out = {}
    for scan in scans:
        run = _run(scan)
        found = [k for k, (x, y), c in every
                 if k in scan.keys and c and isinstance(x, Steps) and isinstance(y, Steps)
                 and _relays(y, x, run)]
        if len(found) == 1 and found[0] in scan.top and counts[found[0]] == 1:
            out[found[0]] = (scan, run[-1])
    return out


def _chain(scan: Scan, every: Sequence[tuple], order: dict, params: Sequence,
           counts: Counter, earlier: dict | None = None) -> Chain | None:
    """``scan``'s :class:`Chain`, or ``None`` where its stack is no chain."""
    inside = [(k, pair) for k, pair, convert in every if k in scan.keys and convert]
    if len(inside) != 1:
        return None
    key, (x, y) = inside[0]
    if (key not in scan.top or counts[key] != 1 or not isinstance(x, Steps)
            or not isinstance(y, Steps) or any(len(a) != 1 for a in x)):
        return None
    slots = tuple(a[0] for a in x)
    run = _run(scan)
    if len(set(slots)) != len(slots) or ROOT in slots:
        return None
    if not _relays(y, x, run):  # exits into the next layer
        return None
    mine = set(slots)

    def touches(a, b):
        return any(g in mine for side in (a, b) for g in _region_groups(side))

    if not _only_ways_in(scan, every, params, order, counts, (slots[run[0]],), touches,
                         earlier):
        return None
    return Chain(slots, key, run[0], region_key(y[run[-1]]))


def _only_ways_in(scan: Scan, every: Sequence[tuple], params: Sequence, order: dict,
                  counts: Counter, first, touches, earlier: dict | None = None) -> bool:
    """Whether every point outside ``scan``'s body and every parameter conversion that
    ``touches(x, y)`` the stack is a way into its first layer (anchors ``first``) before
    the scan: one converting into it from a whole region, met once, earlier in the
    scan's scope (a parameter read in the first layer's region, such as the root's
    position embedding, converts there), one measuring it without converting, or, in
    the body of a stack scanned earlier in that scope, that stack's exit converting its
    last layer into it or a point measuring it there (``earlier``: the exits of
    :func:`_exits`, which :func:`analyse` keeps only where their stacks relay too)."""
    outside = [(k, pair, convert) for k, pair, convert in every if k not in scan.keys]
    for k, (a, b), convert in [*outside, *_param_sites(params)]:
        if not touches(a, b) or (not convert and a == b == first):
            continue
        into = [(e, at) for e, (other, at) in (earlier or {}).items() if k in other.keys
                and other.at[0] == scan.at[0] and other.at[1] < scan.at[1]]
        if into:  # (in the body of a stack scanned before it)
            (e, at), side = into[0], (b if convert else a)
            if (k == e if convert else a == b) and side[at] == first:
                continue
        if (not convert or isinstance(a, Steps) or b != first or counts[k] != 1
                or k not in order or order[k][0] != scan.at[0] or order[k][1] >= scan.at[1]):
            return False
    return True


def analyse(every: Sequence[tuple], top: Sequence[tuple], params: Sequence,
            params_order: float, stacked: frozenset = frozenset(),
            scans: Sequence[Scan] = (), conds: frozenset = frozenset(),
            recurs: Sequence[Recur] = (), owners: Sequence[str] = ()) -> Live:
    """The live regions.

    Args:
      every: ``(key, pair, convert)`` of every site occurrence of the program (a point
        met twice, in a jaxpr evaluated twice, is listed twice), ``pair`` its ``(x
        anchors, y anchors)``.
      top: ``(key, (scope, position))`` of the sites that may decide or receive a
        choice: ``scope`` where they are evaluated (``()``: the top level, a nested
        ``jit``, ``checkpoint`` body or ``cond`` branch in the scope around it),
        ``position`` their place there in the forward order.
      params: per floating parameter leaf, ``None`` or the ``(own, uses)`` anchors its
        conversion goes between.
      params_order: the ``(scope, position)`` of the parameter point (``None``: none).
      stacked: the groups that get a scale per layer.
      scans: the scans over stacks of layers met at a scope's top level.
      conds: the ``(scope, position)`` of each ``cond`` met at the top level (its
        branches' sites at ``position + (branch, ...)``): a region whose last entry is in
        a branch decides in the others too (:func:`_branch_deciders`).
      recurs: the scans over time met at the top level (:func:`_over_time`).
      owners: the group of each floating parameter leaf (none: no group adopts a
        fan-in's choice, :func:`_adoptions`).
    """
    order = dict(top)
    counts = Counter(key for key, _, _ in every)
    counts.update({(PARAMS_KEY, i): 1 for i in range(len(params))})
    if params_order is not None:
        order.update({(PARAMS_KEY, i): params_order for i in range(len(params))})
    exits = _exits(scans, every, counts)
    while True:  # (a stack entered from another's exit relays only where that one does)
        chains, streams = {}, {}
        for scan in scans:
            chain = _chain(scan, every, order, params, counts, exits)
            if chain is not None:
                chains[scan.id] = (scan, chain)
                continue
            stream = _stream(scan, every, order, params, counts, exits)
            found = stream and _inside(scan, every, params, counts, stream)
            if found and found[1].get(stream.chain.decider) == CHAIN_X:
                streams[scan.id] = (scan, stream, found)
        relays = [*chains.values(), *((scan, st.chain) for scan, st, _ in streams.values())]
        kept = {k: v for k, v in exits.items() if any(c.decider == k for _, c in relays)}
        if kept == exits:
            break
        exits = kept
    layers, names, ways, opens = {}, {}, {}, {}
    # (a stack whose last layer's exit converts into the first layer of a stack scanned
    # after it names that layer as its ``last``: its final token goes on in that stack's
    # carry, below)
    firsts = {c.slots[c.first] for _, c in relays}
    inside = {k for scan, _ in relays for k in scan.keys}
    extra: dict = {}  # a chain's final token: a way into its consumer
    for scan, chain in relays:
        if chain.last is not None:
            extra.setdefault(chain.last, []).append(("scan", scan.id))
            order[("scan", scan.id)] = scan.at
            counts[("scan", scan.id)] = 1
    opened: dict = {}  # a way in at the first layer: an entry of the region before it
    for scan, st, _ in streams.values():
        for g in set(st.ways_in.values()):
            mine = [k for k, h in st.ways_in.items() if h == g]
            # (one way in, met once, may decide there; several sit on its border)
            one = len(mine) == 1 and counts[mine[0]] == 1
            (opened if one else extra).setdefault(g, []).append(("way in", scan.id))
            order[("way in", scan.id)] = scan.at
            counts[("way in", scan.id)] = 1
    # a way into a stream's first layer: its anchor set as the name of the token it emits
    ways_in = {st.chain.slots[st.chain.first] for _, st, _ in streams.values()}
    named = frozenset().union(*(st.named for _, st, _ in streams.values()))
    seeded = any(y == (SEED,) for _, (_, y), _ in every)

    def way_in(pair):  # a side in a stream's first layer: its anchor set as one name
        return tuple((a,) if a in ways_in else a for a in pair)

    timed = frozenset().union(*(r.keys for r in recurs))
    for r in recurs:  # a body's border: at the scan's place; its entries: none outside
        for k, (x, y), c in every:
            gx, gy = region_key(x), region_key(y)
            if k not in r.keys or not c or gx == gy:
                continue
            if gx is not None:
                opened.setdefault(gx, []).append(("in time", r.id))  # (never in order)
            if gy is not None and ("time", r.id) not in extra.get(gy, ()):
                extra.setdefault(gy, []).append(("time", r.id))
        order[("time", r.id)] = r.at
        counts[("time", r.id)] = 1
    live, needs, others = _regions(
        [(k, way_in(pair), c) for k, pair, c in every if k not in inside | timed], order,
        counts, [p and way_in(p) for p in params], stacked | named, extra, firsts,
        root=seeded, opened=opened, conds=conds)
    recurring, inside_time = {}, {}
    for r in recurs:
        found = _over_time(r, every, order, counts, params, stacked | named, live)
        if found:
            inside_time.update(found[0])
            recurring[r.id] = (tuple(sorted(found[0], key=repr)), found[2])
            for k, w in found[1].items():
                needs[k] = tuple(dict.fromkeys((*needs.get(k, ()), *w)))
    deciders = {d: g for g, d in [*live.items(), *((g, k) for k, g in others.items()),
                                  *inside_time.items()] if d[0] != "way in"}
    for i, (_, c) in chains.items():
        deciders[c.decider] = CHAIN_X
        needs[c.decider] = (CHAIN_Y,)
        names[c.decider] = (CHAIN_X, CHAIN_Y)
        chains[i] = c._replace(last=c.last if c.last in live or c.last in firsts else None)
        layers[i] = {CHAIN_X: c.slots}
    for i, (_, st, (by_name, here, wanted, named_here)) in streams.items():
        chains[i] = st.chain._replace(
            last=st.chain.last if st.chain.last in live or st.chain.last in firsts else None)
        layers[i] = by_name
        deciders.update(here)
        needs.update(wanted)
        names.update(named_here)
        for k, g in st.ways_in.items():
            if live.get(g) == ("way in", i):  # it decides there, at the first layer
                deciders[k] = g
                opens[k] = g
            elif g in live:  # its choice, for the first layer's way in
                needs[k] = (*needs.get(k, ()), g)
                ways[k] = g
    for scan in scans:
        if scan.id not in chains:
            found = _inside(scan, every, params, counts)
            if found:
                layers[scan.id], here, wanted, named = found
                deciders.update(here)
                needs.update(wanted)
                names.update(named)
    slots = [g for by_name in layers.values() for group in by_name.values() for g in group]
    fanins = sorted(g for g in [*live, *slots, *inside_time] if isinstance(g, tuple))
    groups = [g for g in [*live, *slots, *inside_time] if not isinstance(g, tuple)]
    adopts = _adoptions(every, params, owners, set(fanins), set(groups) | stacked)
    for i, pair in enumerate(params):  # (no conversion: no token)
        if pair and single(pair[0]) in adopts:
            needs.pop((PARAMS_KEY, i), None)
    return Live(tuple(sorted(groups)), deciders, needs, chains, layers, names,
                tuple(fanins), frozenset(st.chain.decider for _, st, _ in streams.values()),
                ways, opens, recurring, adopts)


def _adoptions(every: Sequence[tuple], params: Sequence, owners: Sequence[str],
               fanins: set, taken: set) -> dict:
    """``{group: fan-in}``: the groups whose scale is a live fan-in's choice. Such a
    group has no region of its own (no side of a point is it alone; not the root, not
    live, no stack's) and each of its parameter leaves is read in the same live fan-in
    and nowhere else: its gradients are computed at the fan-in's scale, so its scale is
    that, and nothing converts them. (A module returning raw parameters that its
    parent reads, as Flax's ``DenseParams`` in ``OptimizedLSTMCell``: converted down to
    the plan instead, a step's gradients at a scale the rule had not measured yet could
    flush.)"""
    alone = {single(side) for _, pair, _ in every for side in pair} - {None}
    read: dict = {}
    for owner, pair in zip(owners, params):
        f = fan_in(pair[1]) if pair and pair[0] == (owner,) else None
        read.setdefault(owner, set()).add(f if f in fanins else None)
    return {g: f for g, (f, *more) in ((g, sorted(fs, key=repr)) for g, fs in read.items())
            if f is not None and not more and g != ROOT and g not in alone | taken}


def _over_time(r: Recur, every: Sequence[tuple], order: dict, counts: Counter,
               params: Sequence, stacked: frozenset, live: dict):
    """The live regions of the scan over time ``r``: ``({group: its decider in the body},
    {site key: the groups it needs}, the groups deciding after the scan that its body's
    points need)``, or ``None`` where none.

    Its body's sites are analysed as one program (:func:`_regions`, in the body's own
    order), every group there a whole group. A region decides inside where no entry of
    it lies outside the body and every point of its border outside it (a parameter
    conversion included) is met once in the scan's scope before it: those points' tokens
    are the carry's first. ``live``: the regions deciding at the top level, whose border
    the body's points may be on (``extra`` there: at the scan's place)."""
    body = [(k, pair, c) for k, pair, c in every if k in r.keys]
    after = sorted({region_key(y) for k, (x, y), c in body
                    if c and region_key(y) in live and region_key(y) != region_key(x)},
                   key=repr)

    def early(k):  # met once in the scan's scope, before it
        return (counts[k] == 1 and k in order and order[k][0] == r.at[0]
                and order[k][1] < r.at[1])

    barred, before = set(), {}
    for k, (x, y), c in every:
        gx, gy = region_key(x), region_key(y)
        if k in r.keys or not c or gx == gy:
            continue
        barred.add(gx)
        if gy is not None:
            before.setdefault(gy, []).append(k) if early(k) else barred.add(gy)
    for k, pair, _ in _param_sites(params):
        for g in {region_key(a) for a in pair} - {None}:
            before.setdefault(g, []).append(k) if early(k) else barred.add(g)
    inside: dict = {}
    needs: dict = {}
    if r.order:
        start = ("before time", r.id)  # the points before the scan, as one
        scope = r.order[0][1][0]
        found, wanted, _ = _regions(
            body, {**dict(r.order), start: (scope, (-1,))}, counts + Counter({start: 1}),
            (), stacked, {g: [start] for g in before}, carried=True)
        inside = {g: d for g, d in found.items() if g not in barred and g not in live}
        needs = {k: w for k, w in ((k, tuple(g for g in w if g in inside))
                                   for k, w in wanted.items()) if w}
        for g, d in inside.items():  # (its own token: the carry's, for the iteration
            needs[d] = (*needs.get(d, ()), g)  # the backward pass runs next)
            for k in before.get(g, ()):
                needs[k] = (*needs.get(k, ()), g)
    for k, (x, y), c in body:
        if c and region_key(y) in after and region_key(y) != region_key(x):
            needs[k] = tuple(dict.fromkeys((*needs.get(k, ()), region_key(y))))
    if not inside and not after:
        return None
    return inside, needs, tuple(after)


def _regions(every, order: dict, counts: Counter, params: Sequence, stacked: frozenset,
             extra: dict, firsts=frozenset(), root: bool = False, fanins: bool = True,
             opened: dict | None = None, conds: frozenset = frozenset(),
             carried: bool = False) -> tuple[dict, dict, dict]:
    """The live groups with their deciders, what every site needs, and the deciders
    beyond each group's last entry (``{site key: group}``, in the other branches of the
    conds around it, ``conds``: :func:`_branch_deciders`), of the sites ``every``
    (``extra``: border keys beyond theirs; ``opened``: entry keys beyond theirs;
    ``firsts``: groups whose tokens a chain takes; ``root``: whether the root may be
    live, its regions not the loss's; ``fanins``: whether a fan-in may be, keyed by its
    anchor set, :func:`region_key`; ``carried``: the border may follow the decider, as
    in a scan over time's body, where its tokens ride in the carry to the decider of the
    iteration the backward pass runs next)."""
    key_of = functools.partial(region_key, fanins=fanins)
    entries: dict[str, list] = {g: list(keys) for g, keys in (opened or {}).items()}
    border: dict[str, list] = {g: list(keys) for g, keys in extra.items()}
    unfit: set[str] = set()  # met per layer
    parts: set = set()  # the anchor sets met as a layer's part of per-layer anchors
    for key, (x, y), convert in every:
        unfit.update(_per_layer(x) + _per_layer(y))
        parts.update(a for side in (x, y) if isinstance(side, Steps) for a in side)
        if not convert:
            continue
        gx, gy = key_of(x), key_of(y)
        if gx is not None and gx != gy:
            entries.setdefault(gx, []).append(key)
        if gy is not None and gy != gx:
            border.setdefault(gy, []).append(key)
    for i, pair in enumerate(params):
        if pair is None:
            continue
        for side in pair:
            g = key_of(side)
            if g is not None:
                border.setdefault(g, []).append((PARAMS_KEY, i))
            unfit.update(_per_layer(side))
            parts.update(side if isinstance(side, Steps) else ())
    live: dict[str, tuple] = {}
    branch: dict = {}  # a decider per other branch of the conds around a group's decider
    for g, keys in entries.items():
        if g == ROOT and not root:
            continue  # (the loss's region: no cotangent enters it)
        if g in unfit or g in stacked or _slot(g):
            continue
        # a fan-in met per layer, or read by a group met per layer or stacked (a
        # layer's slot read here is no stack's: its point is out of the scan)
        if isinstance(g, tuple) and (g in parts or {a for a in g if not _slot(a)}
                                     & (unfit | stacked)):
            continue
        rest = keys + border.get(g, [])
        if not all(counts[k] == 1 and k in order for k in rest):
            continue
        d = max(keys, key=order.get)  # the last way in: the first the backward pass meets
        scope, at = order[d]
        if all(order[k][0] == scope and (order[k][1] < at or carried and k not in keys)
               for k in rest if k != d):
            live[g] = d
            branch[g] = _branch_deciders(d, keys, rest, order, conds)
    others = {k: g for g, ks in branch.items() for k in ks}
    needs: dict = {}
    for key, (x, y), convert in every:
        if not convert or key not in order:
            continue
        want = [g for g in dict.fromkeys((key_of(x), key_of(y)))
                if (g in live and live[g] != key and others.get(key) != g) or g in firsts]
        if want:
            needs[key] = tuple(want)
    for i, pair in enumerate(params):
        if pair is not None:
            want = [g for g in dict.fromkeys(map(key_of, pair)) if g in live or g in firsts]
            if want:
                needs[(PARAMS_KEY, i)] = tuple(want)
    return live, needs, others


def _branch_deciders(d, entries: Sequence, rest: Sequence, order: dict,
                     conds: frozenset) -> list:
    """The deciders a region gets beyond ``d``, its last entry, where ``d`` lies in a
    branch of a ``cond`` (``conds``: each cond's ``(scope, position)``): in every
    other branch of it with entries of the region, the last of them, where the
    region's border in that branch is all before it (else that branch keeps the plan),
    and so on for the conds nested in that branch. Only the branch taken runs, so at
    most one decider per cond chooses; the tokens emitted before the cond enter every
    branch, and a branch not taken returns no choice for them (under a batched
    predicate, where both branches run, the one whose cotangent is masked out measures
    nothing and keeps the plan: its choice is zero)."""
    scope, at = order[d]

    def within(k, pos, b=None):  # in cond ``pos``'s branch ``b`` (any branch: None)
        s, a = order[k]
        return (s == scope and len(a) > len(pos) + 1 and a[:len(pos)] == pos
                and b in (None, a[len(pos)]))

    out = []
    for s, pos in sorted(conds):
        if s != scope or len(at) <= len(pos) + 1 or at[:len(pos)] != pos:
            continue  # (not around d)
        for b in sorted({order[k][1][len(pos)] for k in entries if within(k, pos)}
                        - {at[len(pos)]}):
            mine = [k for k in entries if within(k, pos, b)]
            there = [k for k in rest if within(k, pos, b)]
            d_b = max(mine, key=order.get)
            if all(order[k][1] < order[d_b][1] for k in there if k != d_b):
                inner = frozenset(c for c in conds if c[0] == scope
                                  and len(c[1]) > len(pos) + 1 and c[1][:len(pos) + 1]
                                  == (*pos, b))
                out += [d_b, *_branch_deciders(d_b, mine, there, order, inner)]
    return out


def _region_groups(side) -> list:
    """The groups whose own region a side names: its one group, or a stack's slots read
    alone; a fan-in's anchors are not theirs (its region is the fan-in's), a layer's
    fan-in's neither."""
    if isinstance(side, Steps):
        return [g for a in side for g in _region_groups(a)]
    return list(side) if side and len(side) == 1 else []


def _inside(scan: Scan, every: Sequence[tuple], params: Sequence, counts: Counter,
            stream: Stream | None = None):
    """The regions inside one layer of ``scan``'s stack: the body's sites analysed as
    one program, each layer's own groups as one :func:`symbol` (and a ``stream``'s
    layers as :data:`CHAIN_X`, its exit's other side as :data:`CHAIN_Y`). A group is
    left out where any of its layers is named outside the body (a point or a parameter
    conversion: its border would leave the body). ``None`` where nothing decides."""
    outside = set()
    for k, pair, _ in every:
        if k not in scan.keys:
            outside.update(g for side in pair for g in _region_groups(side))
    for pair in params:
        if pair is not None:
            outside.update(g for side in pair for g in _region_groups(side))
    renamed = stream.sides if stream is not None else {}
    body = [(k, (symbol(renamed.get(x, x)), symbol(renamed.get(y, y))), c)
            for k, (x, y), c in every if k in scan.keys]
    slots: dict = {}
    for k, (x, y), _ in every:
        if k not in scan.keys:
            continue
        for raw in (x, y):
            if raw in renamed:
                continue
            sym = symbol(raw)
            if sym is not raw:
                slots[sym[0]] = tuple(a[0] for a in raw)
            elif isinstance(raw, Steps):  # another layer's slot, read alone
                outside.update(a[0] for a in raw if len(a) == 1)
    fit = {g for g, mine in slots.items() if not outside & set(mine)}
    marks = frozenset({CHAIN_Y, FOLLOW} if stream is not None else ())
    live, needs, _ = _regions(body, dict(scan.order), counts, (), marks, {},
                              firsts=marks - {FOLLOW}, fanins=False)
    if stream is not None:
        fit.add(CHAIN_X)
        slots[CHAIN_X] = stream.chain.slots
    live = {g: d for g, d in live.items() if g in fit}
    needs = {k: w for k, w in ((k, tuple(g for g in w if g in live or g in marks))
                               for k, w in needs.items()) if w}
    if not live:
        return None
    names = {k: tuple(single(side) for side in pair) for k, pair, _ in body
             if k in needs or k in live.values()}
    return ({g: slots[g] for g in sorted(live)}, {d: g for g, d in live.items()}, needs,
            names)


def _fan_in_per_layer(anchors) -> bool:
    """Per-layer anchors, each layer's a fan-in of its own (several groups)."""
    return (isinstance(anchors, Steps) and len(set(anchors)) == len(anchors)
            and all(isinstance(a, tuple) and len(a) > 1 for a in anchors))


def _parts(side) -> list:
    return list(side) if isinstance(side, Steps) else [side]


class Stream(NamedTuple):
    """A stack's stream (:func:`_stream`)."""

    chain: Chain  # its layers' anchor sets as the slots, its exit as the decider
    sides: dict  # {a side in the body: its name there}: the stream, its way in
    named: frozenset  # the other regions the body names (none of them live outside it)
    ways_in: dict  # {site key: region}: a way in's side before the first layer, if live


def _stream(scan: Scan, every: Sequence[tuple], order: dict, params: Sequence,
            counts: Counter, earlier: dict | None = None) -> Stream | None:
    """``scan``'s stream, or ``None``: a value every layer reads and adds to (a residual
    stream, a highway's carry), each layer's a fan-in of its own (its readers from that
    layer on), that the layers pass on as a :class:`Chain`'s layers do: exactly one
    point of the body, the stream's *exit*, converts it into the stream of the layer
    executed next (after the last layer, into the stack's consumer).

    Inside one layer it is one region, :data:`CHAIN_X`, deciding at its exit (which
    must be the last of its entries in the body, :func:`_inside`) from the cotangent
    arriving from the next layer, whose choice rides in the carry (:data:`CHAIN_Y`).
    The body's other points that convert into or out of it take its choice by token.
    A way in from before the scan (a point, or the conversion of a parameter read in
    the first layer's stream: the root's position embedding) converts into the first
    layer's stream only, and its token is the carry's first. A way in inside the body
    (:data:`FOLLOW`: a block's input point, whose other side is the stream at every
    layer but the first) takes the layer's choice at every layer after the first
    (there it converts nothing) and at the first the choice of the region before the
    scan where that region decides after it (``ways_in``: its token leaves the scan
    from the first layer); where the way in is the region's last entry,
    :func:`analyse` makes it the region's decider at the first layer
    (``Live.opens``), else it keeps its planned scale. Everything else the body names
    keeps the plan outside it (``named``); the consumer only where the exit is its one
    border in the body."""
    run = _run(scan)
    body = [(k, pair, c) for k, pair, c in every if k in scan.keys]
    exits = [(k, x, y) for k, (x, y), c in body
             if c and _fan_in_per_layer(x) and isinstance(y, Steps) and _relays(y, x, run)]
    if len(exits) != 1 or exits[0][0] not in scan.top or counts[exits[0][0]] != 1:
        return None
    key, stream, out = exits[0]
    first, layer = run[0], set(stream)
    sides: dict = {stream: (CHAIN_X,), out: (CHAIN_Y,)}
    named: set = set()
    ways_in: dict = {}
    for k, (x, y), convert in body:
        for side, is_x in ((x, True), (y, False)):
            if side == out and (k == key or not convert):  # (measured there, after it)
                continue
            if side == stream:
                continue
            parts = _parts(side)
            if isinstance(side, Steps) and layer & set(side):
                if not (is_x and y == stream and side[first] not in layer
                        and all(side[i] == stream[i] for i in run[1:])):
                    return None
                sides[side] = (FOLLOW,)
                before = region_key(side[first])
                if before is not None and before != SEED:  # may decide outside, after it
                    ways_in[k] = before
                    continue
                parts = [side[first]]
            elif side in layer:
                return None
            named.update(a[0] if len(a) == 1 else a for a in parts if a)
    if not _only_ways_in(scan, every, params, order, counts, stream[first],
                         lambda a, b: layer & {*_parts(a), *_parts(b)}, earlier):
        return None
    last = region_key(out[run[-1]])
    if last is None or last in named or last == ROOT:
        named.add(last if last is not None else out[run[-1]])
        last = None
    if named & set(ways_in.values()):  # (named in the body besides: keeps the plan)
        named.update(ways_in.values())
        ways_in = {}
    return Stream(Chain(tuple(stream), key, first, last), sides, frozenset(named), ways_in)
