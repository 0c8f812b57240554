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


def test_models_applied_to_sub_trees_name_their_groups_by_where_the_sub_tree_sits():
    """A loss applying a head and a body to sub-trees of its parameters, the body's
    module names repeating the head's (``Dense_0``): each group is named by its
    parameters' place in the whole tree, found by the identity of the sub-tree's leaves
    (the fast tier's trace-only twin of ``test_adaptive``'s training test)."""
    from flax import linen as nn

    class Body(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, dtype=jnp.float16)(jnp.tanh(nn.Dense(8, dtype=jnp.float16)(x)))

    body, head = Body(), nn.Dense(4, dtype=jnp.float16)
    x = jnp.ones((4, 8))
    params = {"Dense_0": head.init(jax.random.key(2), x)["params"],
              "body": body.init(jax.random.key(3), x)["params"]}

    def loss_fn(p, x):
        h = body.apply({"params": p["body"]}, x)
        return jnp.mean(head.apply({"params": p["Dense_0"]}, h).astype(jnp.float32))

    _, _, groups = _grad.trace(loss_fn, alj.adaptive(groups="module"), params, (x,), {})
    assert groups == ["", "Dense_0", "body/Dense_0", "body/Dense_1"]
