"""Gradient accumulation with adaptive scaling (docs/accumulation.md).

The idiom: ``alj.adaptive_scaled(optax.MultiSteps(inner, k).gradient_transformation(),
scaler)``, the accumulation inside the scaling. Each microbatch is unscaled at the scales
it was computed at (they move between microbatches: retries, overflows), and a skipped
microbatch is left out of the window (``skip_nonfinite`` keeps ``MultiSteps``' state), so
the window averages ``k`` applied microbatches. Checked against an fp32 reference
accumulation: ``jax.grad`` of the same model computing in fp32, ``optax.MultiSteps(
optax.sgd)`` over the same microbatches.

The other arrangements, and what they do instead:

- ``optax.chain(adaptive_unscale(scaler), MultiSteps(inner, k))``: unscales per
  microbatch, but averages a skipped microbatch's ``-0.0`` in as a zero gradient (and
  counts it in the window); with a ``should_skip_update_fn`` that recognises the skip
  signal it is the idiom.
- ``MultiSteps(adaptive_scaled(inner, scaler), k)`` would accumulate *scaled* gradients
  and unscale their mean at the last microbatch's scales (wrong whenever the scales
  moved inside a window: the first window, any retry), and an overflowing microbatch's
  inf would enter the accumulator, skip the window and leave it NaN for good: the
  gradient function refuses it.

Tolerance: the fp16 path computes in fp16 (11 significant bits: every activation and
cotangent rounded to a relative 2**-11), the reference in fp32. A parameter gradient is a
sum over the batch of products of a few such values, so the accumulated update of a leaf
carries a few units of 2**-11 of its largest element; the tests allow ``TOL = 2**-7``
(16 units) of the largest element of the reference's update of the leaf. A
microbatch unscaled at a wrong scale is off by a factor of two or more, and a skip
averaged in as a zero drops a microbatch from the mean: both far outside.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaloss_jax as alj
from adaloss_jax._skip import is_skip_signal

K = 2  # microbatches per window
LR = 0.5
TOL = 2.0**-7
C = 2.0**-10  # every microbatch's loss weight: small gradients, where fp16 needs scaling
BIG = C * 2.0**8  # a microbatch 2**8 larger: more than the scaler's 4 binades of margin,
#                   so its gradients overflow fp16 at the scales C's statistics set
WARM = 2.0**22  # a start a few binades below those scales: the first pass is applied
#                 without a retry (needed with retries=0; the tests check it)

_layer0 = alj.scale_group("layer0")(
    lambda p, x: jnp.tanh(x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype)))
_layer1 = alj.scale_group("layer1")(
    lambda p, x: x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype))


def _loss(params, x, y, c):
    """Two dense layers computing in ``x``'s dtype (fp32 master parameters cast inside),
    the squared error in fp32, times the microbatch's weight ``c``."""
    out = _layer1(params["layer1"], _layer0(params["layer0"], x))
    return c * jnp.mean((out.astype(jnp.float32) - y) ** 2)


_k0, _k1, _k2 = jax.random.split(jax.random.key(0), 3)
PARAMS = {"layer0": {"w": jax.random.normal(_k0, (8, 8)) / 3, "b": jnp.zeros(8)},
          "layer1": {"w": jax.random.normal(_k1, (8, 4)) / 3, "b": jnp.zeros(4)}}
XS = jax.random.normal(_k2, (5, 16, 8))  # 5 microbatches of 16
YS = jnp.tanh(2 * XS[..., :4])

PLAIN = [(i, C) for i in range(4)]  # two windows
OVERFLOW = [(0, C), (1, C), (2, BIG), (3, C), (4, C)]  # microbatch 2 overflows at its scales
# (at the planned ones: a scale chosen in its own backward pass holds it)
NONFINITE = [(0, C), (1, C), (2, float("inf")), (3, C), (4, C)]  # microbatch 2's loss is
#                                                               not finite at any scale


def _skip_signal(updates, gradient_step, params):
    """A ``should_skip_update_fn`` for ``optax.MultiSteps``: a skipped step's signal."""
    del gradient_step, params
    return is_skip_signal(updates), ()


def _arrangement(name, scaler):
    if name == "recommended":
        return alj.adaptive_scaled(optax.MultiSteps(optax.sgd(LR), K).gradient_transformation(),
                                   scaler)
    if name == "chain":
        return optax.chain(alj.adaptive_unscale(scaler),
                           optax.MultiSteps(optax.sgd(LR), K).gradient_transformation())
    if name == "chain+should_skip":
        return optax.chain(alj.adaptive_unscale(scaler),
                           optax.MultiSteps(optax.sgd(LR), K, should_skip_update_fn=_skip_signal)
                           .gradient_transformation())
    if name == "outside":
        return optax.MultiSteps(alj.adaptive_scaled(optax.sgd(LR), scaler),
                                K).gradient_transformation()
    raise ValueError(name)


