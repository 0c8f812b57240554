"""Same-step scales (``same_step=True``, ``adaloss_jax._live``): which regions choose
their scale in the backward pass, the choice in closed form, exactness against fp32
under any prior scales, and agreement over devices."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import assert_fp32_trees_close
from flax import linen as nn
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_adaptive import CASES, _grads_through, _setup
from test_jax_transformations import (
    AROUND,
    FRONT_ENDS,
    INSIDE,
    PROPERTY,
    _around,
    build,
    unscaled_through_optimizer,
)
from test_scanned_stacks import _check_twin
from test_scanned_stacks import _losses as _stack_losses
from test_scanned_stacks import _params as _stack_params

import adaloss_jax as alj
from adaloss_jax import _live
from adaloss_jax._layout import Layer, layers
from adaloss_jax._stream import Steps

SLOW = pytest.mark.slow


# ------------------------------------------------------------------ the analysis


def _site(key, x, y):
    return (key, (x, y), x != y)


def _top(*keys, scope=()):
    """``(key, (scope, position))`` of sites in one scope, in forward order."""
    return [(k, (scope, (i,))) for i, k in enumerate(keys)]


def _at(i, scope=()):
    return (scope, (i,))


def test_a_chain_is_live_and_each_decider_needs_the_scale_it_arrives_at():
    # Backward order: head (b) first. a's output point converts from (b,) into (a,).
    every = [_site("a_in", ("a",), ("a",)), _site("a_out", ("a",), ("b",)),
             _site("b_in", ("b",), ("b",)), _site("b_out", ("b",), ("",))]
    live = _live.analyse(every, _top("a_in", "a_out", "b_in", "b_out"), [], _at(0))
    assert live.groups == ("a", "b")
    assert live.deciders == {"a_out": "a", "b_out": "b"}
    assert live.needs == {"a_out": ("b",)}  # its consumer side is b's region


@pytest.mark.parametrize("late", [False, True])
def test_a_region_whose_last_entry_is_in_a_branch_decides_in_every_branch(late):
    # b is called in both branches of a cond at position 1, and in the last branch
    # twice: before a nested cond, and in both of its branches. Its last entry (the
    # nested cond's last branch) decides, and so do the last entries of the outer
    # cond's first branch and of the nested cond's first branch: whichever runs. The
    # call before the nested cond is on the border of all of them. With a point on b's
    # border after its entry in the first branch (``late``), that branch cannot
    # decide there (its backward pass would need the choice first): it keeps the plan.
    out = lambda k: _site(k, ("b",), ("",))  # noqa: E731
    every = [_site("b_in", ("",), ("b",)), out("first"), out("before"), out("inner0"),
             out("inner1")]
    top = [("b_in", ((), (0,))), ("first", ((), (1, 0, 0))), ("before", ((), (1, 1, 0))),
           ("inner0", ((), (1, 1, 1, 0, 0))), ("inner1", ((), (1, 1, 1, 1, 0)))]
    if late:
        every.append(_site("late", ("",), ("b",)))
        top.append(("late", ((), (1, 0, 1))))
    conds = frozenset({((), (1,)), ((), (1, 1, 1))})
    live = _live.analyse(every, top, [], None, conds=conds)
    assert live.groups == ("b",)
    deciders = {"inner1": "b", "inner0": "b"} if late else {
        "inner1": "b", "inner0": "b", "first": "b"}
    assert live.deciders == deciders
    border = {"b_in", "before"} | ({"late", "first"} if late else set())
    assert live.needs == {k: ("b",) for k in border}
    # Without the conds (one scope, as before), only the last entry decides.
    live = _live.analyse(every, top, [], None)
    assert live.deciders == {"inner1": "b"}


def test_a_cond_nested_in_another_branch_than_the_last_entrys_decides_too():
    # b is called in the last branch of a cond at position 1, and in its first branch
    # only inside a nested cond, in both of that one's branches: the first branch's
    # last entry (the nested cond's last branch) decides, and so does the nested cond's
    # first branch.
    out = lambda k: _site(k, ("b",), ("",))  # noqa: E731
    every = [_site("b_in", ("",), ("b",)), out("inner0"), out("inner1"), out("last")]
    top = [("b_in", ((), (0,))), ("inner0", ((), (1, 0, 0, 0, 0))),
           ("inner1", ((), (1, 0, 0, 1, 0))), ("last", ((), (1, 1, 0)))]
    live = _live.analyse(every, top, [], None, conds=frozenset({((), (1,)), ((), (1, 0, 0))}))
    assert live.deciders == {"last": "b", "inner1": "b", "inner0": "b"}
    assert live.needs == {"b_in": ("b",)}


def test_a_cond_before_the_last_entry_adds_no_decider():
    # b is called in both branches of a cond at position 1, then once more in a cond at
    # position 3: that last entry decides alone. The first cond is not around it (its
    # branches ran before it): their calls are on the border, and get tokens.
    out = lambda k: _site(k, ("b",), ("",))  # noqa: E731
    every = [_site("b_in", ("",), ("b",)), out("early0"), out("early1"), out("last")]
    top = [("b_in", ((), (0,))), ("early0", ((), (1, 0, 0))), ("early1", ((), (1, 1, 0))),
           ("last", ((), (3, 0, 0)))]
    live = _live.analyse(every, top, [], None, conds=frozenset({((), (1,)), ((), (3,))}))
    assert live.deciders == {"last": "b"}
    assert live.needs == {k: ("b",) for k in ("b_in", "early0", "early1")}


def _time(*keys):
    """A scan over time (id 7) at position 1 whose body holds ``keys``, in that order."""
    return _live.Recur(7, _at(1), frozenset(keys), tuple(_top(*keys, scope=("time", 0))))


def test_a_scan_over_time_decides_inside_its_body_and_after_it():
    # e, before the scan, feeds the cell c. The cell's state (anchors (c, h)) is read
    # by the cell at the next step and by the head h after the scan. In the body: c's
    # input point (an entry of the state), c's output point (c's decider) and the
    # cell's output point into h (the state's last entry: its decider). After the scan:
    # h's output point, h's decider.
    state = ("c", "h")
    every = [_site("e_out", ("e",), ("c",)),   # before the scan: c's border
             _site("c_in", state, ("c",)),     # body
             _site("c_out", ("c",), state),    # body
             _site("h_in", state, ("h",)),     # body: h's border
             _site("h_out", ("h",), ("",))]    # after the scan
    top = [("e_out", _at(0)), ("h_out", _at(2))]
    recur = _time("c_in", "c_out", "h_in")
    live = _live.analyse(every, top, [], None, recurs=[recur])
    assert set(live.groups) == {"c", "e", "h"} and live.fanins == (state,)
    assert live.recurs == {7: (("c", state), ("h",))}
    assert live.deciders == {"e_out": "e", "h_out": "h", "c_out": "c", "h_in": state}
    assert live.needs == {
        "e_out": ("c",),             # into the carry, the first iteration's token
        "c_in": (state, "c"),        # (c, h)'s choice, and c's
        "c_out": (state, "c"),       # its consumer's, and its own: the carried choice
        "h_in": (state, "h"),        # its own (carried), and the head's: a token a step
    }
    # Without the scan (its points with no place), only e decides: as before.
    assert _live.analyse(every, top, [], None).groups == ("e",)


def test_a_scan_over_time_leaves_out_a_region_with_an_entry_or_a_late_border_outside():
    # c is read in the body and after the scan (an entry outside): it keeps the plan,
    # and so does what reads its choice alone. b's border lies after the scan: kept.
    every = [_site("c_in", ("",), ("c",)), _site("c_out", ("c",), ("",)),
             _site("c_again", ("c",), ("",)),
             _site("b_out", ("b",), ("",)), _site("b_late", ("",), ("b",))]
    top = [("c_in", _at(0)), ("c_again", _at(2)), ("b_late", _at(3))]
    live = _live.analyse(every, top, [], None, recurs=[_time("c_out", "b_out")])
    assert "c" not in live.groups and "b" not in live.groups
    # a border before the scan but met twice: kept too
    every = [_site("b_in", ("",), ("b",)), _site("b_out", ("b",), ("",))]
    live = _live.analyse(every + every[:1], [("b_in", _at(0))], [], None,
                         recurs=[_time("b_out")])
    assert live.groups == ()
    live = _live.analyse(every, [("b_in", _at(0))], [], None, recurs=[_time("b_out")])
    assert live.groups == ("b",) and live.needs == {"b_in": ("b",), "b_out": ("b",)}
    # a parameter of e's read in b's region: its conversion is on b's border, before
    # the scan (its token the carry's first) or after it (b kept)
    params = [(("e",), ("b",))]
    live = _live.analyse(every, [("b_in", _at(0))], params, _at(0), recurs=[_time("b_out")])
    assert live.groups == ("b",) and live.needs[("params", 0)] == ("b",)
    live = _live.analyse(every, [("b_in", _at(0))], params, _at(2), recurs=[_time("b_out")])
    assert live.groups == ()


def test_a_scan_over_time_carries_a_border_after_its_decider_to_the_next_step():
    # s (the state) is read by the cell's Dense d inside the step (d's input point, the
    # entry of s, its decider) and written back after it (d's output into s: its
    # border, after the decider): that point converts the cotangent the next step's
    # reading sent back, so it reads the choice from the carry.
    every = [_site("d_in", ("s",), ("d",)), _site("d_out", ("d",), ("s",))]
    live = _live.analyse(every, [], [], None, recurs=[_time("d_in", "d_out")])
    assert live.deciders == {"d_in": "s", "d_out": "d"}
    assert live.needs == {"d_in": ("d", "s"), "d_out": ("s", "d")}


def test_a_fan_in_is_an_anchor_set_of_several_groups_or_slots():
    slot = Layer("s", 1)
    assert _live.fan_in(("a", "b")) == ("a", "b") and _live.fan_in(("a", slot)) == ("a", slot)
    for no in [("a",), (slot,), (), None, Steps([("a",), ("b",)]),
               ("a", Layer("s", None))]:  # (a stacked group's own symbol is no slot)
        assert _live.fan_in(no) is None, no


def test_a_single_group_is_a_one_group_anchor_set_and_nothing_else():
    slot = Layer("s", 1)
    assert _live.single(("a",)) == "a" and _live.single((slot,)) == slot
    # (a one-layer stack's own anchors are per layer: Steps of one slice)
    for no in [("a", "b"), (), None, Steps([("a",)]), Steps([("a",), ("b",)])]:
        assert _live.single(no) is None, no


def test_anything_decides_where_a_group_or_a_fan_in_is_live():
    # whether anything decides in the backward pass: a live group, or a live fan-in alone
    assert _live.Live(groups=("a",)).any and _live.Live(fanins=(("a", "b"),)).any
    assert not _live.Live().any


def test_a_fan_in_decides_at_its_last_entry_and_its_other_exits_get_tokens():
    # q and k read one value (anchors (k, q)); their exits convert into it. k's input
    # point, last in the forward order, is the first the backward pass meets.
    every = [_site("q_in", ("k", "q"), ("q",)), _site("k_in", ("k", "q"), ("k",)),
             _site("q_out", ("q",), ("",)), _site("k_out", ("k",), ("",))]
    live = _live.analyse(every, _top("q_in", "k_in", "q_out", "k_out"), [], _at(0))
    assert set(live.groups) == {"q", "k"} and live.fanins == (("k", "q"),)
    assert live.deciders == {"q_out": "q", "k_out": "k", "k_in": ("k", "q")}
    assert live.needs == {"q_in": (("k", "q"), "q"), "k_in": ("k",)}


def test_a_group_whose_parameters_are_read_only_in_a_live_fan_in_adopts_its_choice():
    # a and b return raw parameters (Flax's DenseParams) that their parent reads where
    # their input is read: the fan-in (a, b), deciding at h's input. Neither has a
    # region of its own: each adopts the fan-in's choice, and its parameters'
    # conversions go (no token). h's parameter is read in h's own region.
    every = [_site("d_out", ("d",), ("a", "b")), _site("h_in", ("a", "b"), ("h",)),
             _site("h_out", ("h",), ("",))]
    top = _top("d_out", "h_in", "h_out")
    params = [(("a",), ("a", "b")), (("b",), ("a", "b")), (("b",), ("a", "b")), None]
    owners = ["a", "b", "b", "h"]
    live = _live.analyse(every, top, params, _at(0), owners=owners)
    assert live.fanins == (("a", "b"),) and live.deciders["h_in"] == ("a", "b")
    assert live.adopts == {"a": ("a", "b"), "b": ("a", "b")}
    assert not any(k[0] == "params" for k in live.needs)
    assert _live.analyse(every, top, params, _at(0)).adopts == {}  # (no owners given)
    # Not adopted: a group with a side of its own; one with a leaf read elsewhere (or
    # at its own scale, or nowhere: no conversion); the root; a fan-in that keeps the
    # plan (its entry met twice).
    alone = _live.analyse([*every, _site("a_x", ("a",), ("a", "b"))],
                          _top("d_out", "a_x", "h_in", "h_out"), params, _at(0),
                          owners=owners)
    assert ("a", "b") in alone.fanins and alone.adopts == {"b": ("a", "b")}
    inner = _live.analyse([*every, _site("a_in", ("a",), ("a",))], top, params, _at(0),
                          owners=owners)  # (a point inside a's region: a not live)
    assert "a" not in inner.groups and inner.adopts == {"b": ("a", "b")}
    for leaf in [(("b",), ("h",)), None]:
        mixed = _live.analyse(every, top, params[:2] + [leaf, None], _at(0), owners=owners)
        assert mixed.adopts == {"a": ("a", "b")}
    root = _live.analyse(every, top, [(("",), ("a", "b"))] + params[1:], _at(0),
                         owners=[""] + owners[1:])
    assert root.adopts == {"b": ("a", "b")}
    twice = _live.analyse(every + every[1:2], top, params, _at(0), owners=owners)
    assert ("a", "b") not in twice.fanins and twice.adopts == {}


def test_a_point_that_nothing_reads_is_no_site():
    """A point's output that no equation of its scope reads, nor the scope returns (a
    module reading its input's shape only), has a cotangent of zeros by construction:
    it does not reach the loss (:func:`_jaxpr.reaching`), in a scan's body too, so the
    plan passes it and the program gives it no site (no row counts it as a cotangent
    that arrived as zeros)."""
    from adaloss_jax import _jaxpr

    def point(n):
        def f(*v):
            return v
        f.__name__ = f"{_jaxpr.POINT_PREFIX}{n}"
        return jax.jit(f)

    def fn(x):
        a, unread = point(0)(x, x)
        def body(c, _):
            (_u,), (r,) = point(1)(c), point(2)(c)
            return r * 2.0, None
        return jax.lax.scan(body, a, None, length=2)[0]

    closed = jax.make_jaxpr(fn)(jnp.ones(3))
    reach = _jaxpr.reaching(closed.jaxpr, [0])
    found = {}

    def walk(j):
        for e in j.eqns:
            if _jaxpr.point_number(e) is not None:
                unread = {i for i, o in enumerate(e.outvars) if o not in reach}
                if unread:
                    found[_jaxpr.point_number(e)] = unread
            for sub in _jaxpr.subprograms(e):
                walk(sub.jaxpr)

    walk(closed.jaxpr)
    assert found == {0: {1}, 1: {0}}


def test_a_fan_ins_limits_combine_its_anchors_and_read_its_plan():
    """``[headroom, prior, planned]``: the most headroom any anchor learned, the lowest
    rule scale of those measured or overflowed (+inf while none is), and the planned
    scale, the min of the anchors' plans."""
    import dataclasses

    from adaloss_jax import _grad
    from adaloss_jax._layout import GroupVector

    params = {g: {"w": jnp.ones(2)} for g in ("a", "b", "c")}
    st = alj.adaptive_unscale(alj.adaptive(groups="module")).init(params)
    st = st.with_log2_scales({"a": 7, "b": 3, "c": 12})
    names = st.log2_scales.names
    vec = lambda d, fill: GroupVector(names, jnp.asarray(  # noqa: E731
        [d.get(g, fill) for g in names], jnp.float32))
    fresh = _grad._limits(st, ["a"], [("b", "c"), ("a", "c")])
    np.testing.assert_array_equal(fresh[("b", "c")], [0.0, np.inf, 3.0])
    st = dataclasses.replace(st, headroom=vec({"b": 2.0, "c": 4.5}, 0.0),
                             log2_amax=vec({"a": -3.0, "c": -5.0}, -np.inf))
    got = _grad._limits(st, ["a"], [("b", "c"), ("a", "c")])
    np.testing.assert_array_equal(got[("b", "c")], [5.0, 12.0, 3.0])  # (b unmeasured)
    np.testing.assert_array_equal(got[("a", "c")], [5.0, 7.0, 7.0])
    np.testing.assert_array_equal(got["a"], [0.0, 7.0, 7.0])


