"""Warm-up from the initial scale under same-step scales (``same_step=True``): no
retries, and the loss's own region, the root, decided in the step: measured before the
loss casts its cotangent down, at every cast the loss region leaves through, inside any
nested equation and around every transformation."""

from __future__ import annotations

import functools

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import assert_fp32_trees_close
from flax import linen as nn
from jax.sharding import PartitionSpec as P
from test_adaptive import _grads_through
from test_jax_transformations import (
    AROUND,
    _around,
    _jax_model,
    _mesh,
    _x,
    build,
)

import adaloss_jax as alj

SLOW = pytest.mark.slow



# ------------------------------------------------- warm-up from the initial scale, no retries


class _AttnBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=jnp.float16)(x)
        h = nn.LayerNorm(dtype=jnp.float16)(x)
        q, k, v = jnp.split(nn.Dense(24, dtype=jnp.float16)(h), 3, -1)
        s = (q @ k.swapaxes(-1, -2)).astype(jnp.float32) / jnp.sqrt(8.0)
        x = x + nn.Dense(8, dtype=jnp.float16)(jax.nn.softmax(s).astype(jnp.float16) @ v)
        return nn.Dense(10, dtype=jnp.float16)(x)


def _warm_up_skips(model, x, y, grad_dtype, steps=5, loss_scale=1.0, **options):
    """The steps skipped from the initial scale with nothing moving (SGD(0)), the rule
    alone (``retries=0``)."""
    from adaloss_jax.flax import TrainState, linen_train_step

    params = model.init(jax.random.key(2), x)["params"]

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * loss_scale

    scaler = alj.adaptive(groups="module", grad_dtype=grad_dtype, retries=0,
                          simulate=grad_dtype != "float16", **options)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    step = jax.jit(lambda s: linen_train_step(s, loss_fn, x, y))
    skipped = []
    for i in range(steps):
        state, _ = step(state)
        if not bool(alj.scale_state(state).last_applied):
            skipped.append(i)
    return skipped


def test_an_attention_block_keeps_room_for_its_kernel_sums_and_skips_nothing():
    """fp16, 512 x 8 tokens: the first choice of each Dense's scale comes from its
    output cotangent, and its kernel gradient sums 4096 rows of it; without the first
    choice's reserve, that sum overflowed and the step was skipped. From fp16's start
    nothing is skipped; from scale 1 (the root far below its scale) step 0 alone, with
    the reserve capped at 5 binades as well (without the reserve, step 1 was skipped
    too)."""
    x = jax.random.normal(jax.random.key(0), (512, 8, 16))
    y = jax.random.randint(jax.random.key(1), (512, 8), 0, 10)
    assert _warm_up_skips(_AttnBlock(), x, y, "float16") == []
    assert _warm_up_skips(_AttnBlock(), x, y, "float16", initial_scale=1.0,
                          max_rise=5) == [0]


def test_a_scanned_gpt_whose_cotangents_flush_in_e4m3_skips_only_step_0():
    """The bench's byte GPT, one scanned block, e4m3 cotangents, every scale the rule's
    (``same_step=False``): at step 0's scales cotangents on their way into some groups
    flush entirely, so those groups' statistics miss their largest values; the rule
    caps their rise at the jump that cannot overflow what was lost (without the cap,
    steps after 0 overflowed and were skipped). With same-step scales (the default) its
    regions decide in the pass and nothing is skipped."""
    from adaloss_jax.bench._models import GPT

    tokens = jax.random.randint(jax.random.key(0), (16, 64), 0, 256)
    model, x, y = GPT(layers=1, scan=True), tokens[:, :-1], tokens[:, 1:]
    assert _warm_up_skips(model, x, y, "float8_e4m3fn", same_step=False) == [0]
    assert _warm_up_skips(model, x, y, "float8_e4m3fn", steps=3) == []


