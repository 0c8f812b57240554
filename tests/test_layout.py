"""The layout of scale groups (``adaloss_jax._layout``): a layer of a stack is known by
its type, never by parsing its name."""

from __future__ import annotations

import copy
import pickle

import jax
import jax.numpy as jnp
import pytest

import adaloss_jax as alj
from adaloss_jax._layout import GroupVector, Layer, check_names, group_of, layers, order, runs


def test_a_layer_reads_as_its_name_and_knows_its_group():
    s = Layer("blocks/Dense_0", 12)
    assert s == "blocks/Dense_0[12]" and hash(s) == hash("blocks/Dense_0[12]")
    assert (s.group, s.index, group_of(s), group_of("head")) == ("blocks/Dense_0", 12,
                                                                 "blocks/Dense_0", "head")
    for back in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert isinstance(back, Layer) and (back.group, back.index) == (s.group, s.index)
    assert Layer("g", None) == "g[*]"


def test_a_name_that_ends_in_brackets_is_no_layer():
    """The ambiguity of parsed names: a group called ``x[3]`` is a plain group."""
    names = ("", "x[3]", *layers("s", 2))
    assert runs(names) == ((0, 1, False), (1, 2, False), (2, 4, True))
    v = GroupVector(names, jnp.arange(4.0), split=True)
    assert len(jax.tree_util.tree_leaves(v)) == 3
    assert float(v["x[3]"]) == 1.0 and v.stacked("s").tolist() == [2.0, 3.0]


def test_runs_need_consecutive_layers_from_zero():
    assert runs((Layer("s", 1), Layer("s", 2))) == ((0, 1, False), (1, 2, False))
    # a layer missing: the run stops before the gap (layer 2 is no slot of it)
    assert runs((Layer("s", 0), Layer("s", 2))) == ((0, 1, True), (1, 2, False))
    assert runs((*layers("s", 2), *layers("t", 3))) == ((0, 2, True), (2, 5, True))
    assert order(["b", *layers("a", 11)])[:3] == ["a[0]", "a[1]", "a[2]"]
    assert order(layers("a", 11))[-1] == "a[10]"


def test_a_group_named_like_a_layer_beside_its_stack_is_refused():
    check_names(["", "s", *layers("s", 2), "t[0]"])  # no stack t: a plain name
    with pytest.raises(ValueError, match=r"named like layers.*scale_group"):
        check_names(["", "s", *layers("s", 2), "s[1]"])


def test_the_state_holds_layers_as_layers():
    from _stacked import STACK, params

    groups = alj.param_groups(params(), alj.adaptive(groups="module"))
    stacked = [g for g in groups if isinstance(g, Layer)]
    assert [(g.group, g.index) for g in stacked] == [(STACK, i) for i in range(3)], groups