def test_a_fan_in_with_a_border_after_its_decider_or_a_stacked_anchor_keeps_the_plan():
    # The fan-in's entry read last in the forward order is not after the rest of its
    # border (a point met twice), or one of its groups gets a scale per layer.
    every = [_site("q_in", ("k", "q"), ("q",)), _site("k_in", ("k", "q"), ("k",)),
             _site("q_out", ("q",), ("",)), _site("k_out", ("k",), ("",))]
    twice = every + [_site("q_in", ("k", "q"), ("q",))]
    live = _live.analyse(twice, _top("q_in", "k_in", "q_out", "k_out"), [], _at(0))
    assert live.fanins == () and ("k", "q") not in live.deciders.values()
    live = _live.analyse(every, _top("q_in", "k_in", "q_out", "k_out"), [], _at(0),
                         stacked=frozenset({"q"}))
    assert live.fanins == ()


def test_a_fan_in_read_by_a_stacks_layer_outside_its_scan_decides_unless_met_per_layer():
    # A value read by ``h`` and, at a point before the scan, by the stack's first layer
    # (its slot s[0], which the stack's body names: ``stacked``): its fan-in decides at
    # its last entry as any. Where a whole stacked group reads it, or its anchor set is
    # also one layer's part of per-layer anchors, it keeps the plan.
    s0 = Layer("s", 0)
    f = ("h", s0)
    every = [_site("e_out", ("e",), f), _site("s_in", f, (s0,)), _site("h_in", f, ("h",)),
             _site("h_out", ("h",), ("",))]
    order = _top("e_out", "s_in", "h_in", "h_out")
    live = _live.analyse(every, order, [], _at(0), stacked=frozenset({"s", s0}))
    assert live.fanins == (f,) and live.deciders["h_in"] == f
    assert live.deciders["e_out"] == "e"
    assert live.needs == {"e_out": (f,), "s_in": (f,), "h_in": ("h",)}
    whole = ("h", "s")
    every = [(k, tuple(whole if a == f else a for a in pair), c) for k, pair, c in every]
    live = _live.analyse(every, order, [], _at(0), stacked=frozenset({"s"}))
    assert live.fanins == ()
    # read by two stacks' first layers alone (slots only), then met per layer besides
    f = (s0, Layer("t", 0))
    two = [_site("e_out", ("e",), f), _site("s_in", f, (s0,)), _site("t_in", f, (f[1],)),
           _site("t_out", (f[1],), ("",))]
    order = _top("e_out", "s_in", "t_in", "t_out")
    assert _live.analyse(two, order, [], _at(0)).fanins == (f,)
    per_layer = Steps([f, (Layer("s", 1),)])
    two.append(("layers", (per_layer, per_layer), False))
    assert _live.analyse(two, order + [("layers", _at(4))], [], _at(0)).fanins == ()


def _scan(keys, top=None, order=(), length=3, reverse=False, at=((), (2,))):
    keys = frozenset(keys)
    return _live.Scan(1, at, length, reverse, keys, keys if top is None else frozenset(top),
                      tuple(order))


_S = Steps([(Layer("s", 0),), (Layer("s", 1),), (Layer("s", 2),)])


@pytest.mark.parametrize("reverse", [False, True])
def test_a_stack_whose_exits_feed_the_next_layer_is_a_chain(reverse):
    # inp -> s[0] -> s[1] -> s[2] -> head, the stack's one converting point its exit.
    nxt = (Steps([(Layer("s", 1),), (Layer("s", 2),), ("head",)]) if not reverse
           else Steps([("head",), (Layer("s", 0),), (Layer("s", 1),)]))
    every = [_site("inp_out", ("inp",), _S[2 if reverse else 0]),
             ("exit", (_S, nxt), True),
             _site("head_out", ("head",), ("",))]
    live = _live.analyse(every, _top("inp_out", "head_out", scope=()), [], None,
                         scans=[_scan({"exit"}, reverse=reverse, at=((), (0, 5)))])
    (chain,) = live.chains.values()
    assert chain.slots == (Layer("s", 0), Layer("s", 1), Layer("s", 2))
    assert chain.first == (2 if reverse else 0) and chain.last == "head"
    assert live.deciders["exit"] == _live.CHAIN_X and live.needs["exit"] == (_live.CHAIN_Y,)
    assert live.needs["inp_out"] == ((_S[2 if reverse else 0])[0],)  # the first layer's
    assert set(live.groups) == {"inp", "head", Layer("s", 0), Layer("s", 1), Layer("s", 2)}


def test_a_chain_whose_output_two_modules_read_hands_its_final_token_to_their_fan_in():
    # inp -> s[0] -> s[1] -> s[2] -> the fan-in of heads a and b: the last layer's token
    # goes to that anchor set, which decides at its last entry after the scan.
    f = ("a", "b")
    every = [_site("inp_out", ("inp",), _S[0]),
             ("exit", (_S, Steps([(Layer("s", 1),), (Layer("s", 2),), f])), True),
             _site("a_in", f, ("a",)), _site("b_in", f, ("b",)),
             _site("a_out", ("a",), ("",)), _site("b_out", ("b",), ("",))]
    live = _live.analyse(every, _top("inp_out", "a_in", "b_in", "a_out", "b_out"), [], None,
                         scans=[_scan({"exit"}, at=((), (0, 5)))])
    (chain,) = live.chains.values()
    assert chain.last == f and live.fanins == (f,) and live.deciders["b_in"] == f
    assert live.needs["a_in"] == (f, "a")


@pytest.mark.parametrize("case", ["two converting points", "exit skips a layer",
                                  "named after the scan", "tied parameter",
                                  "converted into after the scan",
                                  "converted into from another scope",
                                  "converted into a later layer", "converted per layer",
                                  "way in met twice", "way in outside the scopes",
                                  "exit in a nested scope of the body", "exit from one region",
                                  "exit repeats a layer", "exit from the root"])
def test_a_stack_that_is_no_chain_keeps_the_plan(case):
    nxt = Steps([(Layer("s", 1),), (Layer("s", 2),), ("head",)])
    every = [_site("inp_out", ("inp",), (Layer("s", 0),)), ("exit", (_S, nxt), True)]
    keys, params, top = {"exit"}, [], _top("inp_out", "after")
    if case == "two converting points":
        inner = Steps([(s,) for s in layers("t", 3)])
        every.append(("inner", (_S, inner), True))
        keys.add("inner")
    elif case == "exit skips a layer":
        every[1] = ("exit", (_S, Steps([(Layer("s", 2),), (Layer("s", 2),), ("head",)])), True)
    elif case == "named after the scan":
        every.append(_site("after", (Layer("s", 2),), ("",)))
    elif case == "tied parameter":
        params = [((Layer("s", 1),), ("head",))]
    elif case in ("converted into after the scan", "converted into from another scope"):
        # a second conversion into the first layer, met once, but not earlier in the
        # scan's scope: after the scan in it, or before it in the scope of another scan
        every.append(_site("late", ("late",), (Layer("s", 0),)))
        top.append(("late", _at(2) if case.endswith("after the scan") else _at(0, (7,))))
    elif case == "converted into a later layer":  # before the scan, but not into the first
        every.append(_site("side", ("side",), (Layer("s", 1),)))
        top.append(("side", ((), (0, 1))))
    elif case == "converted per layer":  # into the first layer from no whole region
        every.append(_site("per", Steps([(t,) for t in layers("t", 3)]), (Layer("s", 0),)))
        top.append(("per", ((), (0, 1))))
    elif case == "way in met twice":
        every.append(every[0])
    elif case == "exit in a nested scope of the body":  # (not at its top level)
        scan = _scan(keys, top=(), at=((), (0, 5)))
    elif case == "exit from one region":  # (a module outside the stack, into it)
        every[1] = ("exit", (("m",), nxt), True)
    elif case in ("exit repeats a layer", "exit from the root"):
        first = _live.ROOT if case.endswith("root") else Layer("s", 1)
        x = Steps([(first,), (Layer("s", 1),), (Layer("s", 2),)])
        every[:2] = [_site("inp_out", ("inp",), x[0]), ("exit", (x, nxt), True)]
    else:
        assert case == "way in outside the scopes"  # (no site of a scope's top level:
        top = _top("after")  # nothing tells where it is met)
    if "nested" not in case:
        scan = _scan(keys, at=((), (0, 5)))
    live = _live.analyse(every, top, params, None, scans=[scan])
    assert not live.chains and not {Layer("s", 0), Layer("s", 1), Layer("s", 2)} & set(live.groups)


def test_a_point_from_every_layer_into_one_region_is_no_exit():
    # In a stack scanned in reverse, a body point converting each layer into one group's
    # region (a module outside the stack that every layer calls) relays no layer into
    # the next: the exit is found beside it; alone, a stream has none.
    nxt = Steps([("head",), (Layer("s", 0),), (Layer("s", 1),)])
    every = [("exit", (_S, nxt), True), ("shared", (_S, ("m",)), True)]
    scan = _scan({"exit", "shared"}, reverse=True, at=((), (0, 5)))
    counts = Counter(k for k, _, _ in every)
    assert _live._exits([scan], every, counts) == {"exit": (scan, 0)}
    fans = Steps([(Layer("s", i), Layer("u", i)) for i in range(3)])
    alone = [("shared", (fans, ("m",)), True)]
    assert _live._stream(_scan({"shared"}, reverse=True), alone, {}, [], counts) is None


def test_a_stack_whose_layers_read_a_fan_in_is_no_chain():
    # The same exit, relaying each layer into the next, where each layer's anchors are a
    # fan-in (s[i], u[i]): no chain (a chain's layer is one slot; a stream may take it).
    def chain(x):
        nxt = Steps([*x[1:], ("head",)])
        every = [_site("inp_out", ("inp",), x[0]), ("exit", (x, nxt), True)]
        return _live._chain(_scan({"exit"}, at=((), (0, 5))), every, dict(_top("inp_out")),
                            [], Counter(k for k, _, _ in every))

    assert chain(_S) is not None
    assert chain(Steps([(Layer("s", i), Layer("u", i)) for i in range(3)])) is None


@pytest.mark.parametrize("case", [None, "measured in the first", "first no chain",
                                  "first scanned after", "first in another scope"])
def test_a_chain_scanned_straight_into_another_passes_its_final_token_on(case):
    # inp -> s[0] -> s[1] -> s[2] -> t[0] -> t[1] -> t[2] -> head: the exit of the first
    # stack's last layer (in its body) is the second's one way in.
    t = Steps([(s,) for s in layers("t", 3)])
    into_t = Steps([(Layer("s", 1),), (Layer("s", 2),), (Layer("t", 0),)])
    every = [_site("inp_out", ("inp",), (Layer("s", 0),)), ("s_exit", (_S, into_t), True),
             ("t_exit", (t, Steps([(Layer("t", 1),), (Layer("t", 2),), ("head",)])), True),
             _site("head_out", ("head",), ("",))]
    s_keys = {"s_exit"}
    if case == "measured in the first":  # the next layer's input measured in its body
        every.insert(2, ("s_next", (into_t, into_t), False))
        s_keys.add("s_next")
    elif case == "first no chain":  # a later layer of the first read after both scans
        every.append(_site("after", (Layer("s", 2),), ("",)))
    s_at = {"first scanned after": ((), (3,)), "first in another scope": ((7,), (1,))}
    scans = [_live.Scan(1, s_at.get(case, ((), (1,))), 3, False, frozenset(s_keys),
                        frozenset(s_keys)),
             _live.Scan(2, ((), (2,)), 3, False, frozenset({"t_exit"}),
                        frozenset({"t_exit"}))]
    top = _top("inp_out", "s", "t", "head_out", "after")
    if case == "first in another scope":  # (with its way in: there it is a chain)
        top[0] = ("inp_out", ((7,), (0,)))
    live = _live.analyse(every, top, [], None, scans=scans)
    if case in s_at:  # (the first's exit is no way in: not before the second, in its scope)
        assert 2 not in live.chains and not set(layers("t", 3)) & set(live.groups)
        return
    if case == "first no chain":  # its exit converts at the plan: the second keeps it too
        assert not live.chains and not set(layers("t", 3)) & set(live.groups)
        return
    assert live.chains[1].last == Layer("t", 0) and live.chains[2].last == "head"
    assert set(layers("s", 3)) | set(layers("t", 3)) <= set(live.groups)


def test_regions_inside_a_layer_decide_as_one_symbol_per_stacked_group():
    # In the body: the residual stream (a fan-in of every layer) -> ln[i] -> fc[i] ->
    # the stream. ln and fc decide per layer; the stream keeps the plan.
    ln, fc = (Steps([(Layer(g, i),) for i in range(3)]) for g in ("ln", "fc"))
    stream = (*layers("fc", 3), *layers("ln", 3))
    every = [("ln_in", (stream, ln), True), ("ln_out", (ln, fc), True),
             ("fc_out", (fc, stream), True)]
    order = [(k, (("scan",), (i,))) for i, k in enumerate(("ln_in", "ln_out", "fc_out"))]
    live = _live.analyse(every, [], [], None, scans=[_scan({k for k, _, _ in every},
                                                          order=order)])
    assert live.layers == {1: {"fc[*]": (Layer("fc", 0), Layer("fc", 1), Layer("fc", 2)),
                               "ln[*]": (Layer("ln", 0), Layer("ln", 1), Layer("ln", 2))}}
    assert live.deciders == {"ln_out": "ln[*]", "fc_out": "fc[*]"}
    assert live.needs == {"ln_in": ("ln[*]",), "ln_out": ("fc[*]",)}
    assert live.names["ln_out"] == ("ln[*]", "fc[*]")
    # A layer's group named outside the body (its parameter converted there) keeps it.
    live = _live.analyse(every, [], [((Layer("fc", 1),), ("",))], None,
                         scans=[_scan({k for k, _, _ in every}, order=order)])
    assert live.layers == {1: {"ln[*]": (Layer("ln", 0), Layer("ln", 1), Layer("ln", 2))}}
    # Named outside only as one anchor of a fan-in (a point before the scan converting
    # into a value every layer reads): that region is the fan-in's, and fc still decides.
    outside = [*every, _site("before", ("inp",), (Layer("fc", 1), "head"))]
    live = _live.analyse(outside, [], [], None,
                         scans=[_scan({k for k, _, _ in every}, order=order)])
    assert set(live.layers[1]) == {"fc[*]", "ln[*]"}