def _multi_steps_state(name, opt_state):
    return {"recommended": lambda s: s[1].inner_state, "chain": lambda s: s[1],
            "chain+should_skip": lambda s: s[1]}[name](opt_state)


@functools.cache
def _step(name, retries, initial_scale):
    """The arrangement and its jitted training step (compiled once per configuration, for
    every test that uses it)."""
    tx = _arrangement(name, alj.adaptive(groups="module", retries=retries,
                                         initial_scale=initial_scale,
                                         max_rise=5))  # (log2(factor) + 1: a step after
    # one backoff is applied, one far below its scale retried)

    @jax.jit
    def step(params, opt_state, x, y, c):
        loss, grads, stats = alj.adaptive_value_and_grad(_loss)(
            opt_state, params, x.astype(jnp.float16), y, c)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, updates), opt_state, stats.log2_scales

    return tx, step


@dataclasses.dataclass
class After:
    """The state after one microbatch."""

    params: dict
    applied: bool  # the scaler's verdict on the last step it took
    retries: int  # the scaler's retries so far
    used: dict  # group -> the log2 scale this microbatch's gradients were computed at
    mini_step: int  # MultiSteps' counters
    gradient_step: int
    finite_accumulator: bool


@functools.cache
def _run(name, retries, initial_scale, batches):
    tx, step = _step(name, retries, initial_scale)
    params, opt_state = PARAMS, tx.init(PARAMS)
    out = []
    for i, c in batches:
        params, opt_state, used = step(params, opt_state, XS[i], YS[i], jnp.float32(c))
        st, ms = alj.scale_state(opt_state), _multi_steps_state(name, opt_state)
        out.append(After(params, bool(st.last_applied), int(st.total_retries),
                         dict(zip(used.names, np.asarray(used.array).tolist())),
                         int(ms.mini_step), int(ms.gradient_step),
                         bool(alj.all_finite(ms.acc_grads))))
    return out


_REF = optax.MultiSteps(optax.sgd(LR), K)


@jax.jit
def _ref_step(params, state, x, y, c):
    updates, state = _REF.update(jax.grad(_loss)(params, x, y, c), state, params)
    return optax.apply_updates(params, updates), state


def _reference(batches):
    """fp32 parameters after ``MultiSteps(sgd)`` over the microbatches (fp32 compute)."""
    params, state = PARAMS, _REF.init(PARAMS)
    for i, c in batches:
        params, state = _ref_step(params, state, XS[i], YS[i], jnp.float32(c))
    return params


def _error(got, ref, start=PARAMS):
    """Per leaf: the largest difference, in units of the largest element of the
    reference's update from ``start``."""
    def err(g, r, p0):
        return float(np.max(np.abs(g - r)) / np.max(np.abs(r - p0)))
    return jax.tree.leaves(jax.tree.map(err, got, ref, start))


def assert_matches(got, ref, start=PARAMS):
    errs = _error(got, ref, start)
    assert max(errs) <= TOL, errs


def assert_unchanged(got, before):
    jax.tree.map(np.testing.assert_array_equal, got, before)


# ------------------------------------------------------------------------- the idiom


def test_two_windows_match_fp32():
    run = _run("recommended", 4, 1.0, tuple(PLAIN))
    assert_matches(run[1].params, _reference(PLAIN[:2]))
    assert_matches(run[3].params, _reference(PLAIN))
    assert_unchanged(run[0].params, PARAMS)  # mid-window: nothing applied yet
    assert_unchanged(run[2].params, run[1].params)
    assert [a.gradient_step for a in run] == [0, 1, 1, 2]
    assert all(a.applied for a in run)
    # Step 0 ran its loss at scale 1, but every region below the loss's cast chose its
    # scale in the backward pass: nothing to compute again.
    assert run[0].retries == 0


def test_a_microbatch_at_other_scales_is_unscaled_at_its_own():
    """Microbatch 2 (``BIG``) runs at the scales it chooses in its own backward pass,
    8 binades below microbatch 1's; microbatch 3, whose rule's scales (the cap on its
    choices) came from microbatch 2, is computed again at higher ones. The window's two
    microbatches ran at different scales, and each is unscaled at its own."""
    batches = tuple(OVERFLOW[:4])
    run = _run("recommended", 4, 1.0, batches)
    assert_matches(run[1].params, _reference(batches[:2]))
    assert_matches(run[3].params, _reference(batches))
    assert all(a.applied for a in run)
    assert run[2].retries == run[1].retries  # held at the scales it chose
    assert run[2].used != run[3].used, (run[2].used, run[3].used)
    assert run[3].retries > run[2].retries  # microbatch 3 was retried up from them


