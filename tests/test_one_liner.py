"""The card's usage as written: ``optax.chain(adaptive_unscale(), optax.adamw(...))``.

A skipped step must never poison the parameters; with :func:`adaptive_scaled` it must
leave them and the optimizer's state exactly as they were."""

from __future__ import annotations

import functools

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaloss_jax as alj

MLP = functools.partial(_models.MLP, depth=1)  # fp16 compute, Dense_0 and Dense_1


def _setup():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, size=32))
    params = MLP().init(jax.random.key(0), x)["params"]

    def loss_fn(p, x, y, blow):
        logits = MLP().apply({"params": p}, x).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss * 2.0**-20 * blow  # tiny gradients; blow=2**60 overflows them

    return params, loss_fn, x, y


def _train(tx, blows):
    params, loss_fn, x, y = _setup()
    vg = alj.adaptive_value_and_grad(loss_fn)

    @jax.jit
    def step(params, opt_state, blow):
        loss, grads, stats = vg(opt_state, params, x, y, blow)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    out = [(params, opt_state)]
    for b in blows:
        out.append(step(*out[-1], jnp.float32(b)))
    return out


BLOWS = [1.0, 1.0, 1.0, 2.0**60, 1.0, 1.0]


def test_literal_chain_never_poisons_and_trains():
    tx = optax.chain(alj.adaptive_unscale(), optax.adamw(1e-2))
    hist = _train(tx, BLOWS)
    skipped = [not bool(alj.scale_state(s).base.last_applied) for _, s in hist[1:]]
    # Step 1 (scale 1: everything flushes) is skipped and sets the scales its statistics
    # call for; step 4 overflows (no scale holds 2**60 times the loss): skipped.
    assert skipped == [True, False, False, True, False, False]
    for p, _ in hist:
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(p))
    moved = [v for v in jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        lambda a, b: jnp.max(jnp.abs(a - b)), hist[-1][0], hist[2][0]))]
    assert max(float(m) for m in moved) > 0  # it trains


def test_adaptive_scaled_skips_exactly():
    tx = alj.adaptive_scaled(optax.adamw(1e-2))
    hist = _train(tx, BLOWS)
    (p3, s3), (p4, s4) = hist[3], hist[4]
    assert not bool(alj.scale_state(s4).base.last_applied)
    for a, b in zip(jax.tree_util.tree_leaves(p3), jax.tree_util.tree_leaves(p4)):
        np.testing.assert_array_equal(a, b)
    inner3, inner4 = s3[1], s4[1]
    for a, b in zip(jax.tree_util.tree_leaves(inner3), jax.tree_util.tree_leaves(inner4)):
        np.testing.assert_array_equal(a, b)
    # The first step (everything flushed at scale 1) is skipped as exactly, and with
    # retries computed again at the scales its statistics set, and applied.
    assert not bool(alj.scale_state(hist[1][1]).base.last_applied)
    for a, b in zip(jax.tree_util.tree_leaves((hist[0][0], hist[0][1][1])),
                    jax.tree_util.tree_leaves((hist[1][0], hist[1][1][1]))):
        np.testing.assert_array_equal(a, b)  # the parameters and AdamW's state
    retried = _train(alj.adaptive_scaled(optax.adamw(1e-2), alj.adaptive(retries=4)), [1.0])
    assert bool(alj.scale_state(retried[1][1]).base.last_applied)
    assert int(alj.scale_state(retried[1][1]).total_retries) >= 1


Wide = functools.partial(_models.MLP, depth=2, width=32)  # one more layer, other shapes


def test_state_statistics_or_gradients_of_another_model_are_refused():
    params, loss_fn, x, y = _setup()
    other = Wide().init(jax.random.key(1), x)["params"]
    tx = alj.adaptive_scaled(optax.adamw(1e-2), alj.adaptive(groups="module"))
    vg = alj.adaptive_value_and_grad(loss_fn)

    def wide_loss(p, x, y, blow):
        logits = Wide().apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * blow

    wide_vg = alj.adaptive_value_and_grad(wide_loss)
    state, other_state = tx.init(params), tx.init(other)
    one = jnp.float32(1.0)
    with pytest.raises(ValueError, match="another model.*tx.init"):
        jax.jit(vg)(other_state, params, x, y, one)
    loss, grads, stats = jax.jit(vg)(state, params, x, y, one)
    _, other_grads, other_stats = jax.jit(wide_vg)(other_state, other, x, y, one)
    with pytest.raises(ValueError, match="gradients belong to another model"):
        tx.update(other_grads, state, params, loss=loss, scale_stats=stats)
    with pytest.raises(ValueError, match="scale_stats belong to another model"):
        tx.update(grads, state, params, loss=loss, scale_stats=other_stats)
    tx.update(grads, state, params, loss=loss, scale_stats=stats)  # the right ones pass


def test_the_scaler_is_given_once_and_a_mismatch_cannot_train():
    """The gradient function reads the scaler from the optimizer state, so it cannot use
    another; an optimizer built with one scaler refuses a state built with another (at
    trace time), and a scaler passed where the state goes is named."""
    params, loss_fn, x, y = _setup()
    per_module = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module"))
    glob = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive())
    state = per_module.init(params)
    one = jnp.float32(1.0)
    loss, grads, stats = jax.jit(alj.adaptive_value_and_grad(loss_fn))(state, params, x, y, one)
    assert len(stats.amax) > 1  # per-module: the state's scaler, the only one given
    with pytest.raises(ValueError, match="built with .*re-run tx.init"):
        glob.update(grads, state, params, loss=loss, scale_stats=stats)
    with pytest.raises(TypeError):
        alj.adaptive_value_and_grad(loss_fn, alj.adaptive())  # the scaler goes to tx only
    with pytest.raises(ValueError, match="global scaler's state"):
        alj.adaptive_value_and_grad(loss_fn)(alj.loss_scaled(optax.sgd(0.1), alj.dynamic())
                                             .init(params), params, x, y, one)


def test_stock_flax_train_state_fails_with_an_error_naming_the_fix():
    from flax.training import train_state

    params, loss_fn, x, y = _setup()
    for tx in (optax.chain(alj.adaptive_unscale(), optax.adamw(1e-2)),
               alj.adaptive_scaled(optax.adamw(1e-2))):
        state = train_state.TrainState.create(apply_fn=MLP().apply, params=params, tx=tx)
        grads = jax.grad(loss_fn)(params, x, y, jnp.float32(1.0))
        with pytest.raises(ValueError, match="adaloss_jax.flax.TrainState"):
            state.apply_gradients(grads=grads)