def _stream_case(case=None, reverse=False):
    """A scanned block of 3 layers: ``emb`` -> [ln[i] -> fc[i], added to the stream] ->
    ``head``; each layer's stream is a fan-in of its readers from that layer on. In the
    body, in forward order: the block's way in (from ``emb`` at the first layer, the
    layer's own stream after), ln's and fc's points, the exit into the next layer's
    stream (after the last, into ``head``). After the scan: the head, then ``emb``
    read again (a tied output layer: ``emb`` decides there)."""
    run = [2, 1, 0] if reverse else [0, 1, 2]
    ln, fc = (Steps([(Layer(g, i),) for i in range(3)]) for g in ("ln", "fc"))
    sets = {i: tuple(sorted(["head", *(Layer(g, j) for g in ("fc", "ln")
                                       for j in run[run.index(i):])]))
            for i in range(3)}
    stream = Steps([sets[i] for i in range(3)])
    nxt = Steps([sets[run[run.index(i) + 1]] if i != run[-1] else ("head",)
                 for i in range(3)])
    way = Steps([("emb",) if i == run[0] else sets[i] for i in range(3)])
    body = [("way_in", (way, stream), True), ("ln_in", (stream, ln), True),
            ("ln_out", (ln, fc), True), ("fc_out", (fc, stream), True),
            ("exit", (stream, nxt), True), ("after", (nxt, nxt), False)]
    if case == "exit not last":  # the stream read again after its exit
        body.append(("late", (stream, Steps([(Layer("t", i),) for i in range(3)])), True))
    elif case == "two exits":
        body.append(("exit2", (stream, nxt), True))
    order = [(k, (("scan",), (i,))) for i, (k, _, _) in enumerate(body)]
    every = [*body, _site("head_out", ("head",), ("emb",)), _site("emb_out", ("emb",), ("",)),
             _site("loss", ("",), ("<seed>",))]
    params = []
    if case == "named outside":  # a later layer's stream read after the scan
        every.append(_site("skip", stream[run[1]], ("head",)))
    elif case == "parameter on it":
        params = [((Layer("fc", 1),), stream[run[1]])]
    elif case == "parameter elsewhere":  # (emb's read by the head: not on the stream)
        params = [(("emb",), ("head",))]
    elif case == "measured at the first layer":  # a point before the scan, converting
        every.append(("measure", (stream[run[0]], stream[run[0]]), False))  # nothing
    elif case == "measured at a later layer":
        every.append(("measure", (stream[run[1]], stream[run[1]]), False))
    keys = {k for k, _, _ in body}
    nested = {"exit"} if case == "exit nested" else set()  # (in a cond of the body)
    scan = _scan(keys, keys - nested, order=order, reverse=reverse, at=((), (0,)))
    top = _top("scan", "head_out", "emb_out", "loss")[1:]
    return _live.analyse(every, top, params, None, scans=[scan]), stream


@pytest.mark.parametrize("reverse", [False, True])
def test_a_stacks_stream_decides_at_each_layers_exit_and_its_way_in_at_the_first(reverse):
    live, stream = _stream_case(reverse=reverse)
    (chain,) = live.chains.values()
    assert chain.slots == tuple(stream) and chain.last == "head"
    assert chain.first == (2 if reverse else 0)
    assert live.streams == {"exit"} and set(stream) <= set(live.fanins)
    assert live.deciders["exit"] == _live.CHAIN_X and live.needs["exit"] == (_live.CHAIN_Y,)
    assert live.deciders["ln_out"] == "ln[*]" and live.deciders["fc_out"] == "fc[*]"
    assert live.layers[1][_live.CHAIN_X] == tuple(stream)
    # the way in: the layer's stream, and at the first layer emb, deciding after the scan
    assert live.names["way_in"] == (_live.FOLLOW, _live.CHAIN_X)
    assert live.needs["way_in"] == (_live.CHAIN_X, "emb") and live.ways_in == {"way_in": "emb"}
    assert live.needs["fc_out"] == (_live.CHAIN_X,) and live.needs["ln_in"] == (
        _live.CHAIN_X, "ln[*]")
    assert {"emb", "head", ""} <= set(live.groups)


@pytest.mark.parametrize("case", ["parameter elsewhere", "measured at the first layer"])
def test_a_parameter_converted_off_the_stream_leaves_it_deciding(case):
    # (and a point outside the body measuring the first layer's stream at its scale)
    live, stream = _stream_case(case)
    assert live.streams == {"exit"} and set(stream) <= set(live.fanins)


@pytest.mark.parametrize("case", ["exit not last", "two exits", "exit nested",
                                  "named outside",
                                  "parameter on it", "measured at a later layer"])
def test_a_stream_the_body_cannot_decide_keeps_the_plan(case):
    live, stream = _stream_case(case)
    assert not live.chains and not live.streams and not set(stream) & set(live.fanins)
    assert "way_in" not in live.needs or _live.CHAIN_X not in live.needs["way_in"]


@pytest.mark.parametrize("case", ["two entries at once", "border after the decider",
                                  "border nested", "border in another scope", "met twice",
                                  "per layer", "root", "stacked"])
def test_regions_the_backward_pass_cannot_decide_keep_the_plan(case):
    every = [_site("g_in", ("g",), ("g",)), _site("g_out", ("g",), ("",))]
    top = _top("g_in", "g_out")
    stacked = frozenset()
    if case == "two entries at once":  # two outputs of one call, to two regions
        every.append(_site("g_out2", ("g",), ("h",)))
        top.append(("g_out2", _at(1)))
    elif case == "border after the decider":
        every.append(_site("late", ("x", "y"), ("g",)))
        top.append(("late", _at(5)))
    elif case == "border nested":  # a border point inside a scan or shard_map
        every.append(_site("inner", ("x", "y"), ("g",)))
    elif case == "border in another scope":  # (a scan body's, where the decider is not)
        every.append(_site("inner", ("x", "y"), ("g",)))
        top.append(("inner", _at(0, scope=((7, 0),))))
    elif case == "met twice":  # the decider in a jaxpr evaluated twice
        every.append(_site("g_out", ("g",), ("",)))
    elif case == "per layer":
        every.append(_site("scan", Steps([("g",), ("h",)]), ("h",)))
    elif case == "root":
        every = [_site("r_out", ("",), ("h",))]
        top = _top("r_out")
    else:
        stacked = frozenset({"g"})
    assert _live.analyse(every, top, [], _at(0), stacked).groups == ()


def test_a_module_called_twice_is_decided_at_its_second_call():
    every = [_site("c1_out", ("g",), ("h",)), _site("c2_out", ("g",), ("",))]
    live = _live.analyse(every, _top("c1_out", "c2_out"), [], _at(0))
    assert live.deciders == {"c2_out": "g"}
    assert live.needs == {"c1_out": ("g",)}


def test_a_tied_parameter_conversion_is_a_border_point():
    every = [_site("e_out", ("e",), ("",))]
    top = [("e_out", _at(3))]
    live = _live.analyse(every, top, [None, (("e",), ("",))], params_order=_at(0))
    assert live.groups == ("e",)
    assert live.needs == {(_live.PARAMS_KEY, 1): ("e",)}
    # A parameter point evaluated after the decider, or in another scope, cannot get it.
    pairs = [None, (("e",), ("",))]
    assert _live.analyse(every, top, pairs, params_order=_at(9)).groups == ()
    assert _live.analyse(every, top, pairs, params_order=_at(0, ((1, 0),))).groups == ()
    assert _live.analyse(every, top, pairs, params_order=None).groups == ()


# ------------------------------------------------------------ the choice, in closed form


_d1 = alj.scale_group("d1")(lambda p, x: x @ p["w"])
_d2 = alj.scale_group("d2")(lambda p, x: x @ p["w"])
_W1 = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
_W2 = np.random.default_rng(1).normal(size=(6, 3)).astype(np.float32) * 2.0**-9
_C = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32) * 2.0**-13
_X = np.random.default_rng(3).normal(size=(5, 4)).astype(np.float32)


def _chain_loss(p, x, y=None):
    del y
    return jnp.sum(_d2(p["d2"], _d1(p["d1"], x)) * _C)


_Y = jnp.zeros(())  # (the shared step's label argument, unused here)


def _chain(log2=None, **options):
    params = {"d1": {"w": jnp.asarray(_W1)}, "d2": {"w": jnp.asarray(_W2)}}
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0, **options)
    step, state = _grads_through(scaler, _chain_loss, params, (jnp.asarray(_X),), log2)
    return params, step, state


def _target(a, margin=4):
    return math.floor(math.log2(65504.0) - margin - math.log2(a))


def _first(a, rows=_X.shape[0]):
    """A first choice (nothing measured inside the module yet): the target, less the
    binades of a sum over ``rows`` (``_grads_through`` sets ``max_rise``, which caps
    them, to 1000)."""
    return _target(a) - math.ceil(math.log2(rows))


def test_each_module_takes_the_scale_its_arriving_cotangent_calls_for():
    """d2's output cotangent is ``_C * 2**root``, d1's is ``_C @ W2.T`` at d2's chosen
    scale: each decider puts its own ``margin`` binades below fp16's max, whatever the
    prior scales (here far too low and far too high). Nothing was measured inside the
    modules yet, so each keeps ``ceil(log2 5)`` binades for its kernel gradient's sum
    over the 5 rows."""
    params, step, state = _chain({"": 3, "d1": -20, "d2": 30})
    got, new_state, stats = step(state, params, jnp.asarray(_X), _Y)
    s2 = _first(np.abs(_C).max())
    s1 = _first(np.abs(_C @ _W2.T).max())
    assert float(stats.log2_scales["d2"]) == s2
    assert float(stats.log2_scales["d1"]) == s1
    assert float(stats.log2_scales[""]) == 3.0
    assert bool(new_state[0].last_applied)
    assert_fp32_trees_close(got, jax.grad(_chain_loss)(params, jnp.asarray(_X)))