@functools.cache
def _warmup_models():
    """``benchmarks/warmup_skips.py``'s models (the sweep's own), loaded once."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "warmup_skips.py"
    spec = importlib.util.spec_from_file_location("warmup_skips", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _PreNorm(nn.Module):
    """Two of the sweep's pre-norm attention blocks on a residual stream: each block's
    input is read by its LayerNorm and by its residual, a fan-in anchored by every group
    above."""

    @nn.compact
    def __call__(self, x):
        block = _warmup_models()._Block
        x = nn.Dense(16, dtype=jnp.float16)(x)
        x = block()(block()(x))
        return nn.Dense(10, dtype=jnp.float16)(x)


@pytest.mark.parametrize("model,grad_dtype,batch", [("attention", "float8_e4m3fn", 128),
                                                    ("attention", "float8_e5m2", 1024),
                                                    ("mlp", "float8_e5m2", 64)])
def test_a_residual_stream_chooses_its_scale_in_the_pass_and_skips_nothing(model,
                                                                            grad_dtype,
                                                                            batch):
    """fp8 from scale 1, the loss x 2^-20: a residual stream (a fan-in) ran at the min
    of its readers' planned scales, 1 at step 0, where its cotangent flushed and step 0
    was skipped. It now chooses its own scale where the backward pass first reaches it,
    from the cotangent in hand, so no step is skipped (the sweep's pre-norm blocks, two
    of them, and its ``residual`` model). In e5m2 over 8192 tokens a Dense kernel's
    gradient, summed in float16, needs more room above its entry than e4m3's
    ``max_rise`` (5, the first choice's cap) leaves: e5m2's is 10."""
    if model == "attention":
        x = jax.random.normal(jax.random.key(0), (batch, 8, 16))
        y = jax.random.randint(jax.random.key(1), (batch, 8), 0, 10)
        m = _PreNorm()
    else:
        x = jax.random.normal(jax.random.key(0), (batch, 16))
        y = jax.random.randint(jax.random.key(1), (batch,), 0, 10)
        m = _warmup_models()._Residual()
    assert _warm_up_skips(m, x, y, grad_dtype, steps=4, loss_scale=2.0**-20) == []


@pytest.mark.parametrize("model,grad_dtype,loss_log2", [
    ("_Remat", "float8_e4m3fn", 0), ("_Remat", "float8_e5m2", 0),
    ("_Remat", "float8_e4m3fn", -20), ("_RematScan", "float8_e5m2", -20)])
def test_modules_under_remat_decide_in_the_pass_and_skip_nothing(model, grad_dtype,
                                                                 loss_log2):
    """The sweep's ``remat`` model (residual blocks each under ``nn.remat``: the
    stream's readers sit in checkpoint bodies of their own) and ``remat-scan`` (a chain
    of ``nn.remat`` layers in one ``nn.scan``). A checkpoint body is in the scope around
    it (the tokens cross it as inputs and outputs), so the stream and the chain decide
    in the pass and step 0 is applied (they ran at the plan, and step 0 was skipped,
    steps 0-1 in e4m3 with the loss x 2^-20, while each body was a scope of its own)."""
    x = jax.random.normal(jax.random.key(0), (64, 12, 12, 1))  # (the sweep's batch)
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    assert _warm_up_skips(getattr(_warmup_models(), model)(), x, y, grad_dtype, steps=3,
                          loss_scale=2.0**loss_log2) == []


class _Wrapped(nn.Module):
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.inner(x)


@pytest.mark.parametrize("model,grad_dtype,loss_log2", [
    ("_HighwayScan", "float8_e4m3fn", 0), ("_ResidualScan", "float8_e4m3fn", -20),
    ("_ResidualScan", "float16", -20), ("gpt", "float8_e5m2", 0),
    ("wrapped-gpt", "float8_e4m3fn", 0), ("wrapped-gpt", "float16", -20),
    ("one-layer-gpt", "float8_e4m3fn", 0), ("one-layer-gpt", "float8_e5m2", -20)])
def test_a_scanned_stacks_stream_decides_in_the_pass_and_skips_nothing(model, grad_dtype,
                                                                       loss_log2):
    """The sweep's ``highway-scan`` and ``residual-scan`` and the bench's byte GPT with
    two blocks in one ``nn.scan``: the stream every layer reads and adds to (a fan-in per
    layer) decides at each layer's exit and the final LayerNorm or head after the
    stack at its own, so step 0 is applied (they ran at the plan, and step 0 was
    skipped in fp8, steps 0-1 with the loss x 2^-20, and step 0 in float16 there).
    The GPT inside a parent module: the embeddings' sum is the GPT module's region
    (its position embedding), entered only at the first layer's way in inside the
    body, which decides it there (it kept the plan, and step 0 was skipped in e4m3,
    and in float16 with the loss x 2^-20). The GPT with one block in its ``nn.scan``:
    the scan runs its body once, its points in the scope around it (they kept the plan,
    and step 0 was skipped in fp8, steps 0-1 in e5m2 with the loss x 2^-20)."""
    if model.endswith("gpt"):
        from adaloss_jax.bench._models import GPT

        tokens = jax.random.randint(jax.random.key(0), (16, 33), 0, 256)
        m, x, y = (GPT(layers=1 if model == "one-layer-gpt" else 2, d_model=32, context=32,
                       scan=True), tokens[:, :-1], tokens[:, 1:])
        if model == "wrapped-gpt":
            m = _Wrapped(m)
    else:
        m = getattr(_warmup_models(), model)()
        x = jax.random.normal(jax.random.key(0), (64, 12, 12, 1))  # (the sweep's batch)
        y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    assert _warm_up_skips(m, x, y, grad_dtype, steps=3, loss_scale=2.0**loss_log2) == []


@pytest.mark.parametrize("loss_log2", [0, -20])
def test_a_stream_that_grows_below_its_decider_is_held_by_its_first_choice(loss_log2):
    """The sweep's ``growing`` model in e4m3: the stream's cotangent grows by more below
    its last reader, where it decides, than a module's first choice keeps room for; its
    first choice puts it halfway down the span of float16, which holds the stream, so
    nothing is skipped (a module's first choice, and the readers' planned scales before
    fan-ins decided: docs/results.md, section 4)."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    assert _warm_up_skips(_warmup_models()._Growing(), x, y, "float8_e4m3fn", steps=4,
                          loss_scale=2.0**loss_log2) == []


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_a_gpt_whose_logits_cotangent_flushes_at_the_cast_skips_at_most_step_0(scan):
    """The bench's byte GPT (one block, tied head) in e4m3 with its loss x 2^-20, as in
    the bench's tiny regime. On the rule's scales alone (``same_step=False``): at step
    0 the logits' cotangent flushes where the loss casts it down, so every module
    receives zeros and the root, measured only on the cast's float32 side, is starved
    (what reached the embedding's end of its region was lost). Its jump lands that
    measured value at e4m3's smallest normal, leaving the range above for the tied
    head's kernel gradient (13 binades larger: a sum over 1024 tokens), so step 1 is
    applied; jumping by the blind jump alone, the cast flushed it again and step 1 was
    skipped too. Every group downstream received only zeros, computed from that value:
    each starts where it too would land at the smallest normal. With same-step scales
    (the default) the residual stream chooses its scale in the pass too, and step 0 is
    applied, the scan of one block as the unrolled block (it runs its body once; its
    stream kept its readers' planned scales before, and step 0 was skipped)."""
    from adaloss_jax.bench._models import GPT

    tokens = jax.random.randint(jax.random.key(0), (16, 65), 0, 256)
    model = GPT(layers=1, d_model=64, heads=4, context=64, scan=scan)
    for same_step, want in ((False, [0]), (None, [])):
        assert _warm_up_skips(model, tokens[:, :-1], tokens[:, 1:], "float8_e4m3fn",
                              steps=3, loss_scale=2.0**-20, same_step=same_step) == want


