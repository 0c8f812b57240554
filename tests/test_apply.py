"""``adaloss_jax._apply``: the anchors' scales and conversion ratios of a step, and the
program's statistics rows (its dummies in, per-group statistics out)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import adaloss_jax as alj
from adaloss_jax import _apply, _grad
from adaloss_jax._layout import GroupVector, layers
from adaloss_jax._stream import Steps


def test_an_anchor_set_is_at_the_min_of_its_groups_and_a_pair_converts_by_their_ratio():
    names = ("", "a", "b", "c")
    used = GroupVector(names, jnp.array([3.0, 5.0, -2.0, 7.0]), split=True)
    log2 = {g: used[g] for g in names}
    pairs = [(("a",), ("a", "b")), (("a", "b", "c"), ("",)), (("c",), ("c",))]
    sigma, ratios = _apply.anchor_scales(log2, pairs, used)
    assert float(sigma[("a", "b")]) == -2.0 and float(sigma[("a", "b", "c")]) == -2.0
    assert float(ratios[(("a",), ("a", "b"))]) == 2.0**7
    assert float(ratios[(("a", "b", "c"), ("",))]) == 2.0**-5
    assert (("c",), ("c",)) not in ratios  # nothing to convert


def test_a_shard_maps_manual_axes_are_read_under_either_parameter_name():
    assert _apply._manual_axes({"newly_manual_axes": frozenset({"data"})}) == {"data"}
    assert _apply._manual_axes({"manual_axes": ("x", "y")}) == {"x", "y"}  # older jax
    assert _apply._manual_axes({}) == frozenset()


def test_anchors_that_vary_by_layer_are_a_vector_over_the_layers():
    names = ("", *layers("s", 3))
    used = GroupVector(names, jnp.array([0.0, 4.0, 1.0, 9.0]), split=True)
    per_layer = Steps([(s,) for s in layers("s", 3)])
    shifted = Steps([(layers("s", 3)[1],), (layers("s", 3)[2],), ("",)])
    sigma, ratios = _apply.anchor_scales({g: used[g] for g in names},
                                         [(per_layer, shifted)], used)
    assert sigma[per_layer].tolist() == [4.0, 1.0, 9.0]
    assert ratios[(per_layer, shifted)].tolist() == [2.0**3, 2.0**-8, 2.0**9]


@pytest.fixture(scope="module")
def program():
    f = alj.scale_group("app_f")(lambda p, x: jnp.tanh(x @ p["w"]))

    def loss(p, x):
        return jnp.mean(f(p["app_f"], x).astype(jnp.float32) ** 2)

    params = {"app_f": {"w": jnp.full((3, 3), 0.5, jnp.float16)}}
    return _grad.trace(loss, alj.adaptive(groups="module"), params,
                       (jnp.ones((2, 3), jnp.float16),), {})[1]


def test_the_program_hands_out_a_dummy_per_site_and_decodes_their_rows(program):
    dummies = program.dummies()
    assert len(dummies) == len(program.sites()) > 0
    assert all(d.shape[-1] == program.columns.width and not d.any() for d in dummies)
    used = GroupVector(("", "app_f"), jnp.array([2.0, 3.0]), split=True)
    stats = program.decode(dummies, used)  # rows of zeros: nothing measured
    assert list(stats.log2_scales) == ["", "app_f"]
    assert stats.log2_scales.array.tolist() == [2.0, 3.0]  # the scales it was given
    assert stats.amax.array.tolist() == [0.0, 0.0] and not bool(stats.nonfinite)