def test_the_choice_never_rises_above_the_rules_scale_once_measured():
    """A measured group's prior (its scale from the rule) caps the choice: it holds the
    growth inside the module seen so far, and a back-off after an overflow."""
    params, step, state = _chain()
    _, state, _ = step(state, params, jnp.asarray(_X), _Y)  # measured once
    ad = state[0]
    low = ad.with_log2_scales({"d1": 2, "d2": 5})
    _, _, stats = step((low, state[1]), params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == 2.0
    assert float(stats.log2_scales["d2"]) == 5.0
    # And learned headroom lowers it below what the cotangent calls for.
    roomy = ad.replace(headroom=alj.GroupVector(ad.groups, jnp.array([0.0, 0.0, 2.5])))
    _, _, stats = step((roomy, state[1]), params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d2"]) == min(_target(np.abs(_C).max()) - 3,
                                                 float(ad.log2_scales["d2"]))


def test_after_an_overflow_before_any_measurement_the_back_off_caps_the_choice():
    """A group whose first pass overflowed (inside the module: its parameter
    gradients) has no measured peak yet; its back-off still caps the choice, or the
    decider would choose the overflowing scale again on every pass."""
    params, step, state = _chain()
    ad = state[0].with_log2_scales({"d2": 5})
    flags = jnp.array([0, 0, 1], jnp.int32)
    ad = ad.replace(overflowed=alj.GroupVector(ad.groups, flags))
    assert float(ad.log2_amax["d2"]) == -math.inf
    _, _, stats = step((ad, state[1]), params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d2"]) == 5.0


SAME_STEP = alj.adaptive(groups="module", same_step=True, max_rise=1000, retries=0,
                         compute_dtype="float16")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("residual,remat", [(False, False), (True, False), (False, True)])
def test_a_scanned_stack_chooses_each_layers_scale_as_its_unrolled_twin(
        reverse, residual, remat):
    """A stack scanned as a chain (:class:`~adaloss_jax._live.Chain`: each layer's exit
    converts into the next layer) decides each layer at its exit from the cotangent in
    hand, the next layer's choice reaching it through the scan's carry: its scales,
    statistics and gradients are its unrolled twin's, whatever the prior scales, and
    unscale to fp32's; also where each layer adds its input back (the fan-in is inside
    the layer), and where each layer is under remat (its body in the scope around it,
    the tokens crossing the checkpoint as its inputs and outputs)."""
    _check_twin(3, residual, reverse, False, remat, [0, 3, -2, 9, 1, 5], SAME_STEP)


@SLOW
@PROPERTY
@given(depth=st.integers(2, 4), residual=st.booleans(), reverse=st.booleans(),
       remat=st.booleans(), data=st.data())
def test_a_scanned_stack_chooses_as_its_unrolled_twin_under_any_prior(depth, residual,
                                                                     reverse, remat, data):
    """The fixed cases above over depths, directions and priors drawn at random."""
    log2 = data.draw(st.lists(st.integers(-8, 15), min_size=depth + 3, max_size=depth + 3))
    _check_twin(depth, residual, reverse, False, remat, log2, SAME_STEP)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_stack_whose_every_output_is_read_keeps_the_plan_and_stays_exact(reverse):
    """Every layer's output also reaches the loss (stacked along the scan): no chain,
    so the stack keeps the plan, and its gradients are still exactly fp32's."""
    (tx, scanned), _, grad = _stack_losses(3, False, reverse, True, jnp.float32, False,
                                           SAME_STEP)
    p = _stack_params(3)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    state = tx.init(p).with_log2_scales({"stack[0]": 3, "stack[1]": -2, "stack[2]": 9})
    u, stats, _ = scanned(state, p, x)
    for i, want in enumerate((3, -2, 9)):
        assert float(stats.log2_scales[f"stack[{i}]"]) == want
    assert_fp32_trees_close(u, grad(p, x))


@pytest.mark.parametrize("remat", [False, True])
def test_a_chain_decides_every_layer_and_the_stacks_consumer(remat):
    """From the default initial scales, every layer of the chain and the head after it
    move to the scale their cotangents call for in the first step; also with each
    layer under remat."""
    (tx, scanned), _, _ = _stack_losses(3, False, False, False, jnp.float32, remat,
                                        SAME_STEP)
    p = _stack_params(3)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    state = tx.init(p)
    _, stats, _ = scanned(state, p, x)
    moved = {g for g in stats.log2_scales
             if float(stats.log2_scales[g]) != float(state.log2_scales[g])}
    assert moved >= {"stack[0]", "stack[1]", "stack[2]", "head"}, moved


_STACK_AROUND = {
    "none": lambda f: f,
    "jit": jax.jit,
    "remat": jax.checkpoint,
    "cond": lambda f: lambda p, x, y=None: jax.lax.cond(
        jnp.sum(x.astype(jnp.float32)) > -1e9, f, lambda p, x: 0.0 * f(p, x), p, x),
    "vmap": lambda f: lambda p, x, y=None: jnp.mean(jax.vmap(
        lambda xi: f(p, xi[None]))(x)),
}


@pytest.mark.parametrize("around", list(_STACK_AROUND))
def test_a_scanned_chain_decides_under_transformations_of_the_loss(around):
    """A chain under a transformation of the whole loss (its scan then inside a
    ``jit``, a ``checkpoint`` body, a ``cond`` branch or a ``vmap``): exact fp32
    gradients under any prior, and every layer decides. Inside a ``cond`` branch a stack
    gets no scale per layer yet (one scale for the stack, as before same-step)."""
    from test_scanned_stacks import _layer_fn

    dense = alj.scale_group("inp")(lambda w, x: x @ w["kernel"])
    head = alj.scale_group("head")(lambda w, x: x @ w["kernel"])
    stacked = alj.scale_group("stack")(_layer_fn(False))

    def loss(p, x):
        h = dense(p["inp"], x)
        h, _ = jax.lax.scan(lambda c, w: (stacked(w, c), None), h, p["stack"])
        return jnp.sum(head(p["head"], h) ** 2) * 2.0**-12

    wrapped = _STACK_AROUND[around](loss)
    p = _stack_params(3)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    step, state = _grads_through(SAME_STEP, lambda p, x, y=None: wrapped(p, x), p, (x,))
    prior = {"stack[0]": 5, "stack[1]": -3, "stack[2]": 9}
    state = (state[0].with_log2_scales(prior), state[1])
    got, _, stats = step(state, p, x, _Y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(wrapped))(p, x))
    if around == "cond":  # a stack inside a cond branch gets no slots (one scale)
        assert "stack[0]" not in stats.log2_scales
        return
    for g, s in prior.items():
        assert float(stats.log2_scales[g]) != s, (g, around)


def _exact_under_random_priors(loss, params, batch, seed, lo, hi, applied=True):
    """Two steps from per-group prior log2 scales drawn in ``[lo, hi)``: the unscaled
    gradients are fp32's (and each step applied, where ``applied``). Returns the step
    function and the last state it ran from."""
    ref = jax.jit(jax.grad(loss))(params, *batch)
    rng = np.random.default_rng(seed)
    step, state = _grads_through(SAME_STEP, loss, params, batch)
    ad = state[0]
    for _ in range(2):
        state = (ad.with_log2_scales({g: int(rng.integers(lo, hi)) for g in ad.log2_scales}),
                 state[1])
        got, new_state, _ = step(state, params, *batch, _Y)
        if applied:
            assert bool(new_state[0].base.last_applied)
        assert_fp32_trees_close(got, ref)
    return step, state


@functools.cache
def _gpt_twins():
    """The bench's byte GPT (3 pre-LN blocks, fp32) with its blocks unrolled and in one
    ``nn.scan``, with the same weights."""
    from adaloss_jax.bench._models import GPT

    kw = dict(layers=3, d_model=16, heads=2, context=8, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 256)
    unrolled, scanned = GPT(**kw), GPT(**kw, scan=True)
    pu = unrolled.init(jax.random.key(0), tokens[:, :-1])["params"]
    ps = {k: v for k, v in pu.items() if not k.startswith("block_")}
    ps["blocks"] = {"layer": jax.tree_util.tree_map(
        lambda *a: jnp.stack(a), *[pu[f"block_{i}"] for i in range(3)])}

    def loss(model):
        def fn(p, t, y=None):
            del y
            logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()
        return fn

    return (loss(unrolled), pu), (loss(scanned), ps), tokens


def test_a_scanned_transformer_decides_inside_each_block_as_its_unrolled_twin():
    """Regions inside one layer of a scanned stack (a block's attention and MLP
    sub-modules and norms, between the residual stream's fan-ins) decide in the scan's
    body, a scale per layer: the same scales as the unrolled blocks', whatever the
    prior scales, and exact fp32 gradients."""
    (lu, pu), (ls, ps), tokens = _gpt_twins()
    rng = np.random.default_rng(7)
    runs = {}
    for name, loss, p in (("unrolled", lu, pu), ("scanned", ls, ps)):
        step, state = _grads_through(SAME_STEP, loss, p, (tokens,))
        ad = state[0]
        prior = {g: int(rng.integers(-6, 7)) for g in ad.log2_scales}
        state = (ad.with_log2_scales(prior), state[1])
        got, _, stats = step(state, p, tokens, _Y)
        assert_fp32_trees_close(got, jax.jit(jax.grad(loss))(p, tokens))
        runs[name] = (stats, prior)
    (su, _), (ss, prior_s) = runs["unrolled"], runs["scanned"]
    inside = ("attn/qkv", "attn/proj", "mlp/fc1", "mlp/fc2", "ln1", "ln2")
    for i in range(3):
        for m in inside:
            a = float(ss.log2_scales[f"blocks/layer/{m}[{i}]"])
            b = float(su.log2_scales[f"block_{i}/{m}"])
            assert a == b, (m, i, a, b)
    moved = [g for g in prior_s if g.startswith("blocks/") and g.endswith("]")
             and float(ss.log2_scales[g]) != prior_s[g]]
    assert len(moved) == 3 * len(inside), moved  # every layer's every region decided
    # and the residual stream, a fan-in per layer, at each layer's exit; the final
    # LayerNorm after the stack and the root, which the first layer's way in reads
    live = alj._grad.trace(ls, SAME_STEP, ps, (tokens,), {})[1].live
    (stream,) = [c for c in live.chains.values() if isinstance(c.slots[0], tuple)]
    assert len(stream.slots) == 3 and set(stream.slots) <= set(live.fanins)
    assert stream.last == "ln_f" and "ln_f" in set(live.groups)


def test_a_scanned_gpts_root_decides_at_the_cast_and_its_embedding_sum_with_the_stream():
    """The scanned GPT with its logits cast through float16 into the loss: the root
    decides at that cast, after the stack. The sum of the token and position
    embeddings before the stack is no region of the root's (the root is no module: its
    position embedding, read there, anchors nothing): it is the first layer's stream,
    decided at that layer's exit, and the position embedding's conversion into the
    root's scale takes that choice from the carry's first token. Exact in fp32."""
    from adaloss_jax.bench._models import GPT

    _, (_, ps), tokens = _gpt_twins()
    model = GPT(layers=3, d_model=16, heads=2, context=8, dtype=jnp.float32, scan=True)

    def loss(p, t, y=None):
        del y
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float16)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), t[:, 1:]).mean()

    program = alj._grad.trace(loss, SAME_STEP, ps, (tokens,), {})[1]
    live = program.live
    assert "" in live.groups and not live.ways_in
    assert not any(_live.FOLLOW in n for n in live.names.values())
    (stream,) = live.chains.values()
    (pos,) = [i for i, pair in enumerate(program.param_pairs) if pair and pair[0] == ("",)]
    assert program.param_pairs[pos][1] == stream.slots[stream.first]
    assert live.needs[(_live.PARAMS_KEY, pos)] == ("", stream.slots[stream.first])
    # The rule's scales alone (same_step=False): the position embedding anchors its
    # region, as before, and the root's statistics hold it.
    delayed = dataclasses.replace(SAME_STEP, same_step=False)
    program = alj._grad.trace(loss, delayed, ps, (tokens,), {})[1]
    assert not any(pair and pair[0] == ("",) for pair in program.param_pairs)
    # A scan of one layer runs its body once, as the unrolled block: the embedding
    # converts into the fan-in of the block's norms and the final norm, whether the
    # loss casts through float16 (the root decides there) or not.
    one = GPT(layers=1, d_model=16, heads=2, context=8, dtype=jnp.float32, scan=True)
    p1 = one.init(jax.random.key(0), tokens[:, :-1])["params"]

    def loss1(p, t, y=None, cast=jnp.float16):
        return optax.softmax_cross_entropy_with_integer_labels(
            one.apply({"params": p}, t[:, :-1]).astype(cast).astype(jnp.float32),
            t[:, 1:]).mean()

    for cast in (jnp.float16, jnp.float32):
        program = alj._grad.trace(functools.partial(loss1, cast=cast), SAME_STEP, p1,
                                  (tokens,), {})[1]
        assert [pair[1] for pair in program.param_pairs if pair and pair[0] == ("",)] == [
            ("blocks/layer/ln1", "blocks/layer/ln2", "ln_f")]
        assert ("" in program.live.groups) == (cast == jnp.float16)
    _exact_under_random_priors(loss, ps, (tokens,), 5, -6, 7, applied=False)


class _ShiftedCells(nn.Module):
    """A module's own parameter added to the raw input, then three residual tanh cells
    in one ``nn.scan``, a Dense head after the module."""

    @nn.compact
    def __call__(self, x):
        class Cell(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return nn.tanh(nn.Dense(c.shape[-1])(c)) + c, None

        x = x + self.param("shift", nn.initializers.normal(1.0), (x.shape[-1],))
        x = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3)()(x, None)[0]
        return x


def test_a_region_opened_at_the_way_in_with_nothing_before_the_scan_to_tell():
    """The module's region (its parameter added to the input) is entered only at the
    first cell's way in, inside the scan's body, and nothing before the scan converts
    into it (the input is the data's): the way in decides it at the first layer with
    no token entering the scan for it, exact against fp32 under random priors."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(_ShiftedCells()(x))

    x = jax.random.normal(jax.random.key(1), (4, 8))
    labels = jnp.asarray([0, 1, 2, 3])
    model = Net()
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x, y=None):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (x,), {})
    assert list(program.live.opens.values()) == ["_ShiftedCells_0"]
    _exact_under_random_priors(loss, params, (x,), 3, -6, 12)


def test_a_scanned_gpt_in_a_parent_decides_its_embedding_sum_at_the_first_layers_way_in():
    """The scanned GPT inside a parent module: the sum of the token and position
    embeddings is the GPT module's region (its position embedding anchors it), and its
    one entry is the first block's input point inside the scan's body. That way in
    decides the region at the first layer, from the stream's cotangent arriving there;
    the token embedding's exit into it, before the scan, takes that choice by a token
    entering the scan. Exact in fp32 under any prior."""
    from adaloss_jax.bench._models import GPT

    _, (_, ps), tokens = _gpt_twins()
    model = _Parent(GPT(layers=3, d_model=16, heads=2, context=8, dtype=jnp.float32,
                        scan=True))
    params = {"inner": ps}

    def loss(p, t, y=None):
        del y
        logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    live = alj._grad.trace(loss, SAME_STEP, params, (tokens,), {})[1].live
    (way,) = live.opens
    assert live.opens[way] == live.deciders[way] == "inner" and not live.ways_in
    assert [k[1] for k, n in live.needs.items() if "inner" in n] == [
        (("inner/embed",), ("inner",))]
    _exact_under_random_priors(loss, params, (tokens,), 17, -6, 7)


class _Gated(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, _):
        g = nn.sigmoid(nn.Dense(8, dtype=self.dtype)(x))
        return g * x + (1 - g) * nn.Dense(8, dtype=self.dtype)(x), None


class _Highway(nn.Module):
    """Highway layers in one ``nn.scan`` (forward or reversed): each layer reads the
    stream three times, a fan-in per layer; the first layer's way in is the Dense
    before the scan, and the head after it is the stack's consumer."""

    reverse: bool = False
    shift: bool = False  # parameters of the model's own, added before the scan (and
    # multiplied after it, where ``gain``)
    remat: bool = False  # each layer under nn.remat
    gain: bool = True

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        if self.shift:  # (read in the sum before the scan)
            x = x + self.param("shift", nn.initializers.normal(1.0), (8,))
        layer = nn.remat(_Gated) if self.remat else _Gated
        stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=4, reverse=self.reverse)
        y = nn.Dense(3)(stack()(x, None)[0])
        if self.shift and self.gain:  # (and read again after the scan: the region
            # decides there)
            y = y * self.param("gain", nn.initializers.ones, (3,))
        return y


class _Parent(nn.Module):
    """A model inside another: its own parameters are a group of their own."""

    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.inner(x)


@pytest.mark.parametrize("reverse,shift,remat", [
    (False, None, False), (True, None, False), (True, "root", False), (True, "parent", False),
    (False, "parent", True), (False, "before", False), (True, "before", True)])
def test_a_scanned_stacks_stream_decides_at_each_layers_exit_and_stays_exact(reverse, shift,
                                                                              remat):
    """A stream every layer of a scanned stack reads and adds to decides a scale per
    layer at that layer's exit, from the cotangent arriving from the layer executed
    next (its choice in the carry); the way in before the scan and the consumer after
    it take the first and last layers' choices. A parameter of the root's added before
    the scan is read in the first layer's stream (the root is no module: its parameter
    converts from there); a parameter of a module around the stack makes that sum the
    module's region, and the way in sits in the body: the layer's own choice at every
    layer but the one executed first (the last slice of a reversed scan), the module's
    there. Where the module reads it again after the scan, its region decides there;
    where not (``before``), that way in is its last entry and decides it at the first
    layer, from the cotangent arriving there, for the tokens emitted before the scan
    (the Dense's exit into it). Under ``nn.remat`` each layer's points sit in a
    checkpoint inside the body. fp32 gradients exact under any prior."""
    model = _Highway(reverse, shift is not None, remat, gain=shift != "before")
    if shift in ("parent", "before"):
        model = _Parent(model)
    params = model.init(jax.random.key(0), _X[:, :4])["params"]

    def loss(p, x, y=None):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    x = jnp.asarray(_X[:, :4])
    live = alj._grad.trace(loss, SAME_STEP, params, (x,), {})[1].live
    (chain,) = live.chains.values()
    inner = "inner/" if shift in ("parent", "before") else ""
    assert len(chain.slots) == 4 and set(chain.slots) <= set(live.fanins)
    assert chain.first == (3 if reverse else 0) and chain.last == inner + "Dense_1"
    assert {inner + "Dense_0", inner + "Dense_1"} <= set(live.groups)
    assert len([g for g in live.groups if g.endswith("]")]) == 8  # 2 per layer
    assert bool(inner) == any(_live.FOLLOW in n for n in live.names.values())
    assert set(live.ways_in.values()) == ({"inner"} if shift == "parent" else set())
    assert set(live.opens.values()) == ({"inner"} if shift == "before" else set())
    if shift == "before":  # the Dense's exit into the sum takes its choice
        (way,) = live.opens
        assert live.deciders[way] == "inner" and "inner" in live.groups
        (exit_,) = [k for k, n in live.needs.items() if "inner" in n]
        assert exit_[1] == (("inner/Dense_0",), ("inner",))
    if shift == "root":  # the shift's conversion takes the first layer's choice
        (key,) = [k for k in live.needs if k[0] == _live.PARAMS_KEY]
        assert live.needs[key] == (chain.slots[chain.first],)
    _exact_under_random_priors(loss, params, (x,), 11, -8, 16)