@pytest.mark.parametrize("grad_dtype", ["float16", "float8_e4m3fn"])
def test_the_root_is_measured_before_the_loss_casts_its_cotangent_down(grad_dtype):
    """A loss x 2^-30 (below the bench's tiny regime): at scale 1 the logits' cotangent
    flushes where the loss casts it down to float16, before any module's point sees it.
    A point on the cast's float32 side measures it there and converts it from the
    loss's seed scale (1) to the one the root chooses from it in the same backward pass,
    so the root's statistics after step 0 hold the fp32 amax of d loss / d logits (to
    fp16's rounding) and no step is skipped (measured but run at the seed scale below
    the cast, step 0 was skipped; measuring nothing, the root jumped blind and step 1
    was skipped too)."""
    from adaloss_jax.flax import TrainState, linen_train_step

    model = _models.MLP(depth=3, width=32)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    params = model.init(jax.random.key(2), x)["params"]

    def tiny(logits):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return ce.mean() * 2.0**-30

    scaler = alj.adaptive(groups="module", grad_dtype=grad_dtype, retries=0,
                          simulate=grad_dtype != "float16", initial_scale=1.0)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    step = jax.jit(lambda s: linen_train_step(
        s, lambda p, x: tiny(model.apply({"params": p}, x)), x))
    skipped = []
    for i in range(4):
        state, _ = step(state)
        st = alj.scale_state(state)
        if i == 0 and grad_dtype == "float16":
            logits = model.apply({"params": params}, x)
            want = jnp.log2(jnp.max(jnp.abs(jax.grad(tiny)(logits.astype(jnp.float32)))))
            assert float(want) < -25  # below fp16's smallest subnormal: flushed at the cast
            assert float(st.log2_amax[""]) == pytest.approx(float(want), abs=1e-3)
        if not bool(st.last_applied):
            skipped.append(i)
    assert skipped == []


def _chunked(ce, chunks=4):
    """``ce(logits, labels)`` (a mean over rows) computed chunk by chunk in a
    ``lax.scan``, each chunk's cast inside the body (a cross-entropy that never holds
    all float32 logits)."""
    def chunked(logits, labels):
        def body(total, chunk):
            return total + ce(*chunk), None
        split = lambda a: a.reshape(chunks, -1, *a.shape[1:])  # noqa: E731
        return jax.lax.scan(body, 0.0, (split(logits), split(labels)))[0] / chunks
    return chunked


def _switched(ce, taken=1):
    """``ce(logits, labels)`` in the branch a ``lax.switch`` takes (``taken``: the
    last, or the first); the other branch casts too."""
    other = lambda *a: 2.0 * ce(*a)  # noqa: E731
    return lambda logits, labels: jax.lax.switch(
        jnp.where(labels[0] >= 0, taken, 1 - taken), [ce, other] if taken == 0
        else [other, ce], logits, labels)


def _sharded(ce, check_vma=True):
    """``ce(logits, labels)`` per device in a ``shard_map`` over the batch on 2 devices
    (the mean of their means), each device's cast inside the body; typed, or not
    (``check_vma=False``)."""
    def sharded(logits, labels):
        per_device = lambda lg, lb: jax.lax.pmean(ce(lg, lb), "data")  # noqa: E731
        return jax.shard_map(per_device, mesh=_mesh(), in_specs=(P("data"), P("data")),
                             out_specs=P(), check_vma=check_vma)(logits, labels)
    return sharded


_WRAPS = {
    "jit": lambda loss, ce: jax.jit(loss),  # the whole loss jitted
    "jit-ce": lambda loss, ce: loss(ce=jax.jit(ce)),  # a jitted cross-entropy
    "remat": lambda loss, ce: jax.checkpoint(loss),
    "scan-ce": lambda loss, ce: loss(ce=_chunked(ce)),  # cast in each chunk
    "cond-ce": lambda loss, ce: loss(ce=_switched(ce)),  # a cast in each branch
    "cond-ce-first": lambda loss, ce: loss(ce=_switched(ce, taken=0)),
    "shard-ce": lambda loss, ce: loss(ce=_sharded(ce)),  # a cast on each device
    "shard-ce-untyped": lambda loss, ce: loss(ce=_sharded(ce, check_vma=False)),
}