@pytest.mark.parametrize("name", ["recommended", "chain+should_skip"])
def test_skipped_microbatch_is_left_out_of_the_window(name):
    run = _run(name, 0, WARM, tuple(NONFINITE))
    assert [a.applied for a in run] == [True, True, False, True, True]
    # The skip is as if it never happened: the second window is microbatches 3 and 4,
    # their mean is fp32's.
    assert_matches(run[4].params, _reference([NONFINITE[i] for i in (0, 1, 3, 4)]))
    assert_unchanged(run[2].params, run[1].params)
    assert_unchanged(run[3].params, run[1].params)
    assert [a.mini_step for a in run] == [1, 0, 0, 1, 0]
    assert [a.gradient_step for a in run] == [0, 1, 1, 1, 2]


# ---------------------------------------------------------- the other arrangements


def test_a_microbatch_2_to_the_8_larger_is_applied_at_the_scales_it_chooses():
    """Per module every scale of microbatch 2 (``BIG``, 8 binades above the others) is
    chosen in its own backward pass, the root's at the loss's cast: nothing overflows,
    and the step is applied (the planned scales, set from microbatch 1, overflowed)."""
    run = _run("recommended", 0, WARM, tuple(OVERFLOW[:3]))
    assert [a.applied for a in run] == [True, True, True]
    assert run[2].used[""] <= run[1].used[""] - 8


def test_chain_without_should_skip_averages_a_skip_in_as_zero():
    run = _run("chain", 0, WARM, tuple(NONFINITE))
    assert [a.applied for a in run] == [True, True, False, True, True]
    # The skip counts in the window, which closes at microbatch 3 ...
    assert [a.gradient_step for a in run] == [0, 1, 1, 2, 2]
    # ... as the mean of a zero gradient and microbatch 3's.
    as_zero = [(0, C), (1, C), (2, 0.0), (3, C)]
    assert_matches(run[3].params, _reference(as_zero))
    assert min(_error(run[3].params, _reference([(0, C), (1, C), (3, C), (4, C)]))) > 8 * TOL


_grad = jax.jit(jax.grad(_loss))


@pytest.mark.parametrize("family", ["adaptive", "global"])
def test_multisteps_outside_the_scaler_is_refused_with_the_idiom(family):
    """``MultiSteps(adaptive_scaled(inner, scaler), k)`` would accumulate *scaled*
    gradients of microbatches computed at different scales (each retried on its own
    statistics in the first window, at every overflow) and unscale their mean at the last
    one's, and an overflow's inf would stay in its accumulator (``0 * inf`` on reset) and
    skip every later window: refused where the gradient is taken, naming the idiom."""
    if family == "adaptive":
        tx = _arrangement("outside", alj.adaptive(groups="module"))
        grad = alj.adaptive_value_and_grad(_loss)
        fix = "adaloss_jax.adaptive_scaled(optax.MultiSteps(inner, k)"
    else:
        tx = optax.MultiSteps(alj.loss_scaled(optax.sgd(LR), alj.dynamic()),
                              K).gradient_transformation()
        grad = alj.value_and_grad(_loss)
        fix = "adaloss_jax.loss_scaled(optax.MultiSteps(inner, k)"
    with pytest.raises(ValueError, match="optax.MultiSteps wraps the scaler") as e:
        jax.jit(grad)(tx.init(PARAMS), PARAMS, XS[0].astype(jnp.float16), YS[0],
                      jnp.float32(1.0))
    assert fix in str(e.value)


# ------------------------------------------------------------- a global scaler, alike


@jax.jit
def _global_step(params, opt_state, x, y, c):
    loss, grads, stats = alj.value_and_grad(_loss)(opt_state, params, x.astype(jnp.float16),
                                                   y, c)
    updates, opt_state = _GLOBAL.update(grads, opt_state, params, loss=loss,
                                        scale_stats=stats)
    return optax.apply_updates(params, updates), opt_state


_GLOBAL = alj.loss_scaled(optax.MultiSteps(optax.sgd(LR), K).gradient_transformation(),
                          alj.dynamic(initial_scale=WARM))


def test_global_scaler_same_idiom():
    params, opt_state = PARAMS, _GLOBAL.init(PARAMS)
    applied = []
    for i, c in OVERFLOW:
        params, opt_state = _global_step(params, opt_state, XS[i], YS[i], jnp.float32(c))
        applied.append(bool(alj.scale_state(opt_state).last_applied))
    assert applied == [True, True, False, True, True]
    assert_matches(params, _reference([OVERFLOW[i] for i in (0, 1, 3, 4)]))
    assert int(optax.tree.get(opt_state, "gradient_step")) == 2
