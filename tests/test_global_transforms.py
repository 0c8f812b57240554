"""Optax transformations: twin runs against an unscaled control, skips, checkpoints."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import adaloss_jax as alj

STEPS = 12
BAD_STEPS = (3, 7, 8)
LR = 1e-2


def init_params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": (jax.random.normal(k1, (6, 12)) * 0.5).astype(dtype),
        "b1": jnp.zeros((12,), dtype),
        "w2": (jax.random.normal(k2, (12, 1)) * 0.5).astype(dtype),
    }


def batches(steps=STEPS):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (steps, 16, 6)), jax.random.normal(ky, (steps, 16, 1))


def loss_fn(params, x, y, compute_dtype=jnp.float32):
    p = jax.tree_util.tree_map(lambda a: a.astype(compute_dtype), params)
    h = jnp.tanh(x.astype(compute_dtype) @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y.astype(compute_dtype)) ** 2)


def inject(grads, bad):
    """Puts an inf into one gradient element when ``bad``."""
    w1 = grads["w1"]
    return {**grads, "w1": w1.at[0, 0].set(jnp.where(bad, jnp.inf, w1[0, 0]))}


INNER = optax.adamw(LR, weight_decay=1e-2)
POLICY = alj.dynamic(initial_scale=2.0**10, period=4)
TX = optax.chain(alj.unscale(POLICY), alj.skip_nonfinite(INNER))


@jax.jit
def control_step(params, opt_state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


GRAD = jax.jit(jax.grad(loss_fn))


@functools.partial(jax.jit, static_argnums=(0, 1))
def scaled_step(tx, compute_dtype, params, opt_state, x, y, bad, loss_override=None):
    loss, grads, stats = alj.value_and_grad(loss_fn)(opt_state, params, x, y, compute_dtype)
    grads = inject(grads, bad)
    if loss_override is not None:
        loss = loss_override
    # What the inner optimizer is handed: the unscaled gradients (NaN when skipped).
    handed, _ = alj.unscale(POLICY).update(grads, alj.scale_state(opt_state), scale_stats=stats)
    updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
    return optax.apply_updates(params, updates), opt_state, handed


def run_scaled(params, opt_state, steps, tx=TX, compute_dtype=jnp.float32, start=0):
    xs, ys = batches()
    history = []
    for t in range(start, start + steps):
        params, opt_state, handed = scaled_step(
            tx, compute_dtype, params, opt_state, xs[t], ys[t], jnp.asarray(t in BAD_STEPS)
        )
        history.append((params, opt_state, handed))
    return history


def tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True) for x, y in zip(la, lb)
    )


def trees_close(a, b, rtol=2.0**-20):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        x.dtype == y.dtype and np.allclose(x, y, rtol=rtol, atol=rtol * float(np.abs(y).max()))
        for x, y in zip(la, lb)
    )


def test_twin_run_matches_control_that_skips_explicitly():
    params = init_params()
    xs, ys = batches()
    history = run_scaled(params, TX.init(params), STEPS)
    c_params, c_state = params, INNER.init(params)
    scale = 2.0**10
    finite_run = 0
    prev = params
    for t, (p, s, handed) in enumerate(history):
        if t not in BAD_STEPS:  # the control simply does not step on injected steps
            c_params, c_state = control_step(c_params, c_state, xs[t], ys[t])
            # Power-of-two scaling is exact in fp32: at the same parameters AdamW is
            # handed the very bits of the unscaled gradient.
            assert tree_equal(handed, GRAD(prev, xs[t], ys[t])), f"gradients differ at {t}"
            finite_run += 1
            if finite_run == 4:
                scale, finite_run = scale * 2, 0
        else:
            assert bool(alj._skip.is_skip_signal(handed))
            scale, finite_run = scale / 2, 0
        # From identical gradients AdamW computes the same values, but XLA:CPU may round
        # its second-moment update differently (fma contraction) when the same optax
        # code is compiled inside skip_nonfinite's selects rather than on its own: up to
        # 1 ulp per step. So params and Adam state are compared to a few ulps (2**-20
        # relative), which is far below one skipped or mis-applied step (~LR).
        assert trees_close(p, c_params), f"params differ at step {t}"
        assert trees_close(s[1].inner_state, c_state), f"adam state differs at step {t}"
        prev = p
        st = alj.scale_state(s)
        assert float(st.loss_scale) == scale, t
        assert bool(st.last_applied) == (t not in BAD_STEPS)
    st = alj.scale_state(history[-1][1])
    assert int(st.total_skipped) == len(BAD_STEPS)
    assert int(st.total_applied) == STEPS - len(BAD_STEPS)
    assert int(st.total_nonfinite_loss) == 0
    # The control really moved (so the equality above is not trivial).
    assert not tree_equal(c_params, params)


def test_skipped_step_keeps_params_and_inner_state_and_backs_off():
    params = init_params()
    history = run_scaled(params, TX.init(params), 4)
    before_p, before_s = history[2][:2]
    after_p, after_s = history[3][:2]  # step 3 is injected
    assert tree_equal(before_p, after_p)
    assert tree_equal(before_s[1], after_s[1])
    b, a = alj.scale_state(before_s), alj.scale_state(after_s)
    assert float(a.loss_scale) == float(b.loss_scale) / 2
    assert not bool(a.last_applied)
    assert (int(a.total_skipped), int(a.notfinite_count)) == (1, 1)
    assert int(a.finite_count) == 0


def test_nonfinite_loss_skips_without_backing_off():
    params = init_params()
    opt_state = TX.init(params)
    xs, ys = batches()
    p1, s1, _ = scaled_step(TX, jnp.float32, params, opt_state, xs[0], ys[0], jnp.asarray(False))
    p2, s2, _ = scaled_step(
        TX, jnp.float32, p1, s1, xs[1], ys[1], jnp.asarray(False), jnp.asarray(jnp.nan)
    )
    assert tree_equal(p1, p2)
    assert tree_equal(s1[1], s2[1])
    a, b = alj.scale_state(s1), alj.scale_state(s2)
    assert float(b.loss_scale) == float(a.loss_scale)
    assert int(b.finite_count) == int(a.finite_count) == 1
    assert not bool(b.last_applied)
    assert (int(b.total_skipped), int(b.total_nonfinite_loss)) == (1, 1)


def test_without_skip_nonfinite_a_skip_is_a_zero_gradient_step():
    # Documented: on a skipped step unscale hands on -0.0; without skip_nonfinite the
    # inner optimizer takes a zero-gradient step (finite parameters, never NaN), and the
    # skip is still counted in the scaler's state.
    tx = optax.chain(alj.unscale(POLICY), INNER)
    params = init_params()
    history = run_scaled(params, tx.init(params), 4, tx=tx)
    p3, s3, _ = history[3]
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(p3))
    before = float(alj.scale_state(history[2][1]).loss_scale)
    assert float(alj.scale_state(s3).loss_scale) == before / 2
    assert not bool(alj.scale_state(s3).last_applied)


def test_skip_signal_is_negative_zero_and_recognised():
    grads = {"a": jnp.asarray([1.0, -2.0]), "b": jnp.zeros((2, 2))}
    skipped = jax.jit(alj._skip.signal_skip)(grads, jnp.asarray(False))
    assert all(bool(jnp.all(jnp.signbit(x) & (x == 0))) for x in jax.tree_util.tree_leaves(skipped))
    assert bool(alj._skip.is_skip_signal(skipped))
    # Real gradients, even all-zero ones (+0.0), are never taken for the signal.
    assert not bool(alj._skip.is_skip_signal(grads))
    assert not bool(alj._skip.is_skip_signal({"b": jnp.zeros(3)}))


def test_unscale_gives_unscaled_fp32_updates():
    tx = optax.chain(alj.unscale(alj.static(2.0**4)), alj.skip_nonfinite(optax.sgd(1.0)))
    state = tx.init({"w": jnp.zeros(3, jnp.float16)})
    grads = {"w": jnp.asarray([16.0, 2.0**-20, 64.0], jnp.float16)}
    stats = alj.LossScaleStats(loss_scale=jnp.float32(2.0**4))
    updates, state = jax.jit(lambda g, s: tx.update(g, s, scale_stats=stats))(grads, state)
    assert updates["w"].dtype == jnp.float32
    # 2**-20 / 16 = 2**-24 is below fp16's normal range: kept because we unscale in fp32.
    np.testing.assert_array_equal(updates["w"], np.asarray([-1.0, -(2.0**-24), -4.0]))


FP16_STEPS = 10


def test_fp16_model_agrees_with_fp32_twin_where_not_skipped():
    # fp32 master weights, fp16 compute, scale 2**10, plain SGD so the error does not get
    # amplified by Adam's normalisation. Per step the fp16 gradient carries a relative
    # error of a few fp16 ulps (2**-11 each, through ~3 roundings per layer; measured
    # ~2**-10), so compare the updates with rtol 2**-7 of the update norm, and the params
    # after t steps within that error accumulated: t * 2**-6 * max|update|.
    inner = optax.sgd(0.1)
    tx = optax.chain(alj.unscale(alj.dynamic(initial_scale=2.0**10, period=4)),
                     alj.skip_nonfinite(inner))
    params = init_params()
    h16 = run_scaled(params, tx.init(params), FP16_STEPS, tx=tx, compute_dtype=jnp.float16)
    h32 = run_scaled(params, tx.init(params), FP16_STEPS, tx=tx, compute_dtype=jnp.float32)
    prev16 = prev32 = params
    for t in range(FP16_STEPS):
        (p16, s16, _), (p32, s32, _) = h16[t], h32[t]
        a16, a32 = alj.scale_state(s16), alj.scale_state(s32)
        assert bool(a16.last_applied) == bool(a32.last_applied) == (t not in BAD_STEPS)
        assert float(a16.loss_scale) == float(a32.loss_scale)
        for k in params:
            u16, u32 = p16[k] - prev16[k], p32[k] - prev32[k]
            if t in BAD_STEPS:
                assert not np.any(u16) and not np.any(u32)
                continue
            err = float(jnp.linalg.norm(u16 - u32))
            assert err <= 2.0**-7 * float(jnp.linalg.norm(u32)), (t, k, err)
            np.testing.assert_allclose(
                p16[k], p32[k], rtol=0, atol=(t + 1) * 2.0**-6 * float(jnp.abs(u32).max())
            )
        prev16, prev32 = p16, p32
    # fp16 really differed from fp32 (a real tolerance check, not an identity).
    assert not tree_equal(h16[-1][0], h32[-1][0])


def test_scale_state_errors_on_none_or_two():
    params = init_params()
    with pytest.raises(ValueError, match="found 0"):
        alj.scale_state(optax.adamw(LR).init(params))
    two = optax.chain(alj.unscale(POLICY), alj.unscale(alj.static()), INNER)
    with pytest.raises(ValueError, match="found 2"):
        alj.scale_state(two.init(params))
    with pytest.raises(ValueError, match="exactly one scaler state"):
        alj.value_and_grad(loss_fn)(optax.sgd(LR).init(params), params, *batches(1))
    st = POLICY.init()
    assert alj.scale_state(st) is st


@pytest.mark.parametrize(
    "scaler",
    [optax.adam(1e-3), jmp.DynamicLossScale(jnp.float32(2.0**15)), 2.0**15, None],
    ids=["optax", "jmp", "float", "none"],
)
def test_unscale_refuses_non_scaler(scaler):
    with pytest.raises(TypeError, match="scaler"):
        alj.unscale(scaler)


def test_checkpoint_mid_run_continues_bitwise(tmp_path):
    params = init_params()
    full = run_scaled(params, TX.init(params), STEPS)
    mid = 5
    p_mid, s_mid = full[mid - 1][:2]
    alj.checkpoint.save_state(tmp_path / "params.msgpack", p_mid)
    alj.checkpoint.save_state(tmp_path / "opt.msgpack", s_mid)

    # A fresh process would rebuild the templates from the same code.
    fresh = init_params()
    p_loaded = alj.checkpoint.load_state(tmp_path / "params.msgpack", fresh)
    s_loaded = alj.checkpoint.load_state(tmp_path / "opt.msgpack", TX.init(fresh))
    assert tree_equal(p_loaded, p_mid)
    assert tree_equal(s_loaded, s_mid)
    assert isinstance(alj.scale_state(s_loaded), alj.LossScaleState)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(s_loaded))

    rest = run_scaled(p_loaded, s_loaded, STEPS - mid, start=mid)
    for t, (p, s, _) in enumerate(rest, start=mid):
        assert tree_equal(p, full[t][0]), t
        assert tree_equal(s, full[t][1]), t


def test_checkpoint_of_a_scale_state_keeps_every_field(tmp_path):
    st = alj.scale_state(run_scaled(init_params(), TX.init(init_params()), 4)[-1][1])
    alj.checkpoint.save_state(tmp_path / "s", st)
    back = alj.checkpoint.load_state(tmp_path / "s", POLICY.init())
    assert isinstance(back, alj.LossScaleState)
    for field in alj.LossScaleState._fields:
        a, b = getattr(st, field), getattr(back, field)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
    assert not bool(back.last_applied) and int(back.total_skipped) == 1


@pytest.mark.parametrize(
    "make_template,where,what",
    [
        (
            lambda p: TX.init({**p, "w2": jnp.zeros((12, 2))}),
            "1/inner_state/0/mu/w2",
            "shape",
        ),
        (
            lambda p: TX.init({**p, "b1": p["b1"].astype(jnp.float16)}),
            "1/inner_state/0/mu/b1",
            "dtype",
        ),
        (
            lambda p: optax.chain(alj.unscale(POLICY), alj.skip_nonfinite(optax.sgd(LR))).init(p),
            "/1/inner_state/",
            "",
        ),
        (lambda p: INNER.init(p), "at /0/count", "missing"),
        (lambda p: TX.init({**p, "extra": jnp.zeros(2)}), "extra", "missing"),
    ],
    ids=["shape", "dtype", "inner-optimizer", "no-scale-state", "extra-param"],
)
def test_mismatched_checkpoint_is_refused(tmp_path, make_template, where, what):
    params = init_params()
    state = TX.init(params)
    alj.checkpoint.save_state(tmp_path / "opt", state)
    template = make_template(params)
    snapshot = jax.tree_util.tree_map(np.asarray, template)
    with pytest.raises(ValueError, match="does not match") as info:
        alj.checkpoint.load_state(tmp_path / "opt", template)
    msg = str(info.value)
    assert where in msg and what in msg, msg
    # Nothing was changed: the template and the file are as they were.
    assert tree_equal(jax.tree_util.tree_map(np.asarray, template), snapshot)
    assert tree_equal(alj.checkpoint.load_state(tmp_path / "opt", TX.init(params)), state)


def test_gradients_without_their_scale_statistics_are_refused():
    """Gradients of an unscaled loss (plain jax.grad) handed to the unscale would be
    divided by the loss scale all the same (2^15 too small): without the statistics the
    gradient function returns with the scaled gradients, the update is refused at trace
    time; the state of another model is refused with a message, not a broadcasting
    error."""
    params = init_params()
    x, y = (b[0] for b in batches(1))
    opt_state = TX.init(params)
    plain = jax.grad(loss_fn)(params, x, y)
    with pytest.raises(ValueError, match="unscale needs scale_stats"):
        TX.update(plain, opt_state, params)
    other = {**params, "w9": jnp.zeros((3, 3))}
    _, grads, stats = alj.value_and_grad(loss_fn)(opt_state, params, x, y)
    with pytest.raises(ValueError, match="another model"):
        TX.update(grads, TX.init(other), params, scale_stats=stats)


def test_loss_side_helpers():
    params = init_params()
    opt_state = TX.init(params)
    x, y = (b[0] for b in batches(1))
    scale = float(alj.scale_state(opt_state).loss_scale)

    @jax.jit
    def both(opt_state, params):
        scaled = alj.scale_loss(loss_fn(params, x, y), opt_state)
        aux_fn = lambda p: (loss_fn(p, x, y), {"n": jnp.int32(3)})
        (loss, aux), grads, _ = alj.value_and_grad(aux_fn, has_aux=True)(opt_state, params)
        manual = jax.grad(lambda p: alj.scale_loss(loss_fn(p, x, y), opt_state))(params)
        return scaled, loss, aux, grads, manual

    scaled, loss, aux, grads, manual = both(opt_state, params)
    assert scaled.dtype == jnp.float32
    assert float(scaled) == float(loss) * scale  # the loss is reported unscaled
    assert int(aux["n"]) == 3
    assert tree_equal(grads, manual)
    assert tree_equal(jax.tree_util.tree_map(lambda g: g / scale, grads), GRAD(params, x, y))


def test_an_adaptive_state_is_refused_where_one_global_scale_is_read():
    """The global gradient function and the probes read one scale; an adaptive state
    holds one per group, and taking its root's would be silently wrong."""
    params = init_params()
    x, y = (b[0] for b in batches(1))
    state = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive()).init(params)
    with pytest.raises(TypeError, match="adaptive_value_and_grad"):
        alj.value_and_grad(loss_fn)(state, params, x, y)
    assert float(alj.numerics.loss_scale_of(state)) == 2.0**15  # one group: its one scale
    per_module = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module"))
    with pytest.raises(TypeError, match="scale_table"):
        alj.numerics.loss_scale_of(per_module.init({"a": {"w": jnp.ones(2)}}))