@pytest.mark.parametrize("wrap", sorted(_WRAPS))
def test_a_loss_cast_inside_a_nested_equation_is_measured_before_it_narrows(wrap):
    """The loss of the test above (x 2^-30) jitted whole, its cross-entropy jitted on
    its own, the loss under ``jax.checkpoint``, its cross-entropy computed chunk by
    chunk in a ``scan``, per device in a ``shard_map`` or in a ``cond``'s branch: the
    cast sits inside a nested
    equation, and its point goes there (one per branch). The root's statistics after
    step 0 hold the fp32 amax at the cast. Where the cast and the model's points run in
    one scope (a nested ``jit`` is inlined; one checkpoint body around the whole loss)
    the root chooses its scale at the cast in step 0's backward pass, and no step is
    skipped; so too in a ``cond``'s branches (in the scope around them), where the
    root decides at the cast of the branch taken, the first or the last; where the
    cast runs per chunk or per device, the root's
    regions keep the planned scale and only step 0 is skipped (with no point inside,
    the root measured nothing, jumped blind, and step 1 was skipped too; a branch not
    taken, whose row stays zero, starved the root, held its jump below its statistics,
    and step 1 was refused as computed too low)."""
    from adaloss_jax.flax import TrainState, linen_train_step

    model = _models.MLP(depth=3, width=32)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    params = model.init(jax.random.key(2), x)["params"]

    def ce(logits, labels=y):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels).mean() * 2.0**-30

    def loss(p=None, x=None, ce=ce):
        if p is None:
            return lambda p, x: ce(model.apply({"params": p}, x), y)
        return ce(model.apply({"params": p}, x), y)

    loss_fn = _WRAPS[wrap](loss, ce)
    scaler = alj.adaptive(groups="module", retries=0, initial_scale=1.0)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    rec, _, _ = _grad_trace(loss_fn, scaler, params, x)
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16"] * (
        2 if wrap.startswith("cond-ce") else 1)
    step = jax.jit(lambda s: linen_train_step(s, loss_fn, x))
    logits = model.apply({"params": params}, x)
    want = float(jnp.log2(jnp.max(jnp.abs(jax.grad(ce)(logits.astype(jnp.float32))))))
    assert want < -25  # below fp16's smallest subnormal: flushed at the cast
    skipped = []
    for i in range(3):
        state, _ = step(state)
        st = alj.scale_state(state)
        if i == 0:
            assert float(st.log2_amax[""]) == pytest.approx(want, abs=1e-3)
        if not bool(st.last_applied):
            skipped.append(i)
    assert skipped == ([] if wrap in ("jit", "jit-ce", "remat", "cond-ce", "cond-ce-first")
                       else [0])


def test_one_jitted_cross_entropy_called_twice_gets_a_point_per_call_and_stays_exact():
    """A jitted cross-entropy called on two heads inside a jitted loss: jax hands both
    calls the same inner jaxpr, and each call site gets its own rebuilt copy with its
    own cast point (an fp16 model). An fp32 model with the same loss, scaled at
    arbitrary per-group scales, gets exact gradients."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    ce = jax.jit(lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean())

    def loss_of(model):
        def loss_fn(p, x, y):
            out = model.apply({"params": p}, x)
            return jax.jit(lambda o: ce(o, y) + ce(o * 2, (y + 1) % 4))(out)
        return loss_fn

    m16 = _models.MLP(depth=3, width=32)
    p16 = m16.init(jax.random.key(2), x)["params"]
    rec, _, _ = _grad_trace(loss_of(m16), alj.adaptive(groups="module"), p16, x, y)
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16", "float16"]

    m32 = _models.MLP(depth=3, width=32, dtype=jnp.float32)
    params = m32.init(jax.random.key(2), x)["params"]
    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    groups = alj.adaptive_unscale(scaler).init(params).groups
    log2 = dict(zip(groups, [5, -3, 9, 0, 12]))
    step, state = _grads_through(scaler, loss_of(m32), params, (x, y), log2)
    got, _, _ = step(state, params, x, y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss_of(m32)))(params, x, y))


@pytest.mark.parametrize("wrap", [_chunked, _switched, _sharded,
                                  functools.partial(_sharded, check_vma=False)],
                         ids=["scan", "cond", "shard_map", "shard_map_untyped"])
def test_a_cross_entropy_in_a_scan_or_cond_gets_its_points_and_stays_exact(wrap):
    """The points on the wide side of a cast inside a ``scan`` body (each chunk's), a
    ``shard_map``'s (each device's) or a ``cond``'s branches measure and leave the
    gradient as it is: an fp32 model whose loss casts its output there, at arbitrary
    per-group scales, gets exact gradients."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)

    def loss_of(model):
        def loss_fn(p, x, y):
            ce = wrap(lambda lg, labels: optax.softmax_cross_entropy_with_integer_labels(
                lg.astype(jnp.float32), labels).mean())
            return ce(model.apply({"params": p}, x), y)
        return loss_fn

    m16 = _models.MLP(depth=3, width=32)
    p16 = m16.init(jax.random.key(2), x)["params"]
    rec, _, _ = _grad_trace(loss_of(m16), alj.adaptive(groups="module"), p16, x, y)
    assert len(rec.casts) == (2 if wrap is _switched else 1)
    m32 = _models.MLP(depth=3, width=32, dtype=jnp.float32)
    params = m32.init(jax.random.key(2), x)["params"]
    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    groups = alj.adaptive_unscale(scaler).init(params).groups
    step, state = _grads_through(scaler, loss_of(m32), params, (x, y),
                                 dict(zip(groups, [5, -3, 9, 0, 12])))
    got, _, _ = step(state, params, x, y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss_of(m32)))(params, x, y))


