"""Same-step scales (``AdaptiveScale(same_step=True)``): which regions of the backward
stream choose their scale from the cotangent in hand, and who tells the others.

A module's region (anchors ``(g,)``, :mod:`adaloss_jax._stream`) is *live* when the
backward pass can set its scale where the cotangent enters it::

    entries of g  = the converting points with producer side (g,): its call's output
                    point, and a child's input point where the cotangent comes back
    decider of g  = the entry last in the forward order (first in the backward pass)
    border of g   = the other converting points with (g,) on a side (the other entries
                    included), and the parameter conversions into or out of (g,)
    live          = g is no root and no stack slot, and its decider and whole border sit
                    in one scope of the recorded program (its top level with nested jits
                    inlined, or one checkpoint body or cond branch), each met once (not
                    inside a scan or shard_map of the loss: there a point's backward
                    pass runs per iteration or device), the decider strictly after the
                    rest

So a module called twice is decided at its second call, whose backward pass runs first;
the first call's cotangent enters at that scale (an overflow there backs off as any).

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

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from adaloss_jax._state import split_slot
from adaloss_jax._stream import Steps
from adaloss_jax._tree import ROOT


class Live(NamedTuple):
    """The live regions of a program (static).

    Attributes:
      groups: the live groups, sorted.
      deciders: ``{site key: group}``, the point that chooses each group's scale.
      needs: ``{site key: groups}``: the live groups whose chosen scale the site's
        backward pass needs (a token each), for every site that needs one.
    """

    groups: tuple[str, ...] = ()
    deciders: dict = {}
    needs: dict = {}


PARAMS_KEY = "params"  # the key of parameter conversion ``i`` is ``(PARAMS_KEY, i)``


def single(anchors) -> str | None:
    """The group of a one-group anchor set (``None`` for a fan-in, or per-layer
    anchors)."""
    if not isinstance(anchors, Steps) and anchors is not None and len(anchors) == 1:
        return anchors[0]
    return None


def _per_layer(anchors) -> list[str]:
    """The groups of per-layer anchors (:class:`~adaloss_jax._stream.Steps`), else
    none."""
    return [g for a in anchors for g in a] if isinstance(anchors, Steps) else []


def analyse(every: Sequence[tuple], top: Sequence[tuple], params: Sequence,
            params_order: float, stacked: frozenset = frozenset()) -> Live:
    """The live regions.

    Args:
      every: ``(key, pair, convert)`` of every site occurrence of the program (a point
        met twice, in a jaxpr evaluated twice, is listed twice), ``pair`` its ``(x
        anchors, y anchors)``.
      top: ``(key, (scope, position))`` of the sites that may decide or receive a
        choice: ``scope`` the ``checkpoint`` body or ``cond`` branch they are evaluated
        in (``()``: the top level), ``position`` their place there in the forward
        order.
      params: per floating parameter leaf, ``None`` or the ``(own, uses)`` anchors its
        conversion goes between.
      params_order: the ``(scope, position)`` of the parameter point (``None``: none).
      stacked: the groups that get a scale per layer.
    """
    order = dict(top)
    counts = Counter(key for key, _, _ in every)
    entries: dict[str, list] = {}
    border: dict[str, list] = {}
    unfit: set[str] = set()  # met per layer
    for key, (x, y), convert in every:
        unfit.update(_per_layer(x) + _per_layer(y))
        if not convert:
            continue
        gx, gy = single(x), single(y)
        if gx is not None and gx != gy:
            entries.setdefault(gx, []).append(key)
        if gy is not None and gy != gx:
            border.setdefault(gy, []).append(key)
    for i, pair in enumerate(params):
        if pair is None:
            continue
        for side in pair:
            g = single(side)
            if g is not None:
                border.setdefault(g, []).append((PARAMS_KEY, i))
            unfit.update(_per_layer(side))
    if params_order is not None:
        order.update({(PARAMS_KEY, i): params_order for i in range(len(params))})
    counts.update({(PARAMS_KEY, i): 1 for i in range(len(params))})
    live: dict[str, tuple] = {}
    for g, keys in entries.items():
        if g == ROOT or g in unfit or g in stacked or split_slot(g) is not None:
            continue
        rest = keys + border.get(g, [])
        if not all(counts[k] == 1 and k in order for k in rest):
            continue
        d = max(keys, key=order.get)  # the last way in: the first the backward pass meets
        scope, at = order[d]
        if all(order[k][0] == scope and order[k][1] < at for k in rest if k != d):
            live[g] = d
    needs: dict = {}
    for key, (x, y), convert in every:
        if not convert or key not in order:
            continue
        want = [g for g in dict.fromkeys((single(x), single(y)))
                if g in live and live[g] != key]
        if want:
            needs[key] = tuple(want)
    for i, pair in enumerate(params):
        if pair is not None:
            want = [g for g in dict.fromkeys(map(single, pair)) if g in live]
            if want:
                needs[(PARAMS_KEY, i)] = tuple(want)
    groups = tuple(sorted(live))
    return Live(groups, {d: g for g, d in live.items()}, needs)