class _OneLayerScan(nn.Module):
    """A Dense, one tanh layer in an ``nn.scan`` of length one, a Dense head."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        stack = nn.scan(_Tanh, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=1)
        return nn.Dense(3)(stack()(x, None)[0])


@pytest.mark.parametrize("around", ["jit", "remat", "vmap"])
@pytest.mark.parametrize("model", ["way in decides", "stacks back to back", "one layer"])
def test_a_way_in_deciding_and_stacks_back_to_back_hold_under_transformations(model,
                                                                            around):
    """The way in deciding the region before a stack (a parent's parameter added before
    the scan only), two stacks scanned straight one after the other, and a scan of one
    layer (its body run once, inline), with the loss under ``jit``, ``checkpoint`` or
    ``vmap``: the same analysis as untransformed, and fp32 gradients exact under any
    prior."""
    m = (_Parent(_Highway(False, True, gain=False)) if model == "way in decides"
         else _OneLayerScan() if model == "one layer"
         else _TwoStacks(("stream", "stream"), (False, True)))
    x = jnp.asarray(_X[:, :4])
    params = m.init(jax.random.key(0), x)["params"]
    loss = _STACK_AROUND[around](lambda p, x, y=None: jnp.mean(m.apply({"params": p}, x) ** 2))
    live = alj._grad.trace(loss, SAME_STEP, params, (x,), {})[1].live
    if model == "way in decides":
        assert set(live.opens.values()) == {"inner"} and "inner" in live.groups
    elif model == "one layer":  # (the scanned layer's Dense decides, as unrolled)
        assert [g for g in live.groups if g.startswith("Scan")] == ["Scan_Tanh_0/Dense_0"]
    else:
        first, second = sorted(live.chains.values(), key=lambda c: c.last == "Dense_1")
        assert second.last == "Dense_1" and first.last == second.slots[second.first]
    _exact_under_random_priors(loss, params, (x,), 29, -8, 16)


class _Tanh(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(8)(x)), None


class _ShiftedChain(nn.Module):
    """A chain of Dense layers in one ``nn.scan`` with a parameter of the root's added
    to its input: read in the first layer's region, which it does not anchor."""

    reverse: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x) + self.param("shift", nn.initializers.normal(1.0), (8,))
        stack = nn.scan(_Tanh, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=4, reverse=self.reverse)
        return nn.Dense(3)(stack()(x, None)[0])


@pytest.mark.parametrize("reverse", [False, True])
def test_a_root_parameter_before_a_scanned_chain_converts_from_its_first_layer(reverse):
    """The root's parameter is read in the region of the layer executed first (the last
    slice of a reversed scan): its conversion into the root's scale is a way into that
    layer before the scan, taking the layer's choice from the carry's first token, and
    the stack stays a chain whose every layer decides. fp32 gradients exact under any
    prior."""
    model = _ShiftedChain(reverse)
    x = jnp.asarray(_X[:, :4])
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x, y=None):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    program = alj._grad.trace(loss, SAME_STEP, params, (x,), {})[1]
    live = program.live
    (chain,) = live.chains.values()
    first = chain.slots[chain.first]
    assert first == Layer("Scan_Tanh_0/Dense_0", 3 if reverse else 0)
    assert set(chain.slots) <= set(live.groups) and chain.last == "Dense_1"
    (shift,) = [i for i, pair in enumerate(program.param_pairs) if pair]
    assert program.param_pairs[shift] == (("",), (first,))
    assert live.needs[(_live.PARAMS_KEY, shift)] == (first,)
    step, state = _exact_under_random_priors(loss, params, (x,), 13, -8, 16)
    # From scales far too low, every layer chooses its own in the pass.
    low = (state[0].with_log2_scales({g: -8 for g in state[0].log2_scales}), state[1])
    _, _, stats = step(low, params, x, _Y)
    assert all(float(stats.log2_scales[g]) > 0 for g in chain.slots)


class _RootShift(nn.Module):
    """Three Dense layers with a parameter of the root's added between the first two."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x)) + self.param("shift", nn.initializers.normal(1.0), (8,))
        h = jnp.tanh(nn.Dense(8)(h))
        return nn.Dense(4)(h)


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (under
# the shard_map: nothing decides, which the analysis is checked for)
@pytest.mark.parametrize("around", ["none", "shard_map_untyped"])
def test_a_root_parameter_read_where_nothing_decides_anchors_its_region(around):
    """The root's parameter is read in the region of the Dense after it. Where that
    region decides, the parameter converts from the root's scale into the region's
    choice; inside a ``shard_map`` of the loss nothing decides, so the parameter
    anchors the region again (the region's scale is then the root's, from the root's
    statistics, and nothing converts). fp32 gradients exact under any prior."""
    params, loss = _classified(_RootShift(), jnp.asarray(_X[:4, :3]), around)
    program = alj._grad.trace(loss, SAME_STEP, params, (jnp.asarray(_X[:4, :3]),), {})[1]
    order = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    shift = order.index("['shift']")
    if around == "none":
        assert "Dense_1" in program.live.groups
        assert program.param_pairs[shift] == (("",), ("Dense_1",))
        assert _live.reads_a_choice(program.live, shift, program.param_pairs[shift])
    else:
        assert not program.live.any
        assert program.param_pairs[shift] is None
    _exact_under_random_priors(loss, params, (jnp.asarray(_X[:4, :3]),), 17, -8, 16)


class _ReadsItsParts(nn.Module):
    """A scanned layer of two Dense layers that reads both their biases again in its own
    code, after their calls: that region is a fan-in of the two, per layer, so every
    parameter of the layer converts from its own slot into the layer's fan-in."""

    @nn.compact
    def __call__(self, x, _):
        first, second = nn.Dense(8), nn.Dense(8)
        h = jnp.tanh(second(jnp.tanh(first(x))))
        return h + first.variables["params"]["bias"] * second.variables["params"]["bias"], None


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (under
# the shard_map: nothing decides)
@pytest.mark.parametrize("around", ["none", "vmap", "remat", "cond", "shard_map_untyped"])
def test_a_stacked_parameter_read_in_its_layers_fan_in_converts_per_layer(around):
    """A stacked parameter read in a region that another group's parameters anchor too,
    in every layer of a scanned stack: its conversion names, layer by layer, its own
    slot and that layer's fan-in (a :class:`~adaloss_jax._stream.Steps` on both sides),
    and the gradients are exact against fp32 under random priors (a stacked parameter
    read at another scale than its own unscaled at its own is off by their ratio), with
    ``around`` around the whole model."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(_ReadsItsParts, variable_axes={"params": 0},
                            split_rngs={"params": True}, length=3)
            return nn.Dense(4)(stack()(nn.Dense(8)(x), None)[0])

    x = jnp.asarray(_X[:4, :3])
    params, loss = _classified(Model(), x, around)
    program = alj._grad.trace(loss, SAME_STEP, params, (x,), {})[1]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    names = ("Scan_ReadsItsParts_0/Dense_0", "Scan_ReadsItsParts_0/Dense_1")
    sliced = set(names) <= program.plan.stacked  # (else each Dense is one group: the
    # plan keeps a stack whole inside a cond or a shard_map)
    assert sliced == (around in ("none", "vmap", "remat"))
    fan_in = Steps([tuple(Layer(n, i) for n in names) for i in range(3)]) if sliced else names
    for dense in names:
        own = Steps([(s,) for s in layers(dense, 3)]) if sliced else (dense,)
        for leaf in ("bias", "kernel"):
            i = paths.index(f"['Scan_ReadsItsParts_0']['{dense.split('/')[1]}']['{leaf}']")
            assert program.param_pairs[i] == (own, fan_in)
    _exact_under_random_priors(loss, params, (x,), 19, -8, 16)


class _TwoStacks(nn.Module):
    """Two stacks scanned one after the other, nothing between them: the first's last
    layer exits straight into the second's first. Each a chain (tanh layers) or a
    stream (highway layers), forward or reversed."""

    kinds: tuple = ("chain", "chain")
    reverse: tuple = (False, False)
    read: bool = False  # every layer's output of the first stack read after it too
    # (:class:`_Outputs`)

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        outs = []
        for kind, reverse in zip(self.kinds, self.reverse):
            layer = _Tanh if kind == "chain" else _Gated
            if self.read and not outs:
                layer = _Outputs
            x, ys = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=3, reverse=reverse)()(x, None)
            outs.append(ys)
        y = nn.Dense(3)(x)
        return y + nn.Dense(3)(jnp.sum(outs[0], 0)) if self.read else y


class _Outputs(nn.Module):
    """A tanh layer that also outputs its result, doubled, stacked along the scan: its
    exit into the next layer is the one point of the body that relays, but the body
    converts into the stacked output too, so the stack is no chain."""

    @nn.compact
    def __call__(self, x, _):
        h = jnp.tanh(nn.Dense(8)(x))
        return h, 2.0 * h


@pytest.mark.parametrize("kinds,reverse", [
    (("chain", "chain"), (False, False)), (("stream", "stream"), (False, True)),
    (("chain", "stream"), (True, False)), (("stream", "chain"), (True, True)),
    ("read", (False, False))])
def test_a_stack_scanned_straight_into_another_hands_it_its_last_layers_token(kinds,
                                                                             reverse):
    """The first stack's exit at its last layer is the second's way in, inside the
    first scan's body: the second stack still decides per layer (it kept the plan), and
    the first's final token goes on to the second's first layer, whose choice the first
    stack's last layer converts into. Where every layer's output of the first stack is
    read after it too, that stack relays nothing, and the second, entered from a point
    at the plan, keeps the plan as well. fp32 gradients exact under any prior."""
    model = (_TwoStacks(("chain", "chain"), reverse, read=True) if kinds == "read"
             else _TwoStacks(kinds, reverse))
    x = jnp.asarray(_X[:, :4])
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x, y=None):
        return jnp.mean(model.apply({"params": p}, x) ** 2)

    live = alj._grad.trace(loss, SAME_STEP, params, (x,), {})[1].live
    if kinds == "read":  # the first stack relays nothing: the second keeps the plan too
        assert not live.chains
        _exact_under_random_priors(loss, params, (x,), 23, -8, 16)
        return
    first, second = sorted(live.chains.values(), key=lambda c: c.last == "Dense_1")
    assert len(live.chains) == 2 and first.last == second.slots[second.first]
    assert second.last == "Dense_1" and "Dense_1" in live.groups
    _exact_under_random_priors(loss, params, (x,), 19, -8, 16)


@functools.cache
def _compiled_text(depth: int, same_step: bool) -> str:
    """The optimized HLO of one jitted same-step (or delayed) step of a chain of
    ``depth`` fp16 modules, each a live region."""
    layers = [alj.scale_group(f"l{i}")(lambda p, x: jnp.tanh(x @ p["w"]))
              for i in range(depth)]

    def loss(p, x):
        for i, layer in enumerate(layers):
            x = layer(p[f"l{i}"], x)
        return jnp.sum(x.astype(jnp.float32))

    params = {f"l{i}": {"w": jnp.eye(4, dtype=jnp.float16)} for i in range(depth)}
    scaler = alj.adaptive(groups="module", same_step=same_step, retries=0)
    tx = optax.chain(alj.adaptive_unscale(scaler), optax.sgd(0.1))

    def step(state, p, x):
        value, grads, stats = alj.adaptive_value_and_grad(loss)(state, p, x)
        return tx.update(grads, state, p, loss=value, scale_stats=stats)

    x = jnp.ones((2, 4), jnp.float16)
    return jax.jit(step).lower(tx.init(params), params, x).compile().as_text()


def _hlo_size(depth: int, same_step: bool) -> int:
    return sum(" = " in line for line in _compiled_text(depth, same_step).splitlines())


def _distinct_kernels(depth: int, same_step: bool) -> int:
    """The distinct bodies among the fused kernels of :func:`_compiled_text` (names
    and metadata aside): what XLA's CPU backend compiles, each once."""
    blocks = {}
    for block in _compiled_text(depth, same_step).split("\n\n"):
        head, _, body = block.strip().partition("\n")
        blocks[head.split(" ")[0].lstrip("%")] = body
    called = re.findall(r"kind=\w+, calls=%?([\w.\-]+)", _compiled_text(depth, same_step))

    def canonical(body: str) -> str:
        body = re.sub(r", metadata=\{[^}]*\}", "", body)
        names: dict = {}
        return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"),
                      body)

    return len({canonical(blocks[c]) for c in called})


def test_a_chosen_scale_is_computed_once_not_copied_into_every_kernel_that_reads_it():
    """Each decider's choice depends on the choice of the region downstream (the scale
    its cotangent arrives at): were that scalar chain fused into every kernel that
    converts or unscales by it, the compiled program (and XLA's compile time) would grow
    with depth squared. Each choice is materialized once (a conditional: measured or
    planned), so a same-step step grows linearly with depth, by a bounded multiple of
    what each layer adds under the delayed rule."""
    same = [_hlo_size(d, True) for d in (6, 12, 18)]
    delayed = _hlo_size(12, False) - _hlo_size(6, False)
    assert same[2] - same[1] <= 1.1 * (same[1] - same[0]), same  # linear in depth
    assert same[1] - same[0] <= 2 * delayed, (same, delayed)


def test_each_live_region_adds_at_most_one_distinct_kernel_to_the_delayed_rules():
    """XLA's CPU backend compiles each distinct fused kernel body once, and a slice's
    index makes its body distinct: a group's value read out of a vector is a kernel of
    its own per group. Each decider reads its bounds (headroom, prior, plan) as one slice
    of one table, and the difference from the plan is its conditional's output, so no
    kernel downstream reads a group's slice: a live region adds at most one distinct
    kernel to what a module adds under the delayed rule."""
    same = _distinct_kernels(12, True) - _distinct_kernels(6, True)
    delayed = _distinct_kernels(12, False) - _distinct_kernels(6, False)
    assert same <= delayed + 6, (same, delayed)


def test_same_step_off_keeps_the_prior_scales():
    params = {"d1": {"w": jnp.asarray(_W1)}, "d2": {"w": jnp.asarray(_W2)}}
    scaler = alj.adaptive(groups="module", compute_dtype="float16", retries=0,
                          same_step=False)
    step, state = _grads_through(scaler, _chain_loss, params, (jnp.asarray(_X),),
                                 {"": 3, "d1": -20, "d2": 30})
    _, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == -20.0


# ------------------------------------------------------------- exact against fp32


@pytest.mark.parametrize("name", [n if n in ("mlp", "resnet") else pytest.param(n, marks=SLOW)
                                  for n in CASES])