_seed_a = alj.scale_group("seed_a")(lambda p, x: jnp.tanh(x @ p["w"].astype(x.dtype)))
_seed_b = alj.scale_group("seed_b")(lambda p, x: x @ p["w"].astype(x.dtype))
_SEED_PARAMS = {"seed_a": {"w": jax.random.normal(jax.random.key(5), (16, 32)) / 4},
                "seed_b": {"w": jax.random.normal(jax.random.key(6), (32, 4)) / 4},
                "bias": jnp.full((32,), 0.1), "shift": jnp.full((4,), 0.2),
                "temp": jnp.float32(1.5)}
_SEED_X = jax.random.normal(jax.random.key(7), (64, 16))
_SEED_Y = jax.random.randint(jax.random.key(8), (64,), 0, 4)


def _seed_loss(dtype, variant, tiny=1.0):
    """Two groups and a parameter of the root's own (``shift``) added to their output,
    rounded to float16 (a no-op for an fp16 model) and cast to float32 for the
    cross-entropy. ``variant``: ``"cast"``, the loss reads only that cast;
    ``"entered"``, another root parameter (``bias``) is added between the groups (as a
    GPT's position embedding: its region is the second group's, which it converts
    from); ``"direct"``, it adds
    the cross-entropy to an element of the float16 output in float16 (its region then
    holds float16 values, the output's among them); ``"param"``, the root's ``temp``
    divides the float32 logits (a parameter read in the loss's region); ``"fp16"``, a
    sum of squares in float16 (no cast)."""
    def loss(p, x, y):
        h = _seed_a(p["seed_a"], x.astype(dtype))
        if variant == "entered":
            h = h + p["bias"].astype(dtype)
        out = (_seed_b(p["seed_b"], h) + p["shift"].astype(dtype)).astype(jnp.float16)
        if variant == "fp16":  # (a reduction jnp would not widen)
            return jax.lax.reduce(jnp.square(out - 1.0), np.float16(0), jax.lax.add,
                                  (0, 1)) * jnp.float16(tiny)
        logits = out.astype(jnp.float32)
        if variant == "param":
            logits = logits / p["temp"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        if variant == "direct":
            return (ce * tiny).astype(jnp.float16) + out[0, 0] * jnp.float16(2.0**-10)
        return ce * tiny
    return loss


@pytest.mark.parametrize("variant", ["cast", "entered", "direct", "param", "fp16"])
def test_the_loss_seed_is_the_root_scale_only_where_the_cast_is_the_way_out(variant):
    """The loss's region runs at the seed scale (the root's planned one). Where its
    cotangent leaves it only through the cast, measured in float32 there, the cast point
    converts from the seed to the root's scale; the root, no longer anchoring the
    loss's region, chooses that scale in the same backward pass like a module, at the
    last of its ways in, the cast (the cast's float16 side holds it, and ``shift``'s
    gradient); ``bias``, read between the groups, anchors no region of the root's: it
    converts from the second group's scale, its readers'. Where the loss's
    region also holds float16 values or reads a parameter, it stays the root's, which
    keeps the rule's scale. In fp32, at arbitrary scales (the seed among them), the
    gradients are exact either way; and from scale 1 with the loss x 2^-30 (all of it
    flushed at the seed scale; x 2^-20 in float16, partly), step 0 is applied only
    where the root chose."""
    from adaloss_jax._tree import SEED

    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    _, program, groups = _grad_trace(_seed_loss(jnp.float16, variant), scaler,
                                     _SEED_PARAMS, _SEED_X, _SEED_Y)
    assert groups == ["", "seed_a", "seed_b"]
    casts = [s for s in program.sites() if s.row.wide]
    seeded = variant in ("cast", "entered")
    assert [(s.pair, s.cfg.convert) for s in casts] == (
        [] if variant == "fp16" else [((("",), (SEED,)), True)] if seeded
        else [((("",), ("",)), False)])
    assert ("" in program.live.groups) == seeded
    assert any(SEED in side for pair in program.pairs() for side in pair) == seeded
    bias = [jax.tree_util.keystr(k) for k, _ in
            jax.tree_util.tree_leaves_with_path(_SEED_PARAMS)].index("['bias']")
    assert program.param_pairs[bias] == ((("",), ("seed_b",)) if variant == "entered"
                                         else None)

    loss32 = _seed_loss(jnp.float32, variant)
    step, state = _grads_through(scaler, loss32, _SEED_PARAMS, (_SEED_X, _SEED_Y),
                                 {"": 7, "seed_a": -3, "seed_b": 11})
    got, _, _ = step(state, _SEED_PARAMS, _SEED_X, _SEED_Y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss32))(_SEED_PARAMS, _SEED_X, _SEED_Y))

    tx = optax.chain(alj.adaptive_unscale(alj.adaptive(groups="module", retries=0,
                                                       initial_scale=1.0)),
                     alj.skip_nonfinite(optax.sgd(0.0)))
    state = tx.init(_SEED_PARAMS)
    vg = alj.adaptive_value_and_grad(_seed_loss(
        jnp.float16, variant, tiny=2.0**-20 if variant == "fp16" else 2.0**-30))
    loss, grads, stats = jax.jit(vg)(state, _SEED_PARAMS, _SEED_X, _SEED_Y)
    _, state = tx.update(grads, state, _SEED_PARAMS, loss=loss, scale_stats=stats)
    assert bool(state[0].last_applied) == seeded
    if seeded:  # the root chose: the cast converted before it narrowed
        assert float(stats.log2_scales[""]) > 30
        assert not any(bool(stats.starved[g]) for g in stats.starved.names)


