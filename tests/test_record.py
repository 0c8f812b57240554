"""``adaloss_jax._record``: a loss traced once with the calls a front end reports marked
as scale points (pure JAX here, through :func:`adaloss_jax.scale_group`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import adaloss_jax as alj
from adaloss_jax import _grad, _jaxpr

dense_a = alj.scale_group("rec_a")(lambda p, x: jnp.tanh(x @ p["w"]))
dense_b = alj.scale_group("rec_b")(lambda p, x: x @ p["w"])
PARAMS = {"rec_a": {"w": jnp.full((3, 3), 0.5, jnp.float16)},
          "rec_b": {"w": jnp.full((3, 2), 0.5, jnp.float16)}}
X = jnp.ones((4, 3), jnp.float16)


def loss(p, x):
    y = dense_b(p["rec_b"], dense_a(p["rec_a"], x))
    return jnp.mean(y.astype(jnp.float32) ** 2), {"count": 7, "name": "rec"}


def test_a_marked_call_is_recorded_once_with_its_group_and_points():
    rec, _, groups = _grad.trace(loss, alj.adaptive(groups="module"), PARAMS, (X,), {})
    assert [(c.path, c.group) for c in rec.calls] == [(("rec_a",), True), (("rec_b",), True)]
    assert groups == ["", "rec_a", "rec_b"]
    assert rec.n_params == 2 and rec.param_paths == [("rec_a", "w"), ("rec_b", "w")]
    names = [e.primitive.name for e in rec.closed.jaxpr.eqns]
    labels = [str(e.params.get("name", "")) for e in rec.closed.jaxpr.eqns]
    assert _jaxpr.PARAM_POINT in labels, (names, labels)


def test_what_the_loss_returns_that_is_no_array_comes_back_as_it_is():
    rec, _, _ = _grad.trace(loss, alj.adaptive(groups="module"), PARAMS, (X,), {})
    out = rec.output(jax.core.eval_jaxpr(rec.closed.jaxpr, rec.closed.consts, *rec.dynamic))
    value, aux = out
    assert aux == {"count": 7, "name": "rec"}
    assert float(value) == pytest.approx(float(loss(PARAMS, X)[0]))


def test_outside_a_gradient_function_a_marked_function_is_the_function():
    assert dense_a(PARAMS["rec_a"], X).shape == (4, 3)
    with pytest.raises(ValueError, match="non-empty name"):
        alj.scale_group("")