def test_fp32_model_exact_under_same_step_scales(name):
    """Whatever the prior scales, the live regions' choices and the tokens that carry
    them leave the fp32 gradient unchanged (residuals, concat skips, tied embedding,
    reused block, q/k/v fan-in, recurrent cell, scanned stack)."""
    _, params, loss_fn, batch = _setup(name, jnp.float32)
    scaler = alj.adaptive(compute_dtype="float16", groups="module", same_step=True)
    groups = alj.param_groups(params, scaler)
    rng = np.random.default_rng(3)
    log2 = {g: int(rng.integers(-8, 16)) for g in groups}
    step, state = _grads_through(scaler, loss_fn, params, batch, log2)
    got, new_state, stats = step(state, params, *batch)
    _, program, _ = alj._grad.trace(loss_fn, scaler, params, batch, {})
    assert program.live.groups  # some regions chose their own scales
    assert any(float(stats.log2_scales[g]) != log2[g] for g in program.live.groups)
    # (and the fan-ins: residual streams, a concat skip, k and v from one input)
    assert bool(program.live.fanins) == (name in ("resnet", "unet_concat",
                                                   "gpt_tied_reused_attention"))
    assert bool(new_state[0].base.last_applied)
    assert_fp32_trees_close(got, jax.grad(loss_fn)(params, *batch))


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_a_checkpoint_or_jit_of_the_loss_decides_inside_and_stays_exact(wrap):
    """A checkpointed loss is one scope (its points and their tokens inside it); a
    nested jit is inlined: either way each module decides, in closed form."""
    params, _, _ = _chain()
    inner = lambda p, x: _chain_loss(p, x)  # noqa: E731
    fn = jax.checkpoint(inner) if wrap == "checkpoint" else jax.jit(inner)
    loss = lambda p, x, y=None: fn(p, x)  # noqa: E731
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (jnp.asarray(_X),), {})
    assert program.live.groups == ("d1", "d2")
    step, state = _grads_through(scaler, loss, params, (jnp.asarray(_X),),
                                 {"": 3, "d1": 5, "d2": 12})
    got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == _first(np.abs(_C @ _W2.T).max())
    assert_fp32_trees_close(got, jax.grad(_chain_loss)(params, jnp.asarray(_X)))


class _Lender(nn.Module):
    """Owns two parameters and reads one: the other is read by a sibling."""

    def setup(self):
        self.own = self.param("own", nn.initializers.normal(0.5), (6, 6))
        self.lent = self.param("lent", nn.initializers.normal(0.5), (6, 6))

    def __call__(self, x):
        return jnp.tanh(x @ self.own.astype(x.dtype))


class _Borrower(nn.Module):
    @nn.compact
    def __call__(self, x, w):
        b = self.param("b", nn.initializers.normal(0.1), (6,))
        return jnp.tanh(x @ w.astype(x.dtype) + b.astype(x.dtype))


class _Lending(nn.Module):
    @nn.compact
    def __call__(self, x):
        lender = _Lender()
        h = lender(x)
        return nn.Dense(3)(_Borrower()(h, lender.lent))


def test_a_parameter_read_by_another_module_is_converted_at_its_owners_choice():
    """A module's parameter read only by a sibling module (not by its owner) reaches the
    sibling's region at its owner's scale: when the owner's region chooses its scale in
    the backward pass, that parameter's conversion takes the choice by token, and the
    gradient stays exact in fp32 whatever the prior scales."""
    model = _Lending()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 6)), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def loss(p, x, y=None):
        return jnp.sum(model.apply({"params": p}, x) * jnp.arange(3.0))

    scaler = alj.adaptive(groups="module", compute_dtype="float16", retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (x,), {})
    lent = [i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(params))
            if "lent" in jax.tree_util.keystr(path)]
    # (the borrower's region reads parameters of both: a fan-in of the two, which
    # decides at its exit into the Dense)
    assert program.live.fanins == (("_Borrower_0", "_Lender_0"),)
    assert program.live.needs.get((_live.PARAMS_KEY, *lent)) == (
        "_Lender_0", ("_Borrower_0", "_Lender_0"))
    prior = {"": 2, "_Lender_0": -6, "_Borrower_0": 9, "Dense_0": 4}
    step, state = _grads_through(scaler, loss, params, (x,), {
        g: prior.get(g, 0) for g in alj.param_groups(params, scaler)})
    got, new_state, stats = step(state, params, x, jnp.zeros(()))
    assert bool(new_state[0].base.last_applied)
    assert float(stats.log2_scales["_Lender_0"]) != prior["_Lender_0"]  # chosen here
    assert_fp32_trees_close(got, jax.grad(loss)(params, x))


def test_a_scan_of_the_loss_decides_at_its_last_iteration_and_stays_exact():
    """Inside a scan a point's backward pass runs once per iteration, and a module's
    parameters are shared by them all: it decides at the iteration the backward pass
    runs first (the last), from the cotangent arriving there (here the largest: each
    iteration's loss weighs twice the one before), and every other iteration converts
    at that choice, carried to it; whatever the prior, the same choice and jax.grad's
    gradients."""
    params, _, _ = _chain()
    weights = 2.0 ** jnp.arange(-4.0, 1.0)

    def loss(p, x, y=None):
        def body(c, xw):
            xi, w = xw
            return c + _chain_loss(p, xi[None].repeat(5, 0)) * w / 5, None
        return jax.lax.scan(body, 0.0, (x, weights))[0]

    x = jnp.asarray(_X)
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (x,), {})
    assert program.live.groups == ("d1", "d2")
    for prior in ({"": 3, "d1": 5, "d2": 12}, {"": 3, "d1": -9, "d2": 1}):
        step, state = _grads_through(scaler, loss, params, (x,), prior)
        got, new_state, stats = step(state, params, x, _Y)
        assert_fp32_trees_close(got, jax.grad(loss)(params, x))
        # (each iteration's cotangent 1/5 of the chain's: the last one's choice)
        assert float(stats.log2_scales["d2"]) == _first(np.abs(_C).max() / 5)
        assert float(stats.log2_scales["d1"]) == _first(np.abs(_C @ _W2.T).max() / 5)
        assert bool(new_state[0].base.last_applied)


def test_a_scan_nested_in_a_scan_of_the_loss_keeps_the_plan_and_says_so():
    """A scan inside a scan over time: its points' backward pass runs per iteration of
    both, and nothing there decides (nor anywhere in this loss: a notice says so, once).
    The scales are the rule's, and the gradients stay exact."""
    params, _, _ = _chain()

    def loss(p, x, y=None):
        def inner(c, xi):
            return c + _chain_loss(p, xi[None].repeat(5, 0)) / 10, None

        def outer(c, xi):
            return c + jax.lax.scan(inner, 0.0, jnp.stack([xi, xi]))[0], None

        return jax.lax.scan(outer, 0.0, x)[0]

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (jnp.asarray(_X),), {})
    assert program.live.groups == ()
    step, state = _grads_through(scaler, loss, params, (jnp.asarray(_X),),
                                 {"": 3, "d1": 5, "d2": 12})
    alj._common._NOTICED.discard("same-step-none")
    with pytest.warns(UserWarning, match="no module's region of this loss can choose"):
        got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == 5.0
    assert_fp32_trees_close(got, jax.grad(loss)(params, jnp.asarray(_X)))


def test_a_weight_penalty_in_the_loss_is_named_and_only_aux_reads_change_nothing():
    """A loss that reads the parameters themselves (an L2 penalty) joins every module's
    interior with the loss's region: nothing decides in the pass, and the notice names
    the fix (the penalty in the optimizer). The same penalty returned in ``aux`` only
    (a metric) has a zero cotangent and changes no region (it made every module one
    region with one scale); the gradients stay exact either way."""
    params, _, _ = _chain()

    def penalty(p):
        return sum(jnp.sum(w ** 2) for w in jax.tree_util.tree_leaves(p))

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    x = jnp.asarray(_X)
    trace = lambda f: alj._grad.trace(f, scaler, params, (x,), {})[1].live.groups
    plain = trace(lambda p, x: _chain_loss(p, x))
    assert {"d1", "d2"} <= set(plain)
    assert trace(lambda p, x: (_chain_loss(p, x), penalty(p))) == plain
    in_loss = lambda p, x, y=None: _chain_loss(p, x) + 1e-3 * penalty(p)  # noqa: E731
    assert trace(in_loss) == ()
    step, state = _grads_through(scaler, in_loss, params, (x,), {"": 3, "d1": 5, "d2": 12})
    alj._common._NOTICED.discard("same-step-none")
    with pytest.warns(UserWarning, match=r"a penalty sum\(p \*\* 2\).*optax.adamw"):
        got, _, _ = step(state, params, x, _Y)
    assert_fp32_trees_close(got, jax.grad(in_loss)(params, x))


def test_a_scan_of_one_layer_runs_its_body_once_and_decides_as_its_unrolled_twin():
    """A GPT of one block in its ``nn.scan``: the plan reads the block's stacked
    parameters as one group's (no stack), and the scan runs its body once, so its
    points are in the scope around it: the same regions decide as in the unrolled
    block (they kept the plan), and the gradients are fp32's under any prior."""
    from adaloss_jax.bench._models import GPT

    kw = dict(layers=1, d_model=16, heads=2, context=8, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 256)
    live = {}
    for scan in (False, True):
        model = GPT(**kw, scan=scan)
        params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

        def loss(p, t, y=None, model=model):
            logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

        _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (tokens,), {})
        name = lambda g: g.replace("blocks/layer", "block_0")  # noqa: E731
        live[scan] = ({name(g) for g in program.live.groups},
                      {tuple(map(name, f)) for f in program.live.fanins})
        if scan:
            _exact_under_random_priors(loss, params, (tokens,), 5, -6, 12)
    assert live[True] == live[False]
    assert "block_0/attn/qkv" in live[True][0] and live[True][1]


def _classified(model, x, around="none"):
    """``model``'s parameters for ``x``, and the cross-entropy of its four logits per
    example (``x``: four examples) against the labels 0-3, with ``around`` (a
    ``test_jax_transformations`` wrapper) around the whole model."""
    labels = jnp.asarray([0, 1, 2, 3])
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, x, y=None):
        logits = _around(around, lambda v: model.apply({"params": p}, v))(x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels).mean()

    return params, loss


class _Recurrent(nn.Module):
    """A Dense per time step, Flax's ``nn.RNN`` over time (a GRU cell under
    ``nn.remat``, or an LSTM cell, whose carry is a pair, or an ``OptimizedLSTMCell``,
    ``olstm``, whose gates are ``DenseParams``), a Dense head on the last step."""

    cell: str
    reverse: bool = False
    every_step: bool = False  # the head reads every step's output (their mean)
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=self.dtype)(x)
        cell = (nn.remat(nn.GRUCell)(8, dtype=self.dtype) if self.cell == "gru"
                else nn.OptimizedLSTMCell(8, dtype=self.dtype) if self.cell == "olstm"
                else nn.LSTMCell(8, dtype=self.dtype))
        h = nn.RNN(cell, reverse=self.reverse, keep_order=True)(x)
        return nn.Dense(4, dtype=self.dtype)(
            h.mean(1) if self.every_step else h[:, 0 if self.reverse else -1])


@pytest.mark.parametrize("cell,steps,reverse,every_step", [
    ("gru", 5, False, False), ("lstm", 5, False, False), ("gru", 1, False, False),
    ("gru", 5, True, False), ("lstm", 5, False, True)])
def test_an_rnn_over_time_decides_in_its_scan_and_stays_exact(cell, steps, reverse,
                                                             every_step):
    """Flax's ``nn.RNN``: a scan over time whose every step reads the cell's parameters
    (one scale for all steps, their gradients summed over them). Every region decides:
    the cell's (its Dense layers, its input's and its state's fan-ins) at the time step
    the backward pass runs first, carrying the choice to the others; the head after
    the scan, its border inside the body reading its choice from a token per step; the
    Dense before the scan, whose border is the cell's input. Each chooses the same
    scale whatever the prior, and the gradients are fp32's under any prior, a
    checkpoint in the scan's body included, read backwards over time too, and with the
    head reading every step. Over one step the scan is its body run once."""
    x = jax.random.normal(jax.random.key(1), (4, steps, 3))
    params, loss = _classified(_Recurrent(cell, reverse, every_step), x)
    _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (x,), {})
    groups = alj.param_groups(params, SAME_STEP)
    cell_groups = {g for g in groups if "Cell" in g}
    assert cell_groups
    assert set(program.live.groups) == cell_groups | {"Dense_0", "Dense_1"}
    # (the cell's input and its state; an LSTM's state read by the head and the next
    # step, and by the next step alone)
    assert len(program.live.fanins) == (3 if cell == "lstm" else 2)
    chose, priors = [], []
    for seed in (7, 8):
        step, state = _exact_under_random_priors(loss, params, (x,), seed, -6, 12)
        _, _, stats = step(state, params, x, _Y)
        chose.append({g: float(stats.log2_scales[g]) for g in program.live.groups})
        priors.append({g: float(state[0].log2_scales[g]) for g in program.live.groups})
    # (over one step the hidden state is zeros: the reset gate's Dense layers receive
    # zeros, and keep their plan)
    kept = {g for g in program.live.groups if all(c[g] == p[g] for c, p in zip(chose, priors))}
    assert kept == (set() if steps > 1 else {g for g in cell_groups if g[-2:] in ("ir", "hr")})
    for g in set(program.live.groups) - kept:  # from the cotangent in hand, not the prior
        assert chose[0][g] == chose[1][g], g


class _RecurrentIntoStack(nn.Module):
    """A Dense per time step, Flax's ``nn.RNN`` of a GRU cell added to its input, then
    two residual tanh cells in one ``nn.scan`` and a Dense head on the last step: the
    GRU's state and its input are read by the stack's layers too, so their fan-ins
    hold the stack's slots."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        x = x + nn.RNN(nn.GRUCell(8))(x)
        x = nn.scan(_ResidualTanh, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=2)()(x, None)[0]
        return nn.Dense(4)(x[:, -1])


class _ResidualTanh(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jnp.tanh(nn.Dense(x.shape[-1])(x)) + x, None


def test_an_rnn_before_a_scanned_stack_decides_the_fan_ins_holding_its_slots():
    """A GRU over time before a residual stack in one ``nn.scan``: the GRU's input and
    its state are read by the stack's layers too (their anchor sets hold the stack's
    slots, at points outside its scan). Both fan-ins decide in the pass (the state's
    at the time step the backward pass runs first, the input's after the scan over
    time), and the gradients are fp32's under any prior. (Holding a slot, they kept the
    plan, and in e4m3 the gates reached only through the state starved at step 0:
    ``test_live_warmup.py``.)"""
    x = jax.random.normal(jax.random.key(1), (4, 5, 3))
    params, loss = _classified(_RecurrentIntoStack(), x)
    _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (x,), {})
    holding = [f for f in program.live.fanins if _slot_held(f)
               and not any(f in by_name.values() for by_name in program.live.layers.values())
               and not any(f in c.slots for c in program.live.chains.values())]
    assert len(holding) == 2, program.live.fanins
    (inside, after), = program.live.recurs.values()
    assert len([f for f in holding if f in inside]) == 1 and len(after) == 1
    _exact_under_random_priors(loss, params, (x,), 7, -6, 12)  # (two random priors)


class _StackIntoTwo(nn.Module):
    """A Dense layer, three tanh cells in one ``nn.scan`` (a chain, or with residuals a
    stream), and two Dense heads reading the stack's output (a fan-in)."""

    residual: bool

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)
        h = nn.scan(_ResidualTanh if self.residual else _Tanh, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=3)()(x, None)[0]
        return nn.Dense(4)(h) + nn.Dense(4)(jnp.tanh(h))


