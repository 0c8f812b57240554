"""Parity of the dynamic scaler with jmp's DynamicLossScale and flax's DynamicScale.

Semantics, side by side (``P`` = our ``period``):

* jmp ``DynamicLossScale(period=P)`` grows on the P-th consecutive finite step, as we do.
  Ours follows jmp; it additionally has ``max_loss_scale`` (jmp keeps the old scale
  only once ``scale * factor`` overflows fp32 to inf).
* flax ``DynamicScale(growth_interval=G)`` grows on the (G+1)-th consecutive finite
  step (its ``fin_steps == growth_interval`` check runs before counting the current
  step), one step later than jmp. So ``DynamicScale(growth_interval=P - 1)`` equals
  ours with ``period=P``; with ``growth_interval=P`` it would lag by one step per period.
* At the top of fp32 flax clips to ``finfo(float32).max`` (not a power of two); the
  flax comparison therefore stays below it, the jmp one also covers it.
* All three back off by ``factor`` on every non-finite gradient (our ``hysteresis=1``)
  down to the minimum, and reset the finite-step counter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale

import adaloss_jax as alj

STEPS = 200
PERIOD = 5
MIN = 2.0**8
INITIAL = 2.0**14

# Non-finite gradients at chosen steps: isolated ones, a run long enough to hit the
# minimum, and one on the step where a growth would otherwise happen.
BAD_STEPS = {3, 4, 17, 40, 41, 42, 43, 44, 45, 46, 47, 48, 60, 64, 99, 150, 151}


def flags():
    return np.array([t not in BAD_STEPS for t in range(STEPS)])


@functools.partial(jax.jit, static_argnums=0)
def ours_trajectory(scaler, grads_finite):
    def body(s, f):
        s = scaler.adjust(s, f)
        return s, (s.loss_scale, s.last_applied)

    return jax.lax.scan(body, scaler.init(), grads_finite)[1]


@functools.partial(jax.jit, static_argnums=(0, 1))
def jmp_trajectory(period, min_scale, initial, grads_finite):
    # Rebuilt inside the trace: jmp's min_loss_scale does not survive flattening.
    def body(carry, f):
        scale, counter = carry
        ls = jmp.DynamicLossScale(
            loss_scale=scale,
            counter=counter,
            period=period,
            min_loss_scale=jnp.asarray(min_scale, jnp.float32),
        ).adjust(f)
        return (ls.loss_scale, ls.counter), ls.loss_scale

    init = (jnp.asarray(initial, jnp.float32), jnp.zeros([], jnp.int32))
    return jax.lax.scan(body, init, grads_finite)[1]


def _poisoned(x, bad):
    # A gradient that is inf exactly when ``bad``: x * where(bad, inf, 1) differentiated.
    return jnp.sum(x * jnp.where(bad, jnp.inf, 1.0))


@functools.partial(jax.jit, static_argnums=(0, 1))
def flax_trajectory(growth_interval, min_scale, initial, bad):
    def body(ds, b):
        ds, finite, _, _ = ds.value_and_grad(_poisoned)(jnp.ones(2), b)
        return ds, (ds.scale, finite)

    ds = DynamicScale(
        growth_interval=growth_interval,
        scale=jnp.asarray(initial, jnp.float32),
        minimum_scale=min_scale,
    )
    return jax.lax.scan(body, ds, bad)[1]


def test_trajectory_equals_jmp_and_flax():
    f = flags()
    scaler = alj.dynamic(initial_scale=INITIAL, period=PERIOD, min_loss_scale=MIN)
    ours, applied = jax.device_get(ours_trajectory(scaler, jnp.asarray(f)))
    theirs_jmp = jax.device_get(jmp_trajectory(PERIOD, MIN, INITIAL, jnp.asarray(f)))
    theirs_flax, flax_finite = jax.device_get(
        flax_trajectory(PERIOD - 1, MIN, INITIAL, jnp.asarray(~f))
    )
    np.testing.assert_array_equal(ours, theirs_jmp)
    np.testing.assert_array_equal(ours, theirs_flax)
    np.testing.assert_array_equal(applied, f)
    np.testing.assert_array_equal(flax_finite, f)
    # The run is not trivial: the scale grew, backed off and sat at the minimum.
    assert ours.max() > INITIAL
    assert ours.min() == MIN
    assert len(np.unique(ours)) > 5


def test_flax_growth_interval_equal_to_period_lags_one_step():
    """The documented difference: with growth_interval=P flax grows one step later."""
    f = np.ones(2 * PERIOD + 2, bool)
    scaler = alj.dynamic(initial_scale=INITIAL, period=PERIOD, min_loss_scale=MIN)
    ours, _ = jax.device_get(ours_trajectory(scaler, jnp.asarray(f)))
    lagging, _ = jax.device_get(flax_trajectory(PERIOD, MIN, INITIAL, jnp.asarray(~f)))
    first_ours = int(np.argmax(ours > INITIAL))
    first_flax = int(np.argmax(lagging > INITIAL))
    assert first_ours == PERIOD - 1  # step index of the P-th finite step
    assert first_flax == first_ours + 1


def test_jmp_parity_at_the_fp32_ceiling():
    # jmp keeps the scale when doubling overflows fp32; ours stops at max_loss_scale=2**127.
    f = np.array([t % 7 != 6 for t in range(STEPS)])
    scaler = alj.dynamic(initial_scale=2.0**100, period=1, max_loss_scale=2.0**127)
    ours, _ = jax.device_get(ours_trajectory(scaler, jnp.asarray(f)))
    theirs = jax.device_get(jmp_trajectory(1, 1.0, 2.0**100, jnp.asarray(f)))
    np.testing.assert_array_equal(ours, theirs)
    assert ours.max() == 2.0**127 and np.all(np.isfinite(ours))


# --- Through real fp16 gradients -------------------------------------------------


@jax.custom_vjp
def poison(x, mult):
    """Identity forward; the gradient is multiplied by ``mult`` (1, inf or NaN)."""
    return x


def _poison_fwd(x, mult):
    return x, mult


def _poison_bwd(mult, g):
    return g * mult.astype(g.dtype), None


poison.defvjp(_poison_fwd, _poison_bwd)


def fp16_loss(params, x, y, bad):
    p16 = jax.tree_util.tree_map(lambda p: p.astype(jnp.float16), params)
    h = jnp.tanh(x.astype(jnp.float16) @ p16["w1"] + p16["b1"])
    h = poison(h, bad)
    pred = h @ p16["w2"]
    return jnp.mean((pred - y.astype(jnp.float16)) ** 2)


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (8, 16), jnp.float32) * 0.5,
        "b1": jnp.zeros((16,), jnp.float32),
        "w2": jax.random.normal(k2, (16, 1), jnp.float32) * 0.5,
    }


def data(steps):
    kx, ky = jax.random.split(jax.random.key(1))
    return (
        jax.random.normal(kx, (steps, 32, 8)),
        jax.random.normal(ky, (steps, 32, 1)),
    )


LR = 2.0**-5
REAL_STEPS = 60
REAL_BAD = {5, 6, 21, 33, 34, 35, 50}
REAL_NAN = {6, 34}  # NaN instead of inf on these


@pytest.mark.parametrize("period", [2, 4])
def test_real_gradients_same_scales_and_skips_as_flax(period):
    # The initial scale 2**20 overflows fp16 by itself (the scaled cotangent becomes inf
    # on its cast to fp16), so both scalers first back off for real, then meet the
    # injected infs.
    initial = 2.0**20
    xs, ys = data(REAL_STEPS)
    bad = jnp.asarray(
        [np.nan if t in REAL_NAN else np.inf if t in REAL_BAD else 1.0 for t in range(REAL_STEPS)],
        jnp.float32,
    )
    sgd = optax.sgd(LR)
    tx = alj.loss_scaled(sgd, alj.dynamic(initial_scale=initial, period=period))

    @jax.jit
    def ours(params, opt_state):
        def step(carry, batch):
            params, opt_state = carry
            used = alj.scale_state(opt_state).loss_scale
            loss, grads, stats = alj.value_and_grad(fp16_loss)(opt_state, params, *batch)
            updates, opt_state = tx.update(grads, opt_state, params, loss=loss,
                                           scale_stats=stats)
            params = optax.apply_updates(params, updates)
            st = alj.scale_state(opt_state)
            return (params, opt_state), (used, st.loss_scale, st.last_applied, loss)

        return jax.lax.scan(step, (params, opt_state), (xs, ys, bad))

    @jax.jit
    def theirs(params, opt_state, ds):
        def step(carry, batch):
            params, opt_state, ds = carry
            used = ds.scale
            ds, finite, loss, grads = ds.value_and_grad(fp16_loss)(params, *batch)
            updates, new_opt_state = sgd.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params = alj.select_tree(finite, new_params, params)
            opt_state = alj.select_tree(finite, new_opt_state, opt_state)
            return (params, opt_state, ds), (used, ds.scale, finite, loss)

        return jax.lax.scan(step, (params, opt_state, ds), (xs, ys, bad))

    params = init_params()
    (p_ours, _), out_ours = ours(params, tx.init(params))
    ds = DynamicScale(
        growth_interval=period - 1, scale=jnp.asarray(initial, jnp.float32), minimum_scale=1.0
    )
    (p_theirs, _, _), out_theirs = theirs(params, sgd.init(params), ds)
    used, scale, applied, loss = jax.device_get(out_ours)
    used_f, scale_f, finite_f, loss_f = jax.device_get(out_theirs)

    np.testing.assert_array_equal(used, used_f)
    np.testing.assert_array_equal(scale, scale_f)
    np.testing.assert_array_equal(applied, finite_f)
    np.testing.assert_array_equal(loss, loss_f)
    jax.tree_util.tree_map(np.testing.assert_array_equal, p_ours, p_theirs)
    # Both skipped every injected step and, at first, real fp16 overflows as well.
    skipped = set(np.flatnonzero(~applied).tolist())
    assert REAL_BAD <= skipped
    assert 0 in skipped and used[0] == initial
    assert scale[-1] > 1.0 and np.all(np.isfinite(loss))
