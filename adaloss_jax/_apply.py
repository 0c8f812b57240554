"""Applying a plan: the recorded loss evaluated with its scale points made real.

The jaxpr :func:`adaloss_jax._record.record` traced is evaluated equation by equation
(:mod:`adaloss_jax._jaxpr` names the kinds). A recorded point becomes the
``custom_vjp`` of :mod:`adaloss_jax._channel`, converting and measuring as the plan
says; the parameter point converts the parameters read at a scale other than their
owner's; equations without points are evaluated as they are. Higher-order equations with
points inside are rebuilt with the public transformation that made them, around the
evaluation of their body: ``jax.checkpoint`` with the same policy, ``lax.scan`` with the
same length, direction and unrolling, ``lax.switch``, ``jax.shard_map`` with the same
specs; ``jit`` is inlined.

Each row of a point (:class:`Site`) has a dummy of its own. A point inside a scan gets a
dummy stacked along the scan's length, passed in as a scanned input, so every iteration
writes its own row and nothing sums them: the rows are reduced exactly afterwards
(:func:`adaloss_jax._channel.reduce_rows`). :meth:`Program.sites` lists the rows in the
order :meth:`Program.evaluate` consumes their dummies: both walk the program the same
way.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from adaloss_jax import _channel, _formats, _jaxpr, _live, _stream
from adaloss_jax._common import min_once
from adaloss_jax._layout import GroupVector, layers
from adaloss_jax._state import ScaleStats
from adaloss_jax._stream import Plan, Steps
from adaloss_jax._tree import state_group


class Site(NamedTuple):
    """One row of one scale point, as the program holds it (static)."""

    n: int  # the point
    members: tuple[int, ...]  # its floating leaves in this row
    pair: tuple  # (x anchors, y anchors): the ratio it converts by
    cfg: _channel.PointConfig
    row: _channel.Row  # its anchors Steps where they vary by layer
    lead: tuple[int, ...] = ()  # stacked dimensions (the lengths of enclosing scans)
    layer_axis: int | None = None  # the one of them along a stack of layers


class Program:
    """A recorded loss with a plan: its rows, and its evaluation with points applied.

    Args:
      closed: the recorded ``ClosedJaxpr``.
      plan: where the conversions go (:func:`adaloss_jax._stream.analyse`).
      scaler: the :class:`~adaloss_jax.AdaptiveScale`.
      rounding: the points on a group's outputs (rounded when simulating a format).
      param_owners: the group of each floating parameter leaf.
      casts: the points on the wide side of a cast (:func:`adaloss_jax._record.mark_casts`):
        point -> the narrow dtype its cotangent is cast to.
    """

    def __init__(self, closed, plan: Plan, scaler, rounding: frozenset,
                 param_owners: Sequence[str], casts: dict | None = None):
        self.closed = closed
        self.casts = dict(casts or {})
        self.plan = plan
        self.scaler = scaler
        self.rounding = rounding
        self.param_owners = tuple(param_owners)
        # The conversion of each parameter leaf read at another scale than its own.
        self.param_pairs = []
        for owner, uses in zip(self.param_owners, plan.params):
            if isinstance(uses, Steps):
                own = Steps([(s,) for s in layers(owner, len(uses))])
                self.param_pairs.append(None if own == uses else (own, uses))
            else:
                self.param_pairs.append(None if uses in (None, (owner,)) else ((owner,), uses))
        self.columns = _channel.Columns.of(scaler)
        self.reader = _jaxpr.Reader()
        self._memo: dict[int, tuple[list[Site], Any]] = {}
        self.live = self._live() if scaler.same_step else _live.Live()

    def _live(self) -> _live.Live:
        """The regions that choose their scale in the backward pass (:mod:`_live`).

        A point's place is its position in the forward order of the top level (a
        nested ``jit``, ``checkpoint`` body or ``cond`` branch is in the scope around
        it, the branches in order: :meth:`_checkpoint`, :meth:`_switch`; the sites of
        one point in the order they are applied); points inside a ``shard_map`` of the
        loss have none (their backward pass runs per device), and a scan over a stack
        of layers, or over time at the top level, orders its body's points in a scope
        of their own (those of a scan or ``shard_map`` nested in a scan over time have
        none). A scan of one iteration that is no stack is its body run once
        (:meth:`_scan` evaluates it so): its points are in the scope around it."""
        every = [((s.n, s.pair), s.pair, s.cfg.convert) for s in self.sites()]
        top: list = []
        params_at: list = []
        scans: list = []
        conds: list = []  # (scope, position) of the top level's conds
        recurs: list = []  # the scans over time met at the top level

        def walk(jaxpr, scope: tuple, prefix: tuple, out: list) -> None:
            for i, eqn in enumerate(jaxpr.eqns):
                kind, at = self.reader.kind(eqn), prefix + (i,)
                if scope and scope[0] == "time" and kind in (_jaxpr.SCAN, _jaxpr.SHARD_MAP
                                                            ) and not self._once(eqn):
                    continue  # (inside a scan over time: its points have no place)
                if kind == _jaxpr.POINT:
                    out.extend(((s.n, s.pair), (scope, at + (j,)))  # (applied in turn)
                               for j, s in enumerate(self._point_sites(eqn)))
                elif kind == _jaxpr.PARAMS:
                    params_at.append((scope, at))
                elif kind in (_jaxpr.INLINE, _jaxpr.REMAT, _jaxpr.COND) or self._once(eqn):
                    if kind == _jaxpr.COND and scope == ():
                        conds.append((scope, at))
                    for b, sub in enumerate(_jaxpr.subprograms(eqn)):
                        walk(sub.jaxpr, scope, at + (b,), out)
                elif kind == _jaxpr.SCAN and id(eqn) in self.plan.scans:
                    body = _jaxpr.subprograms(eqn)[0].jaxpr
                    inner: list = []
                    walk(body, ("scan",), (), inner)  # (its own order: not compared)
                    keys = frozenset((s.n, s.pair) for s in self._sites_of(body))
                    scans.append(_live.Scan(
                        id(eqn), (scope, at), eqn.params["length"], eqn.params["reverse"],
                        keys, frozenset(k for k, (sc, _) in inner if sc == ("scan",)),
                        tuple(inner)))
                elif kind == _jaxpr.SCAN and scope == ():  # a scan over time
                    body = _jaxpr.subprograms(eqn)[0].jaxpr
                    inner = []
                    walk(body, ("time", len(recurs)), (), inner)
                    recurs.append(_live.Recur(
                        id(eqn), (scope, at),
                        frozenset((s.n, s.pair) for s in self._sites_of(body)), tuple(inner)))

        walk(self.closed.jaxpr, (), (), top)
        params_order = params_at[0] if len(params_at) == 1 else None
        return _live.analyse(every, top, self.param_pairs, params_order, self.plan.stacked,
                             scans, frozenset(conds), recurs, self.param_owners)

    def _once(self, eqn) -> bool:
        """Whether ``eqn`` is a scan of one iteration over no stack of layers (a
        one-layer ``nn.scan``, whose stacked parameters the plan reads as one group's)."""
        return (self.reader.kind(eqn) == _jaxpr.SCAN and eqn.params["length"] == 1
                and id(eqn) not in self.plan.scans)

    # ---------------------------------------------------------------- the rows

    def _point_sites(self, eqn) -> list[Site]:
        n = _jaxpr.point_number(eqn)
        pp = self.plan.points[n] if n < len(self.plan.points) else None
        if pp is None or pp.x is None:
            return []
        fmt = self.scaler.format
        rounds = self.scaler.simulate and n in self.rounding
        members: dict = {}
        for i, pair in enumerate(zip(pp.x, pp.y)):
            if pair[0] is not None:  # else computed from parameters alone, or read by
                # nothing that reaches the loss (its cotangent zero): passes as is
                members.setdefault(pair, []).append(i)
        sites = []
        if n in self.casts:  # on the wide side of a cast: measured before it narrows,
            # and converted from the loss's seed where the plan says (_stream.analyse):
            # then only what it converts to must fit the narrow dtype
            lim = float(jnp.finfo(self.casts[n]).max)
            sites = []
            for (xa, ya), idx in members.items():
                y_max = lim if xa == ya else min(
                    float(jnp.finfo(eqn.invars[i].aval.dtype).max) for i in idx)
                sites.append(Site(n, tuple(idx), (xa, ya), _channel.PointConfig(
                    self.columns, convert=xa != ya, measure=True, y_max=y_max, x_max=lim),
                    _channel.Row(ya, xa, y_max, lim, wide=True)))
            return sites
        for (xa, ya), idx in members.items():
            y_max = fmt.max
            if self.scaler.simulate:  # cotangents held in the compute dtype between groups
                y_max = min(float(jnp.finfo(eqn.invars[i].aval.dtype).max) for i in idx)
            x_max = fmt.max if rounds else y_max
            cfg = _channel.PointConfig(self.columns, convert=xa != ya, measure=True,
                                       y_max=y_max, x_max=x_max,
                                       simulate=fmt.dtype if rounds else None)
            sites.append(Site(n, tuple(idx), (xa, ya), cfg, _channel.Row(ya, xa, y_max, x_max)))
        return sites

    def _sites_of(self, jaxpr) -> list[Site]:
        key = id(jaxpr)
        if key not in self._memo:
            out: list[Site] = []
            for eqn in jaxpr.eqns:
                kind = self.reader.kind(eqn)
                if kind == _jaxpr.POINT:
                    out += self._point_sites(eqn)
                elif kind in (_jaxpr.INLINE, _jaxpr.REMAT):
                    for sub in _jaxpr.subprograms(eqn):
                        out += self._sites_of(sub.jaxpr)
                elif kind == _jaxpr.COND:  # (a branch's rows stay zero when not taken)
                    out += [s._replace(row=s.row._replace(branch=id(eqn)))
                            for sub in _jaxpr.subprograms(eqn)
                            for s in self._sites_of(sub.jaxpr)]
                elif kind in (_jaxpr.SCAN, _jaxpr.SHARD_MAP):  # a row per iteration, device
                    n = eqn.params["length"] if kind == _jaxpr.SCAN else _devices(eqn.params)
                    layers = id(eqn) in self.plan.scans
                    out += [s._replace(lead=(n, *s.lead), layer_axis=(
                                0 if layers and _varies(s.pair)
                                else None if s.layer_axis is None else s.layer_axis + 1))
                            for s in self._sites_of(_jaxpr.subprograms(eqn)[0].jaxpr)]
            self._memo[key] = (out, jaxpr)
        return self._memo[key][0]

    def sites(self) -> list[Site]:
        """Every row of the program, in the order :meth:`evaluate` takes their dummies."""
        return self._sites_of(self.closed.jaxpr)

    def dummies(self) -> list[jax.Array]:
        """The zero inputs :meth:`evaluate` takes for its statistics rows: their
        cotangents are the rows (one per site, a row per layer along a stacked axis)."""
        return [jnp.zeros((*s.lead, self.columns.width), jnp.float32) for s in self.sites()]

    def decode(self, rows: Sequence[jax.Array], used: GroupVector,
               planned: GroupVector | None = None, moved: dict | None = None) -> ScaleStats:
        """The rows of one backward pass (the cotangents of :meth:`dummies`) as per-group
        statistics, a stack's rows per layer; ``used``: the scale each group's gradients
        were computed at, ``planned``: the scales the plan set (they differ for the live
        regions; a fan-in's scale is the min of its anchors' planned ones), ``moved``:
        ``{anchor set: choice - plan}`` of the live fan-ins."""
        specs, values = [], []
        for r, s in zip(rows, self.sites()):
            axes = [a for a in range(len(s.lead)) if a != s.layer_axis]
            values.append(_channel.reduce_rows(r, axes))
            specs += ([s.row] if s.layer_axis is None else  # a row per layer
                      [s.row._replace(y=_stream.at(s.row.y, i), x=_stream.at(s.row.x, i))
                       for i in range(s.lead[s.layer_axis])])
        fmt = self.scaler.format
        return _channel.decode(specs, values, used, self.columns, fmt.max,
                               planned=planned if self.live.any else None,
                               fmt_min=fmt.min_subnormal, moved=moved)

    def pairs(self) -> list[tuple]:
        """Every ``(x anchors, y anchors)`` pair a conversion or a row refers to, sorted
        (every process of a multi-controller run must trace the same program)."""
        pairs = {s.pair for s in self.sites()}
        pairs |= {p for p in self.param_pairs if p is not None}
        return sorted(pairs, key=repr)

    # ---------------------------------------------------------------- evaluation

    def evaluate(self, args: Sequence, dummies: Sequence, ratios: dict, live=None) -> list:
        """The loss's flat outputs, with the points applied; ``dummies``: one per
        :meth:`sites` row; ``ratios``: ``{(x anchors, y anchors): S_x / S_y}``;
        ``live``: ``(sigma, {group: (limits, chosen)}, axes)`` for the live regions
        (:attr:`live`): the planned log2 scale of every anchor set, per live group
        its decider's limits and the zero input whose cotangent is its chosen scale's
        difference from the plan,
        and the mapped axes every decider takes its amax over."""
        ctx = None
        if live is not None and self.live.any:
            ctx = _LiveContext(*live, tokens={})
        return self._eval(self.closed.jaxpr, self.closed.consts, args, list(dummies), ratios,
                          ctx)

    def _eval(self, jaxpr, consts, args, dummies: list, ratios, live=None) -> list:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        taken = 0

        def take(jaxpr_or_eqn_sites: list) -> list:
            nonlocal taken
            block = dummies[taken:taken + len(jaxpr_or_eqn_sites)]
            taken += len(jaxpr_or_eqn_sites)
            return block

        run: list = []
        for eqn in jaxpr.eqns:
            kind = self.reader.kind(eqn)
            if kind in (_jaxpr.PLAIN, _jaxpr.OPAQUE):
                run.append(eqn)
                continue
            _eval_run(run, env, read)
            run = []
            ins = [read(v) for v in eqn.invars]
            if kind == _jaxpr.POINT:
                sites = self._point_sites(eqn)
                outs = self._apply_point(ins, sites, take(sites), ratios, live)
            elif kind == _jaxpr.PARAMS:
                outs = self._convert_params(ins, ratios, live)
            else:
                subs = _jaxpr.subprograms(eqn)
                blocks = [take(self._sites_of(s.jaxpr)) for s in subs]
                outs = self._higher_order(kind, eqn, ins, subs, blocks, ratios, live)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = x
        _eval_run(run, env, read)
        return [read(v) for v in jaxpr.outvars]

    def _apply_point(self, ins, sites, dummies, ratios, live=None) -> list:
        outs = list(ins)
        for site, dummy in zip(sites, dummies):
            cfg = site.cfg._replace(dummy_axes=_channel.varying_axes(dummy))
            xs = tuple(ins[i] for i in site.members)
            key = (site.n, site.pair)
            if live is not None and (key in self.live.needs or key in self.live.deciders):
                ys = self._live_point(live, key, site.pair, cfg, xs, dummy)
            else:
                ratio = ratios[site.pair] if site.cfg.convert else jnp.float32(1.0)
                ys = _channel.scale_point(cfg, xs, ratio, dummy)
            for i, y in zip(site.members, ys):
                outs[i] = y
        return outs

    def _live_point(self, live: _LiveContext, key, pair, cfg, xs, dummy) -> tuple:
        """A point on the border of live regions: it emits a token for each live
        group whose scale it needs, and the decider takes the tokens emitted for its
        group (all emitted before it: :mod:`adaloss_jax._live`)."""
        needs = self.live.needs.get(key, ())
        group = self.live.deciders.get(key)
        x, y = self.live.names.get(key) or (_live.region_key(a) for a in pair)
        follows = x == _live.FOLLOW  # a stream's way in: the layer's stream but at the first
        if follows:
            x = _live.CHAIN_X
        recurrent = group is not None and group in live.over_time
        before = self.live.ways_in.get(key)  # (there, a live region's before the scan)
        sc = self.scaler
        limits, chosen = (live.inputs[group] if group is not None
                          else (jnp.zeros((3,), jnp.float32), jnp.zeros((), jnp.float32)))
        taken = tuple(live.tokens.pop(group, ())) if group is not None else ()
        low, high = _channel.held_span(cfg.x_max, [x.dtype for x in xs])
        lcfg = _channel.LiveConfig(
            cfg, x_token=needs.index(x) if x in needs else None,
            y_token=needs.index(y) if y in needs else None, emits=len(needs),
            decides=group is not None, takes=len(taken),
            target=high - sc.margin, low=low,
            lo=math.log2(sc.min_loss_scale), hi=math.log2(sc.max_loss_scale), axes=live.axes,
            reserve=float(sc.max_rise),
            halfway=isinstance(group, tuple) or key in self.live.streams, follows=follows,
            first_token=needs.index(before) if before is not None else None,
            recurrent=recurrent)
        base = jnp.stack([jnp.asarray(live.sigma[a], jnp.float32) for a in pair]
                         + ([live.follows] if follows or recurrent else []))
        ys, emitted = _channel.live_point(lcfg, xs, base, limits, dummy, chosen, taken)
        for g, t in zip(needs, emitted):
            live.tokens.setdefault(g, []).append(t)
        return ys

    def _convert_params(self, ins, ratios, live=None) -> list:
        outs = list(ins)
        for i, pair in enumerate(self.param_pairs):
            if live is not None and pair is not None and _live.single(
                    pair[0]) in self.live.adopts:
                continue  # (its group's scale is the fan-in's choice: as computed)
            if live is not None and (_live.PARAMS_KEY, i) in self.live.needs:
                inf = float("inf")
                cfg = _channel.PointConfig(_channel.Columns(False, None), convert=True,
                                           measure=False, y_max=inf, x_max=inf)
                (outs[i],) = self._live_point(live, (_live.PARAMS_KEY, i), pair, cfg,
                                              (ins[i],), jnp.zeros((), jnp.float32))
            elif pair is not None:  # (a stack of layers: a ratio per slice)
                r = ratios[pair]
                outs[i] = _channel.convert_param(ins[i], r.reshape(r.shape + (1,) * (
                    ins[i].ndim - r.ndim)))
        return outs

    def _higher_order(self, kind, eqn, ins, subs, blocks, ratios, live=None) -> list:
        p = eqn.params

        if kind == _jaxpr.INLINE:  # (inlined: the same scope, its tokens too)
            sub = subs[0]
            return self._eval(sub.jaxpr, sub.consts, list(ins), blocks[0], ratios, live)
        if kind == _jaxpr.REMAT:
            return self._checkpoint(p, ins, subs[0], blocks[0], ratios, live)
        if kind == _jaxpr.COND:
            return self._switch(ins, subs, blocks, ratios, live)
        if kind == _jaxpr.SHARD_MAP:
            return self._shard_map(p, ins, subs[0], blocks[0], ratios)
        assert kind == _jaxpr.SCAN, kind
        return self._scan(eqn, ins, subs[0], blocks[0], ratios, live)

    def _checkpoint(self, p, ins, sub, block, ratios, live=None) -> list:
        """Rebuilt with the same policy. Its body is in the scope around it: the tokens
        emitted so far enter it as inputs (a decider inside takes them) and those it
        emits or leaves come out as outputs (a decider after it takes them), so each
        choice's cotangent crosses the checkpoint like any other."""
        remat = functools.partial(jax.checkpoint, prevent_cse=p["prevent_cse"],
                                  policy=p["policy"])
        if live is None:
            return remat(lambda *a: self._eval(sub.jaxpr, sub.consts, list(a), block,
                                               ratios))(*ins)
        shape_in, flat_in = _flatten(live.tokens)
        shape_out: list = []

        def body(args, flat):
            ctx = live._replace(tokens=_unflatten(flat, shape_in))
            outs = self._eval(sub.jaxpr, sub.consts, list(args), block, ratios, ctx)
            shape, flat_out = _flatten(ctx.tokens)
            shape_out[:] = shape
            return outs, flat_out

        outs, flat = remat(body)(list(ins), flat_in)
        live.tokens.clear()
        live.tokens.update(_unflatten(flat, shape_out))
        return outs

    def _switch(self, ins, subs, blocks, ratios, live=None) -> list:
        """Rebuilt as ``lax.switch``. Its branches are in the scope around it, as a
        checkpoint body is: the tokens emitted so far enter every branch, and each
        branch returns the tokens it emits or leaves, padded with zeros to the same
        tokens as every other branch (a choice read from a zero token, or made by a
        decider in a branch not taken, is no change from the plan on either side)."""
        if live is None:
            return jax.lax.switch(ins[0], [
                (lambda *a, sub=sub, block=block: self._eval(sub.jaxpr, sub.consts, list(a),
                                                             block, ratios))
                for sub, block in zip(subs, blocks)], *ins[1:])
        shape_in, flat_in = _flatten(live.tokens)

        def run(i, args, flat, found=None):
            ctx = live._replace(tokens=_unflatten(flat, shape_in))
            outs = self._eval(subs[i].jaxpr, subs[i].consts, list(args), blocks[i], ratios,
                              ctx)
            if found is not None:  # (traced once first: which tokens the branch returns)
                for g, ts in ctx.tokens.items():
                    found[g] = max(found.get(g, 0), len(ts))
            return outs, ctx.tokens

        union: dict = {}
        for i in range(len(subs)):
            jax.eval_shape(lambda a, f, i=i: run(i, a, f, union)[0], list(ins[1:]), flat_in)

        def branch(i):
            def padded(args, flat):
                outs, tokens = run(i, args, flat)
                zero = jnp.zeros((), jnp.float32)
                return outs, [t for g, n in union.items()
                              for t in (list(tokens.get(g, ())) + [zero] * n)[:n]]
            return padded

        outs, flat = jax.lax.switch(ins[0], [branch(i) for i in range(len(subs))],
                                    list(ins[1:]), flat_in)
        live.tokens.clear()
        live.tokens.update(_unflatten(flat, list(union.items())))
        return outs

    def _shard_map(self, p, ins, sub, block, ratios) -> list:
        """Rebuilt with the same specs; each row's dummy enters split over the devices
        (one row per device), so no transpose sums rows, whatever ``check_vma``."""
        axes = tuple(sorted(_manual_axes(p)))
        spec = jax.sharding.PartitionSpec(axes)
        mesh = p["mesh"]
        if any(str(mesh.axis_types[mesh.axis_names.index(a)]).endswith("Explicit")
               for a in axes):
            block = [jax.reshard(d, jax.sharding.NamedSharding(mesh, spec)) for d in block]
        n = len(ins)

        def body(*args):
            rows = [d[0] for d in args[n:]]
            return tuple(self._eval(sub.jaxpr, sub.consts, list(args[:n]), rows, ratios))

        return jax.shard_map(body, mesh=mesh, in_specs=(*p["in_specs"], *[spec] * len(block)),
                             out_specs=p["out_specs"], check_vma=p["check_vma"],
                             axis_names=set(axes))(*ins, *block)

    def _scan(self, eqn, ins, sub, block, ratios, live=None) -> list:
        """Rebuilt with the same length, direction and unrolling; over a stack of layers
        the ratios that vary by layer enter as scanned inputs, a value per layer. Where
        the body decides (``Live.layers``: regions inside a layer, or a
        :class:`~adaloss_jax._live.Chain`'s layers at their exits) the planned scales,
        limits and ``chosen`` inputs enter per layer too, and a chain's token of the
        layer executed next rides in the carry. A scan of one iteration over no stack
        (:meth:`_once`) is its body evaluated once, inline, in the scope around it."""
        p = eqn.params
        nc, ncar = p["num_consts"], p["num_carry"]
        consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        if live is not None and id(eqn) in self.live.recurs:
            return self._over_time(eqn, ins, sub, block, ratios, live)
        if self._once(eqn):  # the body once, in the scope around it (:meth:`_live`)
            outs = self._eval(sub.jaxpr, sub.consts, [*consts, *init, *(x[0] for x in xs)],
                              [d[0] for d in block], ratios, live)
            return [*outs[:ncar], *(jnp.asarray(y)[None] for y in outs[ncar:])]
        layered = []
        if id(eqn) in self.plan.scans:
            layered = sorted({s.pair for s in self._sites_of(sub.jaxpr) if _varies(s.pair)
                              and s.cfg.convert}, key=repr)
        chain = None if live is None else self.live.chains.get(id(eqn))
        groups = {} if live is None else self.live.layers.get(id(eqn), {})
        token = jnp.zeros((), jnp.float32)
        anchors, per_layer = [], ()
        if groups:  # a value per layer: the planned scales, limits and ``chosen`` inputs
            keys = {(s.n, s.pair) for s in self._sites_of(sub.jaxpr)}
            anchors = sorted({a for k in keys if k in self.live.names for a in k[1]
                              if isinstance(a, Steps)}, key=repr)
            per_layer = ([live.sigma[a] for a in anchors],
                         {name: (jnp.stack([live.inputs[g][0] for g in slots]),
                                 jnp.stack([live.inputs[g][1] for g in slots]))
                          for name, slots in groups.items()})
        tokens = []  # a chain's: the carried token of the layer executed next
        if chain is not None:
            tokens = [sum(live.tokens.pop(chain.slots[chain.first], []), token)]
        if groups:  # 0 at the layer executed first (a stream's way in there: the plan)
            per_layer += (jnp.arange(p["length"]) != (chain.first if chain else 0),)

        # a region before the scan deciding at the first layer's way in: its limits and
        # the tokens emitted for it enter every layer (their cotangents the first's)
        opened = {g: (live.inputs[g], live.tokens.pop(g, []))
                  for g in sorted({g for k, g in self.live.opens.items() if k in keys})
                  } if groups else {}

        def step(carry, x):
            (xs_i, rows_i, ratios_i, layer), carried = x, carry[ncar:]
            here = {**ratios, **dict(zip(layered, ratios_i))}
            ctx = None
            if groups:
                sigma_i, inputs_i, later = layer
                ctx = live._replace(sigma={**live.sigma, **dict(zip(anchors, sigma_i))},
                                    inputs={**inputs_i, **{g: v for g, (v, _) in opened.items()}},
                                    tokens={_live.CHAIN_X: carried,
                                            **{g: list(t) for g, (_, t) in opened.items()}},
                                    follows=later.astype(jnp.float32))
            outs = self._eval(sub.jaxpr, sub.consts, [*consts, *carry[:ncar], *xs_i],
                              list(rows_i), here, ctx)
            if chain is not None:
                carried = [sum(ctx.tokens.pop(_live.CHAIN_Y), jnp.zeros((), jnp.float32))]
            # a stream's ways in emit, at every layer, a token for the region before it
            ways = [sum(ctx.tokens.pop(g, []), jnp.zeros((), jnp.float32)) for g in before]
            return [*outs[:ncar], *carried], [*outs[ncar:], *ways]

        before = sorted({g for k, g in self.live.ways_in.items() if k in keys}, key=repr
                        ) if groups else []
        carry, ys = jax.lax.scan(
            step, [*init, *tokens], (list(xs), list(block), [ratios[q] for q in layered],
                                     per_layer),
            length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        if chain is not None and chain.last is not None:
            live.tokens.setdefault(chain.last, []).append(carry[ncar])
        for g, t in zip(before, ys[len(ys) - len(before):]):  # read at the first layer only
            live.tokens.setdefault(g, []).append(t[chain.first])
        return [*carry[:ncar], *ys[:len(ys) - len(before)]]

    def _over_time(self, eqn, ins, sub, block, ratios, live: _LiveContext) -> list:
        """A scan over time whose body decides (``Live.recurs``): each region deciding
        inside takes the token of its choice from the carry and carries on the one its
        decider emits (the tokens emitted for it before the scan the carry's first),
        its decider choosing at the iteration executed last (the first the backward pass
        runs: ``follows`` is 0 there) and reading the carried choice elsewhere; the
        tokens the body emits for regions deciding after the scan leave it stacked, a
        token per iteration, and their sum is the one their decider takes."""
        p = eqn.params
        nc, ncar, n = p["num_consts"], p["num_carry"], p["length"]
        consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
        inside, after = self.live.recurs[id(eqn)]
        zero = jnp.zeros((), jnp.float32)
        first = [sum(live.tokens.pop(g, []), zero) for g in inside]
        later = (jnp.arange(n) != (0 if p["reverse"] else n - 1)).astype(jnp.float32)

        def step(carry, x):
            xs_i, rows_i, follows = x
            ctx = live._replace(tokens={g: [t] for g, t in zip(inside, carry[ncar:])},
                                follows=follows, over_time=frozenset(inside))
            outs = self._eval(sub.jaxpr, sub.consts, [*consts, *carry[:ncar], *xs_i],
                              list(rows_i), ratios, ctx)
            carried = [sum(ctx.tokens.pop(g, []), zero) for g in inside]
            emitted = [sum(ctx.tokens.pop(g, []), zero) for g in after]
            assert not any(ctx.tokens.values()), ctx.tokens  # (the analysis's)
            return [*outs[:ncar], *carried], [*outs[ncar:], *emitted]

        carry, ys = jax.lax.scan(step, [*init, *first], (list(xs), list(block), later),
                                 length=n, reverse=p["reverse"], unroll=p["unroll"])
        for g, t in zip(after, ys[len(ys) - len(after):]):
            live.tokens.setdefault(g, []).append(jnp.sum(t))
        return [*carry[:ncar], *ys[:len(ys) - len(after)]]


class _LiveContext(NamedTuple):
    """What an evaluation carries for the live regions (the tokens: its scope's)."""

    sigma: dict  # anchor set -> planned log2 scale
    inputs: dict  # live group -> (limits, chosen)
    axes: tuple  # the optimizer's bound mapped axis: deciders agree over it
    tokens: dict  # live group -> the tokens emitted for it so far
    follows: Any = None  # in a stack's body: 0 at the layer executed first, else 1; in
    # a scan over time's: 0 at the iteration executed last, else 1
    over_time: frozenset = frozenset()  # the regions deciding in a scan over time's body


def _flatten(tokens: dict) -> tuple[list, list]:
    """Tokens by group as ``(shape, flat)``: ``(group, count)`` in order, and one list
    (:func:`_unflatten` undoes it)."""
    return ([(g, len(ts)) for g, ts in tokens.items()],
            [t for ts in tokens.values() for t in ts])


def _unflatten(flat: Sequence, shape: Sequence[tuple]) -> dict:
    """Tokens by group from their flat list: ``shape`` lists ``(group, count)`` in
    order."""
    tokens, at = {}, 0
    for g, n in shape:
        tokens[g], at = list(flat[at:at + n]), at + n
    return tokens


def _varies(pair) -> bool:
    """Whether a pair of anchors differs from layer to layer of a stack."""
    return any(isinstance(a, Steps) for a in pair)


def _manual_axes(params) -> frozenset:
    """The axes a ``shard_map`` equation maps by hand (its parameter
    ``newly_manual_axes``; ``manual_axes`` in jax releases before it)."""
    return frozenset(params.get("newly_manual_axes", params.get("manual_axes", ())))


def _devices(params) -> int:
    """How many devices a ``shard_map`` equation maps over."""
    shape = dict(zip(params["mesh"].axis_names, params["mesh"].axis_sizes))
    n = 1
    for a in _manual_axes(params):
        n *= shape[a]
    return n


def _eval_run(run: list, env: dict, read) -> None:
    """Evaluates consecutive equations without applied points, as ``jax.core.eval_jaxpr``
    does (so each keeps its source information and context)."""
    if not run:
        return
    defined, free = set(), {}
    for eqn in run:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal) and v not in defined:
                free.setdefault(v, None)
        defined.update(v for v in eqn.outvars if not isinstance(v, jcore.DropVar))
    outvars = [v for eqn in run for v in eqn.outvars if not isinstance(v, jcore.DropVar)]
    effects = set().union(*(eqn.effects for eqn in run))
    info = jcore.DebugInfo("adaloss_jax", "the recorded loss", tuple("" for _ in free),
                           tuple("" for _ in outvars))
    jaxpr = jcore.Jaxpr([], list(free), outvars, run, effects, info)
    for v, x in zip(outvars, jax.core.eval_jaxpr(jaxpr, [], *(read(v) for v in free))):
        env[v] = x


def anchor_scales(log2, pairs: Sequence[tuple], used) -> tuple[dict, dict]:
    """The log2 scale of every anchor set (the min over it) and the ratio ``S_x / S_y`` of
    every converting ``(x, y)`` pair, built once per step outside the model.
    ``log2[g]``: a group's log2 scale; ``used``: every group's, a
    :class:`~adaloss_jax._layout.GroupVector` (a stack's slots as one vector).

    Anchors that vary by layer (:class:`~adaloss_jax._stream.Steps`) get a vector over
    the layers, gathered from ``used`` at once (a gather and a min, whatever the depth).

    A set's min is computed once (:func:`~adaloss_jax._common.min_once`) from the
    largest smaller set already computed inside it and the groups it adds: along a
    residual stream the anchor sets grow by a block's groups per layer, so each layer's
    min has the same shape (compiled once) instead of a chain over every group below it.
    """
    layered = {a for pair in pairs for a in pair if isinstance(a, Steps)}
    plain = {a for pair in pairs for a in pair if not isinstance(a, Steps)}
    sigma: dict = {}
    for a in sorted(plain, key=len):
        if len(a) == 1:
            sigma[a] = log2[a[0]]
            continue
        inner = max((t for t in sigma if 1 < len(t) < len(a) and set(t) <= set(a)),
                    key=len, default=())
        sigma[a] = min_once(([sigma[inner]] if inner else [])
                            + [log2[g] for g in a if g not in inner])
    # S_x / S_y as a quotient of two powers of two: exact, and XLA computes a division
    # once, as its own small kernel, where it would copy ``pow2(sx - sy)`` into every
    # kernel that converts a cotangent; those kernels then differ only in the buffer they
    # read the ratio from, and identical kernels (one per layer) are compiled once.
    if layered:  # a value per layer
        flat = used.array
        for a in layered:
            width = max(len(x) for x in a)
            idx = [[used.index(state_group(g)) for g in x]
                   + [used.index(state_group(x[0]))] * (width - len(x)) for x in a]
            sigma[a] = jnp.min(flat[jnp.asarray(idx, jnp.int32)], axis=1)
    converted = dict.fromkeys(a for x, y in pairs if x != y for a in (x, y))
    scale = {a: _formats.pow2(sigma[a]) for a in converted}
    ratios = {(x, y): scale[x] / scale[y] for x, y in pairs if x != y}
    return sigma, ratios