@pytest.mark.parametrize("residual", [False, True])
def test_a_stack_read_by_two_modules_hands_its_last_token_to_their_fan_in(residual):
    """A scanned chain, or stream, whose output two heads read: its last layer's token
    goes to their fan-in, which decides after the scan, and the gradients are fp32's
    under any prior. (Its consumer no one group, the token went nowhere and the fan-in
    kept the plan: after a stream, a frozen branch refused steps 0-1 in e4m3 at
    x 2^-12, ``test_live_warmup.py``.)"""
    x = jax.random.normal(jax.random.key(1), (4, 3))
    params, loss = _classified(_StackIntoTwo(residual), x)
    _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (x,), {})
    (chain,) = program.live.chains.values()
    assert isinstance(chain.last, tuple) and chain.last in program.live.fanins
    assert (chain.decider in program.live.streams) == residual
    _exact_under_random_priors(loss, params, (x,), 7, -6, 12)  # (two random priors)


@pytest.mark.parametrize("model,around", [
    ("rnn into stack", "vmap"), ("rnn into stack", "remat"), ("stream into two", "jit"),
    ("chain into two", "vmap"),
    *(pytest.param(m, a, marks=SLOW) for m, a in [
        ("rnn into stack", "jit"), ("rnn into stack", "cond"), ("chain into two", "cond"),
        ("stream into two", "remat")])])
def test_fan_ins_holding_a_stacks_slot_or_its_last_token_hold_under_transformations(
        model, around):
    """The two fan-ins next to a scanned stack (a GRU's state and input read by the
    stack's layers, holding its slots; a chain's or stream's output read by two heads,
    taking the stack's last token) with ``vmap`` (per example), ``checkpoint`` or
    ``jit`` around the whole model: the same regions and fan-ins decide as without, and
    the gradients are fp32's under any prior. Under a ``cond`` (the model in both
    branches: the stack and the scan over time there get no slots, and keep the plan
    where they would need them) the gradients are fp32's too."""
    net = (_RecurrentIntoStack() if model == "rnn into stack"
           else _StackIntoTwo(model.startswith("stream")))
    x = jax.random.normal(jax.random.key(1), (4, 5, 3) if model.startswith("rnn") else (4, 3))
    params, loss = _classified(net, x, around)
    if around != "cond":
        live = alj._grad.trace(loss, SAME_STEP, params, (x,), {})[1].live
        plain = alj._grad.trace(_classified(net, x)[1], SAME_STEP, params, (x,), {})[1].live
        assert set(live.groups) == set(plain.groups)
        assert set(live.fanins) == set(plain.fanins)
        decided = {d for d in live.deciders.values() if isinstance(d, tuple)}
        assert decided == {d for d in plain.deciders.values() if isinstance(d, tuple)}
        if model == "rnn into stack":  # (the state's and the input's)
            assert len([f for f in decided if _slot_held(f)]) == 2, decided
        else:
            (chain,) = live.chains.values()
            assert chain.last in decided
    _exact_under_random_priors(loss, params, (x,), 17, -6, 12)


def _slot_held(anchors):
    """Whether a fan-in's anchor set holds a stack layer's slot."""
    return any(map(_live._slot, anchors))


class _RawParams(nn.Module):
    """Two Flax ``DenseParams`` (modules that return their raw kernels, reading their
    input's shape only) whose kernels the parent reads where it reads their input."""

    @nn.compact
    def __call__(self, x):
        from flax.linen.recurrent import DenseParams

        x = nn.Dense(8)(x)
        ka, _ = DenseParams(8, use_bias=False, name="a")(x)
        kb, bb = DenseParams(8, name="b")(x)
        return nn.Dense(4)(jnp.tanh(x @ ka) + x @ kb + bb)


@pytest.mark.parametrize("model", ["raw", "olstm"])
def test_groups_whose_parameters_are_read_in_a_fan_in_adopt_its_choice_exactly(model):
    """Modules that return their raw parameters to a parent reading them where it reads
    their input (``DenseParams``; an ``OptimizedLSTMCell``'s eight gates, in a scan
    over time): their groups have no region of their own, and adopt the choice of the
    fan-in their parameters are read in. Each such group's scale is that choice, the
    same whatever the prior (from the cotangent in hand), and the gradients are fp32's
    under any prior."""
    if model == "raw":
        net, x = _RawParams(), jax.random.normal(jax.random.key(1), (4, 3))
    else:
        net, x = _Recurrent("olstm"), jax.random.normal(jax.random.key(1), (4, 5, 3))
    params, loss = _classified(net, x)
    _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (x,), {})
    gates = {g for g in alj.param_groups(params, SAME_STEP)
             if g in ("a", "b") or "Cell" in g}
    assert len(gates) == (2 if model == "raw" else 8)
    assert set(program.live.adopts) == gates
    (fanin,) = set(program.live.adopts.values())
    assert fanin in program.live.fanins and not gates & set(program.live.groups)
    chose = []
    for seed in (5, 6):
        step, state = _exact_under_random_priors(loss, params, (x,), seed, -6, 12)
        _, _, stats = step(state, params, x, _Y)
        chose.append({g: float(stats.log2_scales[g]) for g in gates})
        assert len(set(chose[-1].values())) == 1  # one choice, the fan-in's
        assert bool(np.all(np.asarray(stats.adopted.array) == np.asarray(
            [g in gates for g in stats.adopted.names])))
    assert chose[0] == chose[1]


