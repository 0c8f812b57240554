"""``adaloss_jax.diagnostics``: the status line, the per-group table and the health
messages, read from a state built by hand."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest
from _stacked import STACK, params

import adaloss_jax as alj
from adaloss_jax import _common
from adaloss_jax.diagnostics import Health, check_health, scale_table, status_line


def _state():
    return alj.adaptive_unscale(alj.adaptive(groups="module")).init(params())


def test_a_stack_is_one_row_until_a_layer_measured_then_a_row_per_layer():
    st = _state()
    header, *rows = scale_table(st, legend=False).splitlines()
    assert header.split() == ["group", "log2", "scale", "log2", "unit", "amax", "overflowed"]
    assert [r.split()[0] for r in rows] == ["(root)", "Dense_0", STACK]
    amax = st.log2_amax.array.at[st.groups.index(f"{STACK}[2]")].set(-3.0)
    rows = scale_table(st.replace(log2_amax=type(st.log2_amax)(st.groups, amax)),
                       legend=False).splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["(root)", "Dense_0"] + [
        f"{STACK}[{i}]" for i in range(3)]


def test_a_global_state_is_one_row_and_reads_like_an_adaptive_one():
    st = alj.dynamic(initial_scale=2.0**10).init()
    assert [r.split()[0] for r in scale_table(st, legend=False).splitlines()[1:]] == [
        "(root)"]
    assert status_line(st) == "applied | scale 2^10 | skipped 0/0, 0 non-finite in a row | ok"
    assert status_line(_state()).startswith("applied | scale 2^15 (")  # (fp16's start)


@pytest.mark.parametrize("flag,text", [
    (Health.SKIPPING, "steps in a row were not finite"),
    (Health.PINNED_LOW, "overflowed at min_loss_scale"),
    (Health.NOTHING_MEASURED, "nothing was measured at max_loss_scale"),
    (Health.SPAN, "one global scale cannot hold"),
    (Health.FOREIGN_GRADS, "not the ones its scale_stats were measured with"),
])
def test_each_health_flag_is_explained_once_per_process(flag, text, monkeypatch):
    monkeypatch.setattr(_common, "_NOTICED", set())
    st = _state().replace(health=jnp.asarray(int(flag), jnp.int32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = check_health(st), check_health(st)
    assert len(first) == 1 and text in first[0] and first == second
    assert [str(w.message) for w in caught] == [f"adaloss_jax: {first[0]}"]
    assert Health(int(st.health)) is flag
    assert check_health(_state(), warn=False) == []


def test_two_flags_give_two_messages_in_flag_order():
    st = _state().replace(health=jnp.asarray(int(Health.SPAN | Health.SKIPPING), jnp.int32))
    msgs = check_health(st, warn=False)
    assert len(msgs) == 2 and "not finite" in msgs[0] and "one global scale" in msgs[1]