@pytest.mark.parametrize("variant", ["cast", "entered"])
@pytest.mark.parametrize("wrap", ["jit", "remat", "vmap"])
def test_the_root_decided_at_the_cast_holds_under_transformations(wrap, variant):
    """The ``"cast"`` and ``"entered"`` losses above jitted whole, under
    ``jax.checkpoint``, or with the model mapped row by row by ``jax.vmap``: the cast
    still converts from the seed and the root still decides there, and an fp32 model's
    gradients at arbitrary scales (the seed among them) are jax.grad's."""
    from adaloss_jax._tree import SEED

    def wrapped(dtype):
        loss = _seed_loss(dtype, variant)
        if wrap == "jit":
            return jax.jit(loss)
        if wrap == "remat":
            return jax.checkpoint(loss)

        def mapped(p, x, y):  # the model per row, the loss on the stacked output
            def row(xr):
                h = _seed_a(p["seed_a"], xr.astype(dtype))
                if variant == "entered":
                    h = h + p["bias"].astype(dtype)
                return (_seed_b(p["seed_b"], h) + p["shift"].astype(dtype)).astype(
                    jnp.float16)
            logits = jax.vmap(row)(x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return mapped

    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    _, program, _ = _grad_trace(wrapped(jnp.float16), scaler, _SEED_PARAMS, _SEED_X,
                                _SEED_Y)
    assert [(s.pair, s.cfg.convert) for s in program.sites() if s.row.wide] == [
        ((("",), (SEED,)), True)]
    assert "" in program.live.groups
    if variant == "entered":  # bias, read between the groups, converts from the second's
        bias = [jax.tree_util.keystr(k) for k, _ in
                jax.tree_util.tree_leaves_with_path(_SEED_PARAMS)].index("['bias']")
        assert program.param_pairs[bias] == (("",), ("seed_b",))
    loss32 = wrapped(jnp.float32)
    step, state = _grads_through(scaler, loss32, _SEED_PARAMS, (_SEED_X, _SEED_Y),
                                 {"": 7, "seed_a": -3, "seed_b": 11})
    got, _, _ = step(state, _SEED_PARAMS, _SEED_X, _SEED_Y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss32))(_SEED_PARAMS, _SEED_X, _SEED_Y))


