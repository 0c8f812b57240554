"""``adaloss_jax._state``: the adaptive state (its groups, counters and warm start) and
the statistics a backward pass hands to it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _stacked import STACK, params

import adaloss_jax as alj
from adaloss_jax._layout import Layer

SCALER = alj.adaptive(groups="module", initial_scale=2.0**4)


def _state():
    return alj.adaptive_unscale(SCALER).init(params())


def test_a_fresh_state_holds_every_group_at_the_initial_scale_and_nothing_measured():
    st = _state()
    assert st.groups == ("", "Dense_0", STACK, *(f"{STACK}[{i}]" for i in range(3)))
    assert [type(g) is Layer for g in st.groups] == [False] * 3 + [True] * 3
    assert st.log2_scales.array.tolist() == [4.0] * 6
    assert st.log2_amax.array.tolist() == [-jnp.inf] * 6
    assert not st.overflowed.array.any() and int(st.health) == 0
    assert float(st.loss_scale) == 16.0 and int(st.total_applied) == 0  # the counters


@pytest.mark.parametrize("k", [-24, -1, 0, 15, 29, 64])
def test_the_initial_log2_scales_are_exact_integers(k):
    """A power-of-two start is an integer log2 scale, so every scale made from it is a
    power of two (XLA's float32 log2 of 2**15 is 14.999999)."""
    st = alj.adaptive_unscale(alj.adaptive(groups="module", initial_scale=2.0**k)).init(
        params())
    assert st.log2_scales.array.tolist() == [float(k)] * len(st.groups)


def test_a_warm_start_sets_named_groups_and_the_root_scale():
    st = _state().with_log2_scales({"": 9, f"{STACK}[1]": -3})
    assert float(st.loss_scale) == 2.0**9
    assert float(st.log2_scales[Layer(STACK, 1)]) == -3.0
    assert st.log2_scales.stacked(STACK).tolist() == [4.0, -3.0, 4.0]
    with pytest.raises(KeyError, match=r"no scale groups \['nope'\].*Dense_0"):
        _state().with_log2_scales({"nope": 1})
    with pytest.raises(AttributeError, match="no attribute 'loss_scales'"):
        _state().loss_scales  # noqa: B018


def test_the_state_keeps_its_groups_and_scaler_through_jit_and_tree_maps():
    st = _state().with_log2_scales({f"{STACK}[2]": 7})
    back = jax.jit(lambda s: s)(st)
    assert back.groups == st.groups and back.scaler == SCALER
    assert all(type(a) is type(b) for a, b in zip(back.groups, st.groups))
    assert float(back.log2_scales[f"{STACK}[2]"]) == 7.0
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x: x, st))
    assert len(leaves) == len(jax.tree_util.tree_leaves(st))


def test_the_statistics_name_the_groups_they_measured():
    from _stacked import loss
    st = _state()
    x = jnp.ones((2, 4), jnp.float16)
    _, _, stats = jax.jit(alj.adaptive_value_and_grad(loss))(st, params(), x)
    assert set(stats.log2_scales) <= set(st.groups)
    assert {f"{STACK}[{i}]" for i in range(3)} <= set(stats.amax)
    assert all(float(stats.amax[g]) > 0 for g in stats.amax if g)