@pytest.mark.parametrize("cell", ["gru", "lstm", "olstm"])
def test_an_rnn_computing_in_float16_gets_float32s_gradients(cell):
    """The RNN computing in float16, its state carried in float32 (Flax's default carry
    dtype), the loss x 2^-12: from the default initial scale, every step's unscaled
    gradients are the float32 model's to float16's precision, none flushed to zeros.
    (A fan-in deciding at a float32 point put its cotangent halfway down float32's span
    at first, and the cell's float16 values flushed: every gradient but the head's was
    zero.) No group is starved: an ``OptimizedLSTMCell``'s gates read their input's
    shape only, and the point on it, read by nothing, gets no row (counted, its zeros
    starved the gates every step)."""
    x = jax.random.normal(jax.random.key(1), (16, 6, 3))
    labels = jnp.arange(16) % 4

    def loss_of(dtype):
        model = _Recurrent(cell, every_step=True, dtype=dtype)

        def loss(p, x, y=None):
            logits = model.apply({"params": p}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, labels).mean() * 2.0**-12
        return model, loss

    model, loss32 = loss_of(jnp.float32)
    params = model.init(jax.random.key(0), x)["params"]
    ref = jax.grad(loss32)(params, x)
    scaler = alj.adaptive(groups="module", retries=0)
    tx = optax.chain(alj.adaptive_unscale(scaler), optax.sgd(-1.0))
    vg = alj.adaptive_value_and_grad(loss_of(jnp.float16)[1])

    @jax.jit
    def step(state):
        loss, grads, stats = vg(state, params, x)
        return *tx.update(grads, state, params, loss=loss, scale_stats=stats), stats

    state = tx.init(params)
    for _ in range(3):
        got, state, stats = step(state)
        assert bool(alj.scale_state(state).last_applied)
        assert not np.any(np.asarray(stats.starved.array))
        for path, g, r in zip(jax.tree_util.tree_leaves_with_path(ref),
                              jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
            assert err < 2e-2, (jax.tree_util.keystr(path[0]), err)


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (under
# the shard_map: nothing decides, which the analysis is checked for)
@pytest.mark.parametrize("cell,around", [
    *(("gru", a) for a in AROUND if a != "shard_map"),
    *(("olstm", a) if a in ("vmap", "remat") else pytest.param(
        "olstm", a, marks=pytest.mark.slow) for a in AROUND if a != "shard_map")])
def test_an_rnn_under_a_transformation_around_the_model_stays_exact(cell, around):
    """The GRU over time with ``vmap`` (per example), ``checkpoint``, ``jit``, ``cond`` or
    ``shard_map`` around the whole model: its regions decide as without, each the same
    whatever the prior, and the gradients are fp32's under any prior. Inside a
    ``shard_map`` of the loss nothing decides; under the ``cond`` the model runs in
    both branches, two scans over time sharing the cell, whose regions keep the plan
    (Dense layers decide in each branch). (Flax's ``nn.RNN`` cannot be traced inside a
    ``shard_map`` that checks types: its zero initial carry is not typed as varying.)
    Likewise an ``OptimizedLSTMCell``, whose gates adopt the choice of the fan-in their
    kernels are read in wherever that fan-in decides, and nowhere else."""
    x = jax.random.normal(jax.random.key(1), (4, 5, 3))
    params, loss = _classified(_Recurrent(cell), x, around)
    _, program, _ = alj._grad.trace(loss, SAME_STEP, params, (x,), {})
    groups = set(alj.param_groups(params, SAME_STEP))
    gates = {g for g in groups if cell == "olstm" and "Cell" in g}
    plain = not around.startswith("shard_map") and around != "cond"
    assert set(program.live.groups) == (
        set() if around.startswith("shard_map") else {"Dense_0", "Dense_1"}
        if around == "cond" else groups - {""} - gates)
    assert set(program.live.adopts) == (gates if plain else set())
    chose = []
    for seed in (3, 4):
        step, state = _exact_under_random_priors(loss, params, (x,), seed, -6, 12)
        _, _, stats = step(state, params, x, _Y)
        chose.append({g: float(stats.log2_scales[g])
                      for g in {*program.live.groups, *program.live.adopts}})
    assert chose[0] == chose[1]


def test_a_vmap_inside_the_loss_decides_on_the_whole_batch():
    """A per-example loss under vmap: the decider sees the batched cotangent, so its
    choice is the batch's (the largest example's), its first reserve that of a sum over
    the batch (the kernel's gradient is one), and the gradient stays exact."""
    params, _, _ = _chain()

    def per_example(p, x, y=None):
        return jnp.sum(jax.vmap(lambda xi: _d2(p["d2"], _d1(p["d1"], xi)))(x) * _C)

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    step, state = _grads_through(scaler, per_example, params, (jnp.asarray(_X),),
                                 {"": 0, "d1": 0, "d2": 0})
    got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d2"]) == _first(np.abs(_C).max())
    assert_fp32_trees_close(got, jax.grad(_chain_loss)(params, jnp.asarray(_X)))


# -------------------------------------------------------------------- devices


def _square_loss(p, x):  # (a cotangent that grows with the input)
    return jnp.sum(_d2(p["d2"], _d1(p["d1"], x)) ** 2) * 2.0**-10


@functools.cache
def _mapped(mesh, check_vma, axis_name):
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    tx = alj.adaptive_unscale(scaler, axis_name=axis_name)

    def local(params, state, x):
        _, grads, stats = alj.adaptive_value_and_grad(_square_loss)(state, params, x)
        return jax.tree_util.tree_map(lambda a: a[None], stats.log2_scales)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P("data"),
                      check_vma=check_vma)
    return tx, jax.jit(f)


@pytest.mark.parametrize("check_vma,axis_name", [(True, None), (False, "data")],
                         ids=["typed", "untyped-axis_name"])
def test_devices_choose_one_scale_for_the_gradients_they_share(mesh, check_vma, axis_name):
    """Each device's shard of the batch is 2**d larger: the deciders take their amax
    over the devices (one scalar all-reduce each), so every device uses the scale the
    whole batch calls for, the one a single device picks."""
    params, _, _ = _chain()
    n = mesh.devices.size
    x = np.repeat(_X[:1], 2 * n, axis=0) * np.repeat(2.0 ** np.arange(n), 2)[:, None]
    tx, f = _mapped(mesh, check_vma, axis_name)
    state = tx.init(params)
    rep = NamedSharding(mesh, P())
    out = f(jax.device_put(params, rep), jax.device_put(state, rep),
            jax.device_put(x.astype(np.float32), NamedSharding(mesh, P("data"))))
    for g in ("d1", "d2"):
        v = np.asarray(out[g])
        assert np.all(v == v[0]), (g, v)
    single = jax.jit(alj.adaptive_value_and_grad(_square_loss))(
        state, params, jnp.asarray(x[-2:], jnp.float32))[2]  # the largest shard alone
    for g in ("d1", "d2"):
        assert float(np.asarray(out[g])[0]) == float(single.log2_scales[g]), g



class _Outer(nn.Module):
    """A module with a parameter of its own and a child (linen names it Outer_0/Dense_0)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], 6))
        h = jnp.tanh(nn.Dense(6)(jnp.tanh(x @ w)))
        return h @ self.param("v", nn.initializers.normal(1.0), (6, 3))


class _Wrapped(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Outer()(x)


def test_a_child_inside_a_live_parent_converts_between_two_chosen_scales():
    """The child's input point sits between the parent's region and the child's: both
    scales are chosen later in the forward order than it, and it receives both through
    tokens; the gradient stays exact."""
    model = _Wrapped()
    params = model.init(jax.random.key(0), jnp.asarray(_X))["params"]

    def loss(p, x, y=None):
        return jnp.sum(model.apply({"params": p}, x) * _C)

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (jnp.asarray(_X),), {})
    assert set(program.live.groups) == {"_Outer_0", "_Outer_0/Dense_0"}
    assert any(len(n) == 2 for n in program.live.needs.values())  # both sides by token
    step, state = _grads_through(scaler, loss, params, (jnp.asarray(_X),),
                                 {"": 2, "_Outer_0": -3, "_Outer_0/Dense_0": 9})
    got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["_Outer_0"]) == _first(np.abs(_C).max())
    assert_fp32_trees_close(got, jax.grad(loss)(params, jnp.asarray(_X)))


# ------------------------------------------- one global scale that cannot hold the span


_LAYERS = [alj.scale_group(f"l{i}")(lambda p, x: jax.nn.sigmoid(x @ p["w"]))
           for i in range(10)]


def _deep_loss(p, x, y=None):
    for i, layer in enumerate(_LAYERS):
        x = layer(p[f"l{i}"], x)
    return jnp.sum(x)


@functools.cache
def _deep_health(groups, grad_dtype):
    rng = np.random.default_rng(7)
    params = {f"l{i}": {"w": jnp.asarray(rng.normal(size=(16, 16)) * 0.3, jnp.float32)}
              for i in range(10)}
    scaler = alj.adaptive(groups=groups, grad_dtype=grad_dtype, simulate=True,
                          compute_dtype="float16")
    tx = alj.adaptive_unscale(scaler)
    state = tx.init(params)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    grad_fn, update = jax.jit(alj.adaptive_value_and_grad(_deep_loss)), jax.jit(tx.update)
    for _ in range(2):  # (the first step runs at scale 1, below where the top allows)
        _, grads, stats = grad_fn(state, params, x)
        _, state = update(grads, state, params, scale_stats=stats)
    return bool(stats.flushed), alj.diagnostics.check_health(state, warn=False)


def test_one_global_scale_that_cannot_hold_the_span_says_module_groups_are_the_fix():
    """Sigmoid shrinks the cotangent about 2 binades a layer: at the one scale e4m3's
    max allows for the top layers, the lowest layers' cotangents flush entirely, and the
    health check says (once, as a warning) that per-module scales are the fix; e5m2's
    32 binades hold the spread, and per module every group has its own scale."""
    flushed, msgs = _deep_health("global", "float8_e4m3fn")
    assert flushed
    assert len(msgs) == 1 and "groups='module'" in msgs[0]
    assert _deep_health("global", "float8_e5m2") == (False, [])
    assert _deep_health("module", "float8_e4m3fn") == (False, [])


# ------------------------------------------------ every front end and transformation


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (drawn
# cases where nothing can decide: a shard_map around the model, a cond inside it)
@SLOW  # (its fixed siblings in the fast tier: the model cases above, checkpoint, jit, vmap)
@PROPERTY
@given(front_end=st.sampled_from(FRONT_ENDS), around=st.sampled_from(AROUND),
       inside=st.sampled_from(INSIDE), seed=st.integers(0, 2**16))
@example(front_end="linen", around="none", inside="none", seed=0)
def test_fp32_gradients_exact_under_same_step_scales_and_transformations(
        front_end, around, inside, seed):
    """Whatever the prior scales, front end and transformation around and inside the
    model: the regions that decide in the backward pass, those that keep the plan, and
    the tokens between them leave the fp32 gradient unchanged."""
    scaler = alj.adaptive(compute_dtype="float16", groups="module", max_rise=1000,
                          same_step=True)
    case = build(front_end, around, inside, jnp.float32, scaler)
    rng = np.random.default_rng(seed)
    log2 = {g: int(rng.integers(-8, 16)) for g in case.state.groups}
    unscaled, _ = unscaled_through_optimizer(case, scaler, log2)
    assert_fp32_trees_close(unscaled, case.reference())


class _DeadBranch(nn.Module):
    @nn.compact
    def __call__(self, x):
        nn.Dense(4, name="dead", dtype=jnp.float16)(x)  # its output reaches nothing
        h = jnp.tanh(nn.Dense(4, name="first", dtype=jnp.float16)(x))
        return nn.Dense(2, name="last", dtype=jnp.float16)(h)


def test_a_module_whose_output_reaches_nothing_keeps_its_planned_scale():
    """A decider the backward pass never reaches (its module's output unused): its region
    stays at the plan's scale, as the other points of the region read it, and the steps
    after the first are applied (found by the random NNX graphs: a dead region reported
    at scale 1 made the rule skip every step, asking for the plan it never got)."""
    model = _DeadBranch()
    x = jax.random.normal(jax.random.key(0), (8, 4))
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(p, x, y):
        out = model.apply({"params": p}, x).astype(jnp.float32)
        return jnp.mean((out - y) ** 2) * 2.0**-16

    step, state = _grads_through(alj.adaptive(groups="module", retries=0), loss_fn, params,
                                 (x,))
    y = jnp.zeros((8, 2))
    applied = []
    for _ in range(3):
        planned = float(state[0].log2_scales["dead"])
        grads, state, stats = step(state, params, x, y)
        applied.append(bool(state[0].last_applied))
        assert float(stats.log2_scales["dead"]) == planned
        assert float(stats.log2_scales["first"]) > 0  # the live groups decide
    assert applied[1:] == [True, True]  # (step 0 ran at scale 1: the root's far below)
    assert not np.any(np.asarray(grads["dead"]["kernel"]))
    ref = jax.grad(loss_fn)(params, x, y)
    assert_fp32_trees_close(grads["first"], ref["first"], rtol=2e-2)


def _residual_stream(around, inside):
    """Three ``scale_group`` layers on a residual stream (``h + layer(h)``), the stream a
    fan-in read by every layer and the head; ``around`` the whole model, ``inside`` each
    layer (``test_jax_transformations``' wrappers)."""
    from test_jax_transformations import _around, _inside

    names = ["r0", "r1", "r2", "head"]
    layers = {n: alj.scale_group(n)(lambda p, h: jnp.tanh(h @ p["w"] + p["b"]))
              for n in names}
    keys = jax.random.split(jax.random.key(3), len(names))
    params = {n: {"w": jax.random.normal(k, (8, 8)) / 8**0.5, "b": jnp.full((8,), 0.1)}
              for n, k in zip(names, keys)}

    def model(p, x):
        h = x
        for n in names[:-1]:
            h = h + _inside(inside, functools.partial(layers[n], p[n]))(h)
        return layers["head"](p["head"], h)

    def loss(p, x, y=None):
        return jnp.mean(_around(around, functools.partial(model, p))(x) ** 2)

    return params, loss


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")
@pytest.mark.parametrize("around,inside", [(a, "none") for a in AROUND]
                         + [("none", i) for i in INSIDE if i != "none"]
                         + [("vmap", "cond"), ("vmap", "remat")])
def test_a_residual_streams_fan_in_decides_and_stays_exact_under_transformations(
        around, inside):
    """The stream decides at its last reader where its whole border is in one scope: a
    vmap, jit, checkpoint or cond around the model or around each layer (jits,
    checkpoint bodies and cond branches in the scope around them, a vmap's points met
    once; a cond under vmap, whose batched predicate runs both branches, too); a
    shard_map around it keeps the plan. Either way, whatever the prior scales, the fp32
    gradients are jax.grad's."""
    params, loss = _residual_stream(around, inside)
    x = jax.random.normal(jax.random.key(4), (8, 8))
    scaler = alj.adaptive(compute_dtype="float16", groups="module", retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (x,), {})
    planned = around in ("shard_map", "shard_map_untyped")
    assert program.live.fanins == (() if planned else (("head", "r0", "r1", "r2"),))
    step, state = _grads_through(scaler, loss, params, (x,), {
        "": 5, "r0": -6, "r1": 9, "r2": 2, "head": 12})
    got, new_state, _ = step(state, params, x, jnp.zeros(()))
    assert bool(new_state[0].base.last_applied)
    assert_fp32_trees_close(got, jax.grad(loss)(params, x))


def _nested_loss(case):
    """A loss whose modules sit in ``jax.checkpoint`` bodies or ``switch`` branches, in
    one of several shapes."""
    g = lambda n, f=jnp.tanh: alj.scale_group(n)(lambda p, x: f(x @ p["w"]))  # noqa: E731
    a, b, c, h = g("a"), g("b"), g("c"), g("h", lambda v: v)
    ck = jax.checkpoint

    def model(p, z):
        if case == "nested":  # a residual stream across two nested bodies
            inner = ck(lambda z: z + c(p["c"], z))
            return ck(lambda z: inner(z + b(p["b"], z)))(z)
        if case == "policy":  # a policy that saves the dots
            body = ck(lambda z: z + c(p["c"], b(p["b"], z)),
                      policy=jax.checkpoint_policies.dots_saveable)
            return body(z) + z
        if case == "cond inside":
            return ck(lambda z: jax.lax.cond(jnp.sum(z) > -1e9, lambda z: z + b(p["b"], z),
                                             lambda z: z, z))(z)
        if case.startswith("switch"):  # b and c in both branches; the first or last taken
            first = jnp.sum(z) > -1e9
            index = jnp.where(first, 0, 1) if "first" in case else jnp.where(first, 1, 0)
            return jax.lax.switch(index, [lambda z: z + c(p["c"], b(p["b"], z)),
                                          lambda z: z - c(p["c"], b(p["b"], z))], z)
        if case.startswith("nested switch"):  # in the outer's last branch, or first
            on = jnp.sum(z) > -1e9
            inner = lambda z: jax.lax.switch(jnp.where(jnp.sum(z) > -1e9, 0, 1), [  # noqa: E731
                lambda z: z - c(p["c"], b(p["b"], z)),
                lambda z: 0.5 * z + c(p["c"], b(p["b"], z))], z)
            plain = lambda z: z + c(p["c"], b(p["b"], z))  # noqa: E731
            if case.endswith("first"):  # the inner's first branch taken either way
                return jax.lax.switch(jnp.where(on, 0, 1), [inner, plain], z)
            return jax.lax.switch(jnp.where(on, 1, 0), [plain, inner], z)
        if case == "decider inside":  # z read by b before the body and by c in it
            w = b(p["b"], z)
            return ck(lambda z, w: c(p["c"], z) + w)(z, w)
        body = ck(lambda z, w: z + b(w, z))  # "called twice": one body traced twice
        return body(body(z, p["b"]), p["b"])

    def loss(p, x, y=None):
        return jnp.mean(h(p["h"], model(p, a(p["a"], x))) ** 2)

    return loss


@pytest.mark.parametrize("case,live,fanins", [
    ("nested", "abch", 1), ("policy", "abch", 1), ("cond inside", "abh", 1),
    ("decider inside", "abch", 1), ("called twice", "ah", 0),
    ("switch, first taken", "abch", 1), ("switch, last taken", "abch", 1),
    ("nested switch", "abch", 1), ("nested switch in the first", "abch", 1)])
def test_modules_in_checkpoint_bodies_and_switch_branches_decide_and_stay_exact(case, live,
                                                                               fanins):
    """A checkpoint body is in the scope around it: its modules decide in the pass, the
    tokens crossing the body as inputs and outputs, whether nested, under a policy, a
    decider inside the body with its border before it, or around a ``cond`` (its
    branches in the same scope too). A body traced twice meets its points twice, and
    those keep the plan. A ``switch`` whose branches both call b and c: their regions
    decide in the branch taken, the first or the last (a decider in each), and in a
    switch inside the last branch or the first, in its first branch. Every region
    that decides chooses the same scale whatever the prior, and whatever the prior
    scales, the fp32 gradients are jax.grad's."""
    keys = jax.random.split(jax.random.key(7), 5)
    params = {n: {"w": jax.random.normal(k, (8, 8)) / 8**0.5} for n, k in zip("abch", keys)}
    x = jax.random.normal(keys[4], (16, 8))
    loss = _nested_loss(case)
    scaler = alj.adaptive(compute_dtype="float16", groups="module", retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (x,), {})
    assert set(program.live.groups) == set(live)
    assert len(program.live.fanins) == fanins
    chose = []
    for prior in ({"": 5, "a": -6, "b": 9, "c": 2, "h": 12},
                  {"": -3, "a": 11, "b": -8, "c": 13, "h": 0}):
        step, state = _grads_through(scaler, loss, params, (x,), prior)
        got, new_state, stats = step(state, params, x, jnp.zeros(()))
        assert bool(new_state[0].base.last_applied)
        assert_fp32_trees_close(got, jax.grad(loss)(params, x))
        chose.append({g: float(stats.log2_scales[g]) for g in live})
    assert chose[0] == chose[1]  # from the cotangent in hand, not the prior


def test_a_step_vmapped_over_examples_that_take_either_branch_decides_in_each():
    """The whole step under ``vmap``, each example's predicate picking a ``cond``'s
    branch (the first for most): under a batched predicate both branches run, each
    with the other's cotangent masked out, so the decider of the branch an example did
    not take measures nothing and keeps the plan (its choice, zero, adds nothing to
    the other's). Every example's regions decide, whatever the prior, and its
    gradients are jax.grad's."""
    g = lambda n, f=jnp.tanh: alj.scale_group(n)(lambda p, x: f(x @ p["w"]))  # noqa: E731
    a, b, c, h = g("a"), g("b"), g("c"), g("h", lambda v: v)

    def loss(p, x):
        z = a(p["a"], x)
        z = jax.lax.cond(jnp.sum(z) > 0, lambda z: z - c(p["c"], b(p["b"], z)),
                         lambda z: 0.5 * z + c(p["c"], b(p["b"], z)), z)
        return jnp.mean(h(p["h"], z) ** 2)

    keys = jax.random.split(jax.random.key(7), 5)
    params = {n: {"w": jax.random.normal(k, (8, 8)) / 8**0.5} for n, k in zip("abch", keys)}
    xs = jax.random.normal(keys[4], (6, 4, 8))
    taken = [bool(jnp.sum(a(params["a"], x)) > 0) for x in xs]
    assert any(taken) and not all(taken)
    scaler = alj.adaptive(compute_dtype="float16", groups="module", retries=0, max_rise=1000)
    tx = alj.adaptive_unscale(scaler)
    ref = jax.vmap(jax.grad(loss), (None, 0))(params, xs)
    chose = []
    for prior in ({"": 5, "a": -6, "b": 9, "c": 2, "h": 12},
                  {"": -3, "a": 11, "b": -8, "c": 13, "h": 0}):
        state = tx.init(params)
        state = state.with_log2_scales({k: prior[k] for k in state.log2_scales})

        def one(x, state=state):
            loss_, grads, stats = alj.adaptive_value_and_grad(loss)(state, params, x)
            updates, _ = tx.update(grads, state, params, loss=loss_, scale_stats=stats)
            return updates, {k: stats.log2_scales[k] for k in "abch"}

        updates, used = jax.jit(jax.vmap(one))(xs)
        assert_fp32_trees_close(updates, ref)
        chose.append(used)
    for k in "abch":  # from the cotangent in hand, not the prior, in every example
        np.testing.assert_array_equal(chose[0][k], chose[1][k])


@pytest.mark.parametrize("bound", ["max_loss_scale", "min_loss_scale"])
def test_a_choice_in_the_pass_stays_within_the_scale_bounds(bound):
    """A loss x 2^-20 calls for scales near 2^20 and one x 2^20 for scales near 2^-20;
    every module that decides in the pass (the root keeps its plan: the loss's region is
    its own) stays within ``[min_loss_scale, max_loss_scale]`` (2^-2 .. 2^4 here), as
    the rule's scales do, and the gradients are still fp32's."""
    params, loss = _residual_stream("none", "none")
    tiny = 2.0**-20 if bound == "max_loss_scale" else 2.0**20
    scaled = lambda p, x, y=None: loss(p, x) * tiny  # noqa: E731
    x = jax.random.normal(jax.random.key(4), (8, 8))
    scaler = alj.adaptive(compute_dtype="float16", groups="module", retries=0,
                          min_loss_scale=2.0**-2, max_loss_scale=2.0**4, initial_scale=1.0)
    step, state = _grads_through(scaler, scaled, params, (x,))
    got, _, stats = step(state, params, x, jnp.zeros(()))
    scales = {g: float(stats.log2_scales[g]) for g in stats.log2_scales.names if g}
    assert set(scales.values()) == ({4.0} if bound == "max_loss_scale" else {-2.0}), scales
    assert_fp32_trees_close(got, jax.grad(scaled)(params, x))


def test_a_jitted_group_called_twice_shares_one_plan_and_stays_exact():
    """One ``jax.jit`` of a ``scale_group`` called twice on the same shapes: jit traces
    it once, so the walk meets the same recorded points at two call sites, and both
    calls run on one plan (their sides joined). Whatever the prior scales, the fp32
    gradients are jax.grad's, and the group is measured (both calls' rows reach it)."""
    block = jax.jit(alj.scale_group("block")(lambda p, h: jnp.tanh(h @ p["w"])))
    head = alj.scale_group("head")(lambda p, h: h @ p["w"])
    k1, k2 = jax.random.split(jax.random.key(5))
    params = {"block": {"w": jax.random.normal(k1, (8, 8)) / 8**0.5},
              "head": {"w": jax.random.normal(k2, (8, 4)) / 8**0.5}}
    x = jax.random.normal(jax.random.key(6), (8, 8))

    def loss(p, x, y=None):
        return jnp.mean(head(p["head"], block(p["block"], block(p["block"], x))) ** 2)

    scaler = alj.adaptive(compute_dtype="float16", groups="module", retries=0)
    step, state = _grads_through(scaler, loss, params, (x,), {"": 5, "block": -7,
                                                              "head": 11})
    got, new_state, stats = step(state, params, x, jnp.zeros(()))
    assert bool(new_state[0].base.last_applied)
    assert float(stats.amax["block"]) > 0
    assert_fp32_trees_close(got, jax.grad(loss)(params, x))