def test_a_cast_of_a_scan_carry_computed_after_a_point_is_found():
    """The cast reads the scan's carry, which starts as data (zeros) and becomes the
    model's output only from the second iteration on: it is found by walking the body
    again with the carry marked as computed after a point."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    model = _models.MLP(depth=3, width=32)
    params = model.init(jax.random.key(2), x)["params"]

    def loss_fn(p, x, y):
        out = model.apply({"params": p}, x).reshape(4, 16, -1)

        def body(prev, chunk):  # the cross-entropy of the previous chunk
            return chunk, optax.softmax_cross_entropy_with_integer_labels(
                prev.astype(jnp.float32), y[:16]).mean()
        return jax.lax.scan(body, jnp.zeros_like(out[0]), out)[1].sum()

    rec, _, _ = _grad_trace(loss_fn, alj.adaptive(groups="module"), params, x, y)
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16"]


def _grad_trace(loss_fn, scaler, params, *args):
    from adaloss_jax import _grad

    return _grad.trace(loss_fn, scaler, params, args, {})


def test_only_casts_of_the_loss_region_get_a_point():
    """The attention block casts inside a module (its scores, LayerNorm's statistics) and
    its loss casts the logits and, to add them, the input data (as it is, and doubled
    in a nested jit): only the logits' cast, the one the root's cotangent narrows at,
    is measured."""
    from adaloss_jax import _grad

    model = _AttnBlock()
    x = jax.random.normal(jax.random.key(0), (4, 8, 16)).astype(jnp.float16)
    y = jax.random.randint(jax.random.key(1), (4, 8), 0, 10)
    params = model.init(jax.random.key(2), x)["params"]

    twice = jax.jit(lambda v: v * 2)  # data through a nested jit: no module's output

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.0 * jnp.sum(x.astype(jnp.float32) + twice(x).astype(jnp.float32))

    rec, _, _ = _grad.trace(loss_fn, alj.adaptive(groups="module"), params, (x, y), {})
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16"]
    # The same loss jitted: the casts sit inside the nested jit, and still only the
    # logits' one is measured.
    nested, _, _ = _grad.trace(jax.jit(loss_fn), alj.adaptive(groups="module"), params,
                               (x, y), {})
    assert [jnp.dtype(d).name for d in nested.casts.values()] == ["float16"]
    (point,) = [e for e in nested.closed.jaxpr.eqns[-1].params["jaxpr"].jaxpr.eqns
                if _point_of(e) in nested.casts]
    assert point.invars[0].aval.shape == (4, 8, 10)  # the logits', cast to float32
    cast = next(e for e in rec.closed.jaxpr.eqns
                if e.primitive.name == "convert_element_type"
                and any(v is e.outvars[0] for p in rec.closed.jaxpr.eqns
                        if _point_of(p) in rec.casts for v in p.invars))
    assert cast.outvars[0].aval.shape == (4, 8, 10)  # the logits'


def _point_of(eqn):
    from adaloss_jax import _jaxpr

    return _jaxpr.point_number(eqn)


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (a
# cond around the model: nothing decides; test_live.py checks the notice: a scan of
# the loss)
@pytest.mark.parametrize("chunks", [None, 3], ids=["whole", "chunked"])
@pytest.mark.parametrize("around", AROUND)
def test_the_loss_cast_is_measured_around_every_transformation(around, chunks):
    """The model under vmap, remat, a nested jit, cond or shard_map (typed or not), its
    fp16 output cast to float32 by the loss (x 2^-30: at scale 1 it all flushes in the
    cast), whole or chunk by chunk in a ``scan``: the root's statistics of the first
    pass are the fp32 amax of the loss's cotangent at the cast (to fp16's rounding),
    however the model is wrapped. Where the root chooses its scale at the cast (one
    cast, in the scope of the model's points: none, vmap, remat, jit and cond around
    the model, the cond's taken branch the last)
    the cotangent is converted before it narrows and no module is starved; elsewhere
    every module, which received only zeros computed from it, is starved and told that
    value (lost_amax), which the rule keeps from flushing again."""
    tiny = 2.0**-30
    scaler = alj.adaptive(groups="module", retries=0, initial_scale=1.0)
    case = build("jax", around, "none", jnp.float16, scaler, tiny=tiny, chunks=chunks)
    _, _, stats = case.grads(case.state)
    params, apply = _jax_model("none", jnp.float16)
    out = _around(around, functools.partial(apply, params))(_x(jnp.float32))
    ct = jax.grad(lambda o: jnp.mean(o**2) * tiny)(out.astype(jnp.float32))
    want = float(jnp.log2(jnp.max(jnp.abs(ct))))
    assert want < -25  # below fp16's smallest subnormal: lost in the cast
    at_unit = jnp.log2(stats.amax[""]) - stats.log2_scales[""]  # (the root's chosen)
    assert float(at_unit) == pytest.approx(want, abs=1e-3)
    modules = [g for g in stats.starved.names if g]
    assert modules
    if chunks is None and around in ("none", "vmap", "remat", "jit", "cond"):
        assert not any(bool(stats.starved[g]) for g in stats.starved.names)
        return
    assert all(bool(stats.starved[g]) for g in modules)
    assert [float(stats.lost_amax[g]) for g in stats.lost_amax.names] == pytest.approx(
        [want] * len(stats.lost_amax.names), abs=1e-5)


def _random_net_skips(ops, tied, tiny, steps=4):
    """The steps skipped by one of the property test's random linen graphs, per module
    in e4m3, from the initial scale."""
    from test_stream_property import _random_net, conformance_step

    tokens, params, _, loss16 = _random_net(ops, tied, tiny)
    scaler = alj.adaptive(groups="module", grad_dtype="float8_e4m3fn", simulate=True)
    step, state, _ = conformance_step(scaler, loss16, params, tokens)
    skipped = []
    for i in range(steps):
        _, state, _ = step(state)
        if not bool(alj.scale_state(state).last_applied):
            skipped.append(i)
    return skipped


@pytest.mark.parametrize("taken", ["cond-else", "cond"])
def test_a_region_with_entries_in_both_branches_decides_in_the_branch_taken(taken):
    """Two scanned stacks around an ``nn.cond`` whose branches call the same two Dense
    layers, in e4m3 with the loss x 2^-12: the layers' regions decide in whichever
    branch runs, the first (``cond-else``) or the last (a decider in each), and no
    step is skipped, from step 0. (With one decider, in the last branch, the first
    branch ran at the plan, and steps 0-2 were skipped.)"""
    assert _random_net_skips(("scan", taken, "scan"), False, 2.0**-12) == []


@pytest.mark.parametrize("tiny", [1.0, 2.0**-12])
def test_a_frozen_branch_reading_a_stream_refuses_no_step(tiny):
    """A block whose input, a fan-in deciding in the pass, is read by a Dense layer
    whose output's cotangent is stopped (its gradients zero, its region measuring
    nothing of its own): the fan-in's rows, counted for every group anchoring it, call
    for a scale far above that layer's, at which nothing was computed, so they refuse
    no step. In e4m3 nothing is skipped, from step 0. (Counted, they refused step 0 at
    x 1, and steps 0-1 at x 2^-12.)"""
    assert _random_net_skips(("dense", "stopped"), True, tiny) == []


@SLOW
def test_a_scanned_stack_read_by_several_modules_hands_them_its_choice():
    """A scanned residual stack before that block: the stack's stream exits into the
    block's input, a fan-in, which takes the last layer's token and decides after the
    scan. In e4m3 at x 2^-12 nothing is skipped, from step 0. (Its consumer no one
    group, the fan-in kept the plan, and steps 0-1 were refused.)"""
    assert _random_net_skips(("scan", "stopped"), True, 2.0**-12) == []


@pytest.mark.parametrize("ops,tied,tiny", [
    (("rnn",), False, 2.0**-12), (("olstm",), False, 2.0**-12),
    pytest.param(("dense", "rnn", "residual"), True, 2.0**-20, marks=pytest.mark.slow),
    pytest.param(("rnn", "scan"), False, 2.0**-20, marks=pytest.mark.slow)])
def test_an_rnn_over_time_decides_in_its_scan_and_skips_nothing(ops, tied, tiny):
    """Flax's ``nn.RNN`` of a GRU cell over the tokens (under ``nn.remat``), in e4m3 with
    a small loss: the cell's regions decide at the last time step and carry the choice
    to the others, the layer after it decides from the tokens every step emits, and no
    step is skipped, from step 0. (With the cell and what read its output at the plan,
    steps 0-1 were skipped.) Likewise an ``OptimizedLSTMCell``, whose gates' groups
    adopt the choice of the fan-in their parameters are read in (at the plan, with
    the gates' ``DenseParams`` inputs counted as cotangents that arrived as zeros,
    steps 0-1 were skipped; with the inputs alone left out, step 0). Likewise a GRU
    before a scanned residual stack, whose state's and input's fan-ins hold the
    stack's slots (kept at the plan, the gates reached only through the state starved
    and step 0 was skipped)."""
    assert _random_net_skips(ops, tied, tiny) == []


# ------------------------------------------- values only aux reads: a zero cotangent


class _EmitLayer(nn.Module):
    """A residual layer that also emits a value of its output per layer (a metric)."""

    dtype: jnp.dtype = jnp.float16

    @nn.compact
    def __call__(self, h, _):
        h = h + jnp.tanh(nn.Dense(8, dtype=self.dtype, name="fc")(h))
        return h, jnp.mean(h.astype(jnp.float32) ** 2)


class _EmitStack(nn.Module):
    """Three ``_EmitLayer`` in one ``nn.scan`` between two Dense layers; the per-layer
    values are returned beside the logits (``emit``) or dropped inside."""

    dtype: jnp.dtype = jnp.float16
    emit: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, dtype=self.dtype, name="inp")(x)
        h, per_layer = nn.scan(_EmitLayer, variable_axes={"params": 0},
                               split_rngs={"params": True}, length=3)(
            self.dtype, name="layers")(h, None)
        out = nn.Dense(3, dtype=self.dtype, name="head")(h)
        return (out, per_layer) if self.emit else out


def _emit_loss(model, loss_scale=1.0, aux=True):
    def loss_fn(p, x, y):
        out = model.apply({"params": p}, x)
        logits, per_layer = out if model.emit else (out, None)
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y).mean() * loss_scale
        if not aux:
            return loss
        return loss, {"per_layer": per_layer, "weight_norm": optax.tree.norm(p)}
    return loss_fn


@pytest.mark.parametrize("emit", [True, False], ids=["emitted", "dropped"])
def test_a_scanned_stacks_per_layer_metrics_and_a_weight_norm_in_aux_change_no_scale(emit):
    """A stack in one ``nn.scan`` whose body also emits a value per layer (returned
    with the logits, or dropped inside the model), and a loss whose ``aux`` holds those
    values and the parameters' global norm: what only ``aux`` reads has a zero
    cotangent. The stack keeps a scale per layer decided in the pass, nothing is
    skipped in float16 and e4m3 with the loss x 2^-20 (the per-layer values made the
    stack one region that kept the plan: step 0 skipped, steps 0-1 in e4m3; the weight
    norm made every module one region), and the gradients in fp32 at arbitrary scales
    are fp32's."""
    from adaloss_jax.flax import TrainState, linen_train_step

    x = jax.random.normal(jax.random.key(0), (6, 5))
    y = jnp.arange(6) % 3
    model = _EmitStack(emit=emit)
    params = model.init(jax.random.key(1), x)["params"]
    loss_fn = _emit_loss(model, 2.0**-20)
    for grad_dtype in ("float16", "float8_e4m3fn"):
        scaler = alj.adaptive(groups="module", grad_dtype=grad_dtype,
                              simulate=grad_dtype != "float16")
        state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                                  scaler=scaler)
        step = jax.jit(lambda s: linen_train_step(s, loss_fn, x, y, has_aux=True))
        skipped = []
        for i in range(3):
            state, metrics = step(state)
            if not bool(metrics["applied"]):
                skipped.append(i)
        assert skipped == [], (grad_dtype, skipped)
        st = alj.scale_state(state)
        assert {"layers/fc[0]", "layers/fc[1]", "layers/fc[2]"} <= set(st.groups)
        assert float(metrics["aux"]["weight_norm"]) > 0

    m32 = _EmitStack(dtype=jnp.float32, emit=emit)
    loss32 = _emit_loss(m32, aux=False)
    want = jax.jit(jax.grad(loss32))(params, x, y)
    for same_step in (False, True):  # the scales drawn; chosen in the pass from them
        scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=same_step)
        groups = alj.adaptive_unscale(scaler).init(params).groups
        log2 = dict(zip(groups, [5, -3, 9, 0, 12, -7, 3]))
        step, state = _grads_through(scaler, lambda p, x, y: _emit_loss(m32)(p, x, y)[0],
                                     params, (x, y), log2)
        got, _, stats = step(state, params, x, y)
        used = {g: float(stats.log2_scales[g]) for g in stats.log2_scales.names}
        if not same_step:  # (a scale per layer: the slots')
            assert used == {g: v for g, v in log2.items() if g != "layers/fc"}
        assert_fp32_trees_close(got, want)
