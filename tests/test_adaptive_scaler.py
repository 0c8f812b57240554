"""``adaloss_jax._adaptive_scaler``: the adaptive scaler's options, how they resolve and
how two scalers are told apart."""

from __future__ import annotations

import math

import pytest

import adaloss_jax as alj
from adaloss_jax._adaptive_scaler import differences
from adaloss_jax.bench import _configs as _bench_configs


def test_same_step_is_the_default_per_module_with_the_amax_statistic():
    assert alj.adaptive(groups="module").same_step is True
    assert alj.adaptive(groups="module", grad_dtype="float8_e4m3fn").same_step is True
    assert alj.adaptive().same_step is False  # one global scale: nothing to choose per module
    assert alj.adaptive(groups="module", statistic="gaussian").same_step is False
    assert alj.adaptive(groups="module", same_step=False).same_step is False
    assert alj.adaptive(groups="module") == alj.adaptive(groups="module", same_step=True)
    specs = {c: _bench_configs.CONFIGS[c].spec() for c in ("e4m3-module", "e4m3-delayed")}
    assert "same_step=True" in specs["e4m3-module"]  # bench results keyed by it
    assert "same_step=False" in specs["e4m3-delayed"]


def test_same_step_needs_module_groups_and_the_amax_statistic():
    with pytest.raises(ValueError, match="needs groups='module' and statistic='amax'"):
        alj.adaptive(same_step=True)
    with pytest.raises(ValueError, match="needs groups='module' and statistic='amax'"):
        alj.adaptive(groups="module", statistic="gaussian", same_step=True)
    with pytest.raises(TypeError, match="same_step must be True or False"):
        alj.adaptive(groups="module", same_step=1)


def test_the_default_is_one_global_scale_measured_by_amax():
    s = alj.adaptive()
    assert (s.groups, s.statistic, s.same_step, s.retries) == ("global", "amax", False, 0)
    assert s.group_of(("blocks", "Dense_0")) == ""
    module = alj.adaptive(groups="module", max_depth=1)
    assert module.group_of(("blocks", "Dense_0")) == "blocks"
    assert alj.adaptive(groups="module").group_of(("blocks", "Dense_0")) == "blocks/Dense_0"
    assert alj.adaptive(factor=16.0).backoff == 4


@pytest.mark.parametrize("kw,match", [
    ({"groups": "modules"}, "groups='modules' is not known"),
    ({"statistic": "max"}, "statistic='max' is not known"),
    ({"threshold": 1.5}, "threshold must be in"),
    ({"decay": -1.0}, "decay must be a positive number"),
])
def test_an_unknown_or_out_of_range_option_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        alj.adaptive(**kw)


def test_two_scalers_are_told_apart_by_the_options_they_set_differently():
    a = alj.adaptive(groups="module", retries=2)
    b = alj.adaptive(groups="module", retries=0, max_depth=1)
    diff = differences(a, b, names=("transformation", "state"))
    assert diff == ("retries=2 (transformation) vs 0 (state); "
                    "max_depth=None (transformation) vs 1 (state)")
    assert differences(a, a) == "none (equal options)"
    assert alj.adaptive(decay=math.inf).decay == math.inf
