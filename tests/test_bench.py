"""Tests of the bench (adaloss_jax.bench): CLI, runner, regimes, data, report, progress."""

import dataclasses
import io
import json
import math
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from adaloss_jax.bench import (
    _cli,
    _configs,
    _data,
    _fp8_peers,
    _models,
    _progress,
    _report,
    _runner,
    _tasks,
)

STEPS = 4


@pytest.fixture
def small_gpt(monkeypatch):
    """code-gpt with a one-block d=32 GPT, so that the compiles stay short."""
    task = dataclasses.replace(
        _tasks.TASKS["code-gpt"],
        make_model=lambda dtype, dg: _models.GPT(layers=1, d_model=32, heads=2, context=64,
                                                 dtype=dtype, dot_general_cls=dg),
        settings="test-gpt-1x32")
    monkeypatch.setitem(_tasks.TASKS, "code-gpt", task)
    return task


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


@pytest.mark.slow
def test_cli_end_to_end_and_resume(small_gpt, tmp_path, capsys):
    out = str(tmp_path / "res")
    argv = ["--tasks", "code-gpt", "--regimes", "tiny", "--configs",
            "fp32,fp16-ada-module", "--seeds", "0", "--steps", str(STEPS), "--out", out]
    assert _cli.main(argv) == 0
    rows = {r["config"]: r for r in _lines(os.path.join(out, "runs.jsonl"))}
    assert sorted(rows) == ["fp16-ada-module", "fp32"]
    for r in rows.values():
        assert [p["step"] for p in r["probes"]] == _runner.probe_steps(STEPS)
        assert len(r["loss_curve"]) == STEPS and np.isfinite(r["quality"])
        assert r["settings"] == "test-gpt-1x32"
    assert rows["fp32"]["final_underflow"] == 0.0  # fp32 against itself flushes nothing
    # Tiny regime: the root chooses its scale at the loss's cast in step 0, as every
    # module does (the position embedding converts from the stream): no step skipped.
    ada = rows["fp16-ada-module"]
    assert all(ada["applied_curve"])
    assert ada["retried"] == 0 and ada["skipped"] == 0
    assert ada["probes"][0]["underflow"] < 1e-3  # (step 0 is applied at its chosen scales)
    assert ada["probes"][-1]["underflow"] < 0.5
    assert ada["final_underflow"] < 0.5
    assert len(ada["group_log2_scales"]) > 1 and ada["final_log2_scale"] > 20
    with open(os.path.join(out, "results.csv")) as f:
        assert len(f.read().strip().splitlines()) == 3
    report = open(os.path.join(out, "report.md")).read()
    for c in rows:
        assert f"| {c} |" in report
    for kind in ("loss", "underflow", "scales"):
        assert os.path.getsize(os.path.join(out, "plots", f"code-gpt_tiny_{kind}.png")) > 1000
    capsys.readouterr()

    # Finished runs are not rerun.
    assert _cli.main(argv) == 0
    assert "0 runs to do (2 already" in capsys.readouterr().err
    assert len(_lines(os.path.join(out, "runs.jsonl"))) == 2
    # A run made under other options of the same name (an older default) is run again.
    raw = os.path.join(out, "runs.jsonl")
    lines = _lines(raw)
    for r in lines:
        r["spec"] = r["spec"].replace("same_step=True", "same_step=False")
    with open(raw, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    assert _cli.main(argv) == 0
    assert "1 runs to do (1 already" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_regime_leaves_fp32_unchanged(small_gpt):
    """The 2^-20 loss multiplier and the 2^20 gradient multiplier cancel exactly in fp32."""
    fp32 = _configs.CONFIGS["fp32"]
    tiny = _runner.Runner(small_gpt, fp32, "tiny", 3).run(1)
    ordinary = _runner.Runner(small_gpt, fp32, "ordinary", 3).run(1)
    np.testing.assert_allclose(tiny["loss_curve"], ordinary["loss_curve"], rtol=1e-6)
    np.testing.assert_allclose(tiny["quality"], ordinary["quality"], rtol=1e-6)


def test_interrupted_bench_keeps_finished_runs(small_gpt, tmp_path, monkeypatch):
    real_run = _runner.Runner.run
    calls = []

    def run(self, seed, on_step=None):
        calls.append(seed)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real_run(self, seed, on_step)

    monkeypatch.setattr(_runner.Runner, "run", run)
    out = str(tmp_path / "res")
    code = _cli.main(["--tasks", "code-gpt", "--regimes", "ordinary", "--configs", "fp32",
                      "--seeds", "0,1", "--steps", "2", "--out", out, "--no-plots"])
    assert code == 130
    assert [r["seed"] for r in _lines(os.path.join(out, "runs.jsonl"))] == [0]
    assert "| fp32 | 1 |" in open(os.path.join(out, "report.md")).read()


@pytest.mark.slow
def test_flax_fp8_peer_trains_with_its_own_scaling_state(small_gpt):
    """flax's Fp8DirectDotGeneralOp in every Dense: its scales and amax histories are updated
    from their "gradients" each step, and its e5m2 gradient scale adapts to the tiny
    regime by itself, so few gradients flush without any loss scaling."""
    runner = _runner.Runner(small_gpt, _configs.CONFIGS["fp8-flax"], "tiny", 3)
    carry = runner.init(0)
    fp8 = carry[1][_runner.FP8_STATE]
    op = "Fp8DirectDotGeneralOp_0"
    scale0 = np.asarray(fp8["block_0"]["mlp"]["fc1"][op]["output_grad_scale"])
    batch = small_gpt.batches(0, 3)
    for i in range(3):
        carry = runner.step(carry, batch(i))[0]
    fc1 = carry[1][_runner.FP8_STATE]["block_0"]["mlp"]["fc1"][op]
    history = np.asarray(fc1["output_grad_amax_history"])
    # The cotangent's amax (about 2^-20 of an ordinary one) is recorded once the layers
    # after fc1 pass a non-zero cotangent (delayed scaling: a step per layer), and the
    # scale picked from the history replaced the initial 1.
    assert 0 < history[0] < 2.0**-12 and np.count_nonzero(history) <= 2
    assert scale0 == 1.0 and 0 < float(fc1["output_grad_scale"][0]) < 2.0**-30
    row = runner.run(0)
    assert row["skipped"] == 0 and not row["diverged"] and np.isfinite(row["quality"])
    assert row["final_underflow"] < 0.05


@pytest.mark.parametrize("config", ["fp8-flax", "fp8-current", "fp8-qwix", "fp8-mxfp8"])
def test_fp8_peers_refuse_a_model_without_fp8_layers(small_gpt, config):
    """A model that ignores dot_general_cls would train in plain bf16 under an fp8
    label: refused, naming the tasks that take it. qwix quantizes a model's nn.Dense
    layers without dot_general_cls; a GPT without blocks has none (its output head is
    the embedding's attend, which qwix's rule leaves alone, as the other fp8 rows do)."""
    if config == "fp8-qwix":
        pytest.importorskip("qwix")
        layers, match = 0, "no dense layer qwix quantizes"
    else:
        layers, match = 1, "no dense layer that takes dot_general_cls"
    plain = dataclasses.replace(
        small_gpt, make_model=lambda dtype, dg: _models.GPT(layers=layers, d_model=32,
                                                            heads=2, context=64, dtype=dtype))
    runner = _runner.Runner(plain, _configs.CONFIGS[config], "tiny", 2)
    with pytest.raises(ValueError, match=f"{match}.*fmnist-sigmoid"):
        runner.init(0)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fp8-qwix", "fp8-mxfp8"])
def test_new_fp8_peers_train_in_fp8(small_gpt, config):
    """qwix (MaxText's fp8_full rule) and simulated MXFP8 in every Dense of the GPT: the
    model computes in fp8 (the runner's check finds fp8 values in its trace), its
    gradients are those of the bf16 model rounded (close, never equal), a tiny loss needs
    no loss scaling (every tensor or block is scaled from its own values), and a few
    steps train."""
    if config == "fp8-qwix":
        pytest.importorskip("qwix")
    runner = _runner.Runner(small_gpt, _configs.CONFIGS[config], "tiny", 3)
    bf16 = _runner.Runner(small_gpt, _configs.CONFIGS["bf16"], "tiny", 3)
    carry = runner.init(0)
    assert runner._fp8_inside(carry[0], carry[1]) and not carry[1]  # no scaling state
    batch = small_gpt.batches(0, 3)
    grads = runner.step(carry, batch(0))[2]
    ref = bf16.step(bf16.init(0), batch(0))[2]
    for name in ("qkv", "fc1"):
        module = "attn" if name == "qkv" else "mlp"
        g, r = (np.asarray(t["block_0"][module][name]["kernel"]) for t in (grads, ref))
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert 0 < err < 0.25, (name, err)
        assert np.mean(g == 0) <= np.mean(r == 0) + 0.01  # nothing flushed by the tiny loss
    row = runner.run(0)
    assert row["skipped"] == 0 and not row["diverged"] and np.isfinite(row["quality"])
    assert row["loss_curve"][-1] < row["loss_curve"][0]
    assert row["final_underflow"] < 0.05


@pytest.mark.parametrize("config", ["fp8-qwix", "fp8-mxfp8"])
def test_new_fp8_peers_quantize_a_scanned_stack_like_its_unrolled_twin(config):
    """The sigmoid stack with its layers in one nn.scan (fmnist-sigmoid-scan) gets the
    same fp8 gradients as the same weights unrolled: qwix intercepts the dense layers
    inside the scan too, and MXFP8's blocks do not depend on the stacking."""
    if config == "fp8-qwix":
        pytest.importorskip("qwix")
    recipe = _configs.CONFIGS[config].fp8

    def make(scan):
        return _fp8_peers.peer_model(lambda dtype, dg: _models.sigmoid_mlp(
            dtype, dg, depth=4, scan=scan), jnp.bfloat16, recipe)

    # The bench's batch of 128: layers 1.. take inputs of their kernels' shape (qwix
    # must not take them for weights).
    x = jax.random.uniform(jax.random.key(0), (_tasks.FMNIST_BATCH, 784))
    y = jax.random.randint(jax.random.key(1), (_tasks.FMNIST_BATCH,), 0, 10)
    loop, stack = make(False), make(True)
    params = loop.init(jax.random.key(2), x)["params"]

    def grads(model, p):
        def loss(p):
            logits = model.apply({"params": p}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return jax.jit(jax.grad(loss))(p)

    # Forward operands in e4m3; output gradients in e5m2 (qwix's fp8_full) or e4m3
    # (MXFP8, as scaled_dot_general's default configs), inside the scan's body too.
    backward = str(jax.make_jaxpr(lambda p: jax.grad(lambda p: jnp.sum(stack.apply(
        {"params": p}, x).astype(jnp.float32)))(p))(_models.stack_layers(params)))
    assert "f8_e4m3" in backward
    assert ("f8_e5m2" in backward) == (config == "fp8-qwix")
    unrolled = _models.layer_kernels(grads(loop, params))
    scanned = _models.layer_kernels(grads(stack, _models.stack_layers(params)))
    plain = _models.layer_kernels(grads(_models.sigmoid_mlp(jnp.bfloat16, depth=4), params))
    for a, b, c in zip(unrolled, scanned, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not np.array_equal(np.asarray(a), np.asarray(c))  # fp8 in both


def test_qwix_peer_computes_what_a_plain_qwix_provider_computes():
    """The bench's QtProvider only stops qwix from taking a dense layer's input for a
    weight: where qwix tells them apart itself (no input of its kernel's shape), its
    gradients are a plain ``qwix.QtProvider``'s, bit for bit."""
    qwix = pytest.importorskip("qwix")
    model = _models.sigmoid_mlp(jnp.bfloat16, depth=3)
    x = jax.random.uniform(jax.random.key(0), (64, 784))
    ours = _fp8_peers.qwix_model(model)
    plain = qwix.quantize_model(model, qwix.QtProvider(_fp8_peers.qwix_rules()))
    params = ours.init(jax.random.key(1), x)["params"]

    def grads(m):
        return jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(m.apply({"params": p}, x).astype(
            jnp.float32)))))(params)

    for a, b in zip(*(jax.tree_util.tree_leaves(grads(m)) for m in (ours, plain))):
        np.testing.assert_array_equal(a, b)


def test_mxfp8_rounds_each_block_of_32_at_its_own_power_of_two_scale():
    """MXFP8 (closed form): blocks of 32 consecutive elements along the contraction axis,
    each scaled by 2**k with k = ceil(log2(amax / 448)), the smallest power of two that
    fits the block's amax in e4m3 (rounded up: the amax is never clipped; an exact
    448 * 2**k keeps k), each element rounded to e4m3 at its block's scale. A block 2^-40
    below its neighbour keeps e4m3's precision (one scale for the tensor would flush
    it); a block of zeros stays zero; a length not a multiple of 32 (784) ends in a
    shorter block of its own."""
    e4m3 = _fp8_peers.E4M3
    rng = np.random.default_rng(0)
    amaxes = [100.0, 3.0 * 2.0**-40, 448.0, 449.0, 0.0, 7.0, 1e4, 2.0**-20]
    blocks = []
    for a in amaxes:
        # The block's amax, known, in its first half; its second half 16 binades below,
        # where the block's scale leaves it e4m3 subnormals (a block of 16 would give it
        # a scale of its own: normal numbers, finer).
        b = rng.uniform(-0.25, 0.25, 32) * a
        b[16:] = rng.choice([-1.0, 1.0], 16) * rng.uniform(0.5, 1.0, 16) * a * 2.0**-16
        b[rng.integers(16)] = -a
        blocks.append(b)
    x = np.concatenate(blocks)[None].astype(np.float32)  # one row, contraction axis 1
    q = np.asarray(_fp8_peers.mx_round(jnp.asarray(x), (1,)))
    for i, a in enumerate(amaxes):
        xb, qb = x[0, 32 * i: 32 * i + 32], q[0, 32 * i: 32 * i + 32]
        if a == 0:
            assert np.all(qb == 0)
            continue
        k = math.ceil(math.log2(a / 448.0))
        assert a / 2.0**k <= 448.0 < 2 * a / 2.0**k  # the smallest power that fits
        assert float(_fp8_peers.mx_exponent(jnp.float32(a))) == k
        # Each element: e4m3's rounding of x / 2**k, read back at 2**k.
        np.testing.assert_array_equal(
            qb, np.asarray(jnp.asarray(xb / 2.0**k).astype(e4m3).astype(jnp.float32))
            * 2.0**k)
        # The amax fits unclipped: within e4m3's half-ulp (2^-4) of itself.
        assert abs(abs(qb).max() - a) <= a * 2.0**-4
        # The small half: subnormals at the block's scale (multiples of 2**(k-9)), and
        # coarser than e4m3's relative precision for some.
        small = qb[16:] / 2.0**(k - 9)
        np.testing.assert_array_equal(small, np.round(small))
        assert np.max(np.abs(qb[16:] - xb[16:]) / np.abs(xb[16:])) > 2.0**-4
    assert float(_fp8_peers.mx_exponent(jnp.float32(448.0))) == 0  # exact: not rounded up
    assert float(_fp8_peers.mx_exponent(jnp.float32(449.0))) == 1
    # The tiny block keeps e4m3's relative precision for its larger half.
    tiny = slice(32, 64)
    big = np.abs(x[0, tiny]) > 2.0**-44
    np.testing.assert_allclose(q[0, tiny][big], x[0, tiny][big], rtol=2.0**-4)
    # 784 = 24 x 32 + 16: the last 16 elements are a block of their own.
    y = np.full((784,), 1000.0, np.float32)
    y[-16:] = 1e-3
    qy = np.asarray(_fp8_peers.mx_round(jnp.asarray(y), (0,)))
    np.testing.assert_allclose(qy[-16:], 1e-3, rtol=2.0**-4)
    # Another axis order: the contraction first (a kernel's), each column its own blocks.
    np.testing.assert_array_equal(
        np.asarray(_fp8_peers.mx_round(jnp.asarray(x.T), (0,))), q.T)


def test_mxfp8_matches_jax_scaled_dot_general(monkeypatch):
    """The simulation against jax's own ``jax.nn.scaled_dot_general`` with its default
    MXFP8 configs, the cuDNN block-scaled matmul (no CPU lowering) replaced by what it
    computes (dequantize each block by its e8m0 scale, an fp32 matmul): the same output
    and the same gradients of the input and the kernel, bit for bit (so the same blocks,
    scales and formats in the backward pass too)."""
    sms = pytest.importorskip("jax._src.cudnn.scaled_matmul_stablehlo")

    def block_scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
        def dequantize(v, s):
            s = sms.e8m0_to_dtype(s.view(jnp.uint8), jnp.float32)
            n, m, k = v.shape
            return (v.astype(jnp.float32).reshape(n, m, k // 32, 32) * s[..., None]).reshape(
                n, m, k)
        out = jnp.einsum("bmk,bnk->bmn", dequantize(a, a_scales), dequantize(b, b_scales))
        return out.astype(preferred_element_type)

    monkeypatch.setattr(sms, "scaled_matmul_wrapper", block_scaled_matmul)
    keys = iter(jax.random.split(jax.random.key(0), 6))

    def spread(shape):
        """bf16 values (the model's), in fp32 so that both return fp32, over 16 binades:
        a block's smallest values are e4m3 subnormals at its scale, so which elements
        share a block (and so a scale) shows in the result."""
        v = jax.random.normal(next(keys), shape) * jnp.exp2(
            jax.random.randint(next(keys), shape, -8, 8).astype(jnp.float32))
        return v.astype(jnp.bfloat16).astype(jnp.float32)

    x, kernel, w = spread((2, 64, 64)), spread((64, 96)), spread((2, 64, 96))
    dn = (((2,), (0,)), ((), ()))
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3

    def theirs(a, b):
        return jax.nn.scaled_dot_general(a, b, dn, preferred_element_type=jnp.float32,
                                         configs=configs)

    def ours(a, b):
        return _fp8_peers.mxfp8_dot(a, b, dn)

    def check(a, b):
        """Both outputs and both gradients, in one compile."""
        outs = [f(a, b) for f in (ours, theirs)]
        grads = [jax.grad(lambda a, b, f=f: jnp.sum(w * f(a, b)), (0, 1))(a, b)
                 for f in (ours, theirs)]
        return outs, grads

    (out, out_jax), ((dx, dk), (dx_jax, dk_jax)) = jax.jit(check)(x, kernel)
    np.testing.assert_array_equal(out, out_jax)
    assert not np.array_equal(out, x @ kernel)  # quantized
    np.testing.assert_array_equal(dx, dx_jax)
    np.testing.assert_array_equal(dk, dk_jax)


def test_qwix_missing_says_how_to_install(monkeypatch, tmp_path, capsys):
    """Without qwix, fp8-qwix asked for by name stops with the pip command; the default
    suite of a task that runs it skips it, saying so."""
    monkeypatch.setitem(sys.modules, "qwix", None)  # import qwix raises ImportError
    assert "pip install qwix" in _fp8_peers.qwix_missing()
    with pytest.raises(ImportError, match="pip install qwix"):
        _fp8_peers.qwix_model(_models.sigmoid_mlp())
    with pytest.raises(SystemExit, match="config fp8-qwix: .*pip install qwix"):
        _cli.main(["--tasks", "code-gpt", "--configs", "fp32,fp8-qwix", "--out",
                   str(tmp_path)])
    monkeypatch.setattr(_runner, "Runner", None)  # nothing may run: the data is missing
    monkeypatch.setattr(_tasks.Task, "available", lambda self: "no data here")
    with pytest.raises(SystemExit, match="nothing to run"):
        _cli.main(["--out", str(tmp_path)])
    assert "skipping config fp8-qwix: " in capsys.readouterr().err


def test_current_fp8_scaling_rounds_each_tensor_at_its_own_amax():
    """Per-tensor current scaling: the largest magnitude maps to the format's largest
    value (kept exactly), a value 2^17 below it is still held in e4m3 (its subnormals end
    at 2^-9, 448 = 2^8.8 maps the amax), one 2^30 below flushes; and the gradient of a
    dense layer under it is close to the exact one whatever the loss's size (its output
    gradient is rounded to e5m2 at its own amax: a tiny loss needs no loss scaling)."""
    x = jnp.asarray([3.0, -3.0 * 2.0**-17, 3.0 * 2.0**-30, 1.0])
    q = _fp8_peers.current_round(x, _fp8_peers.E4M3)
    assert float(q[0]) == 3.0 and float(q[2]) == 0.0
    assert float(q[1]) == pytest.approx(-3.0 * 2.0**-17, rel=0.35)
    dense = nn.Dense(4, dot_general_cls=_fp8_peers.CurrentFp8Dot)
    h = jax.random.normal(jax.random.key(0), (8, 4))
    p = dense.init(jax.random.key(1), h)["params"]
    for tiny in (1.0, 2.0**-40):
        g = jax.grad(lambda p, t=tiny: jnp.sum(jnp.sin(dense.apply({"params": p}, h))) * t)(p)
        ref = jax.grad(lambda p, t=tiny: jnp.sum(jnp.sin(h @ p["kernel"] + p["bias"])) * t)(p)
        err = float(jnp.max(jnp.abs(g["kernel"] - ref["kernel"])) / jnp.max(jnp.abs(
            ref["kernel"])))
        assert 0 < err < 0.2, (tiny, err)


@pytest.mark.slow
def test_the_scanned_deep_gpt_in_e4m3_tiny_skips_nothing_from_step_0():
    """The bench's ``code-gpt-deep-scan`` (8 blocks in one ``nn.scan``) in the tiny
    regime (loss x 2^-20), e4m3 per module, from scale 1, seed 0: its first three steps
    are applied. Every region chooses its scale in the backward pass: the residual
    stream per layer at each block's exit, the root at the loss's cast. The sum of the
    embeddings under the first block is that block's stream, not the root's (the
    position embedding converts from it): while the root's scale, chosen from the
    logits' cotangent, also held that sum (far larger after eight blocks), step 0
    overflowed there on every seed (``docs/results.md``, section 4)."""
    task = _tasks.TASKS["code-gpt-deep-scan"]
    runner = _runner.Runner(task, _configs.CONFIGS["e4m3-module"], "tiny", 3)
    carry, batch, applied = runner.init(0), task.batches(0, 3), []
    for i in range(3):
        carry, out, _ = runner.step(carry, batch(i))
        applied.append(bool(out[1]))
    assert applied == [True, True, True]


def test_deep_tasks_run_their_own_regime_and_configs():
    plan = _cli.make_plan(_cli.parse_args(["--tasks", "fmnist-sigmoid,code-gpt"]))
    assert plan[("fmnist-sigmoid", "tiny")] == list(_configs.DEPTH)
    assert ("fmnist-sigmoid", "ordinary") not in plan
    assert plan[("code-gpt", "ordinary")] == list(_configs.FULL["ordinary"])
    assert "fp8-flax" in _configs.DEPTH and "fp8-flax" not in plan[("code-gpt", "tiny")]
    # An explicit regime or config list wins over the task's own.
    plan = _cli.make_plan(_cli.parse_args(["--tasks", "code-gpt-deep", "--regimes",
                                           "ordinary", "--configs", "fp32"]))
    assert plan == {("code-gpt-deep", "ordinary"): ["fp32"]}


def test_probe_steps():
    assert _runner.probe_steps(400) == [0, 1, 100, 200, 300, 399]
    assert _runner.probe_steps(4) == [0, 1, 2, 3]
    steps = _runner.probe_steps(3000, 12)
    assert len(steps) == 12 and steps == sorted(steps) and steps[-1] == 2999
    assert steps[:3] == [0, 1, 300]


@pytest.mark.parametrize("argv, valid", [
    (["--tasks", "nope"], "code-gpt"),
    (["--configs", "fp32,fp17"], "fp16-ada-module"),
    (["--regimes", "huge"], "tiny"),
], ids=["task", "config", "regime"])
def test_unknown_names_list_the_valid_ones(argv, valid, tmp_path):
    with pytest.raises(SystemExit, match=f"unknown .*valid .*{valid}"):
        _cli.main([*argv, "--out", str(tmp_path)])


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(_data, "_DOC_GLOB", str(tmp_path / "nothing*"))
    task = dataclasses.replace(_tasks.TASKS["text-gpt"])
    monkeypatch.setitem(_tasks.TASKS, "text-gpt", task)
    with pytest.raises(SystemExit, match="apt-get install -y python3-doc"):
        _cli.main(["--tasks", "text-gpt", "--out", str(tmp_path)])
    with pytest.raises(_data.DataUnavailable, match="dataset-fashion-mnist"):
        _data.load_fashion_mnist(str(tmp_path))


def test_list(capsys):
    assert _cli.main(["--list"]) == 0
    text = capsys.readouterr().out
    for name in (*_tasks.TASKS, *_configs.CONFIGS):
        assert name in text


def test_byte_batches_and_epochs():
    data = np.arange(1000, dtype=np.uint8)
    b = _data.byte_batches(data, 3, 8, 5, seed=0)
    assert b.shape == (5, 3, 9) and b.dtype == np.int32
    # Every window is a contiguous slice of the data.
    assert np.all((np.diff(b, axis=-1) % 256) == 1)
    np.testing.assert_array_equal(b, _data.byte_batches(data, 3, 8, 5, seed=0))
    idx = _data.epoch_indices(100, 10, 25, seed=0)
    assert idx.shape == (25, 10)
    for e in range(2):  # each full epoch visits every example once
        assert sorted(idx[10 * e: 10 * e + 10].ravel()) == list(range(100))


def test_summary_table_gap_and_spread():
    def row(config, seed, q):
        return {"config": config, "seed": seed, "metric": "bits/byte", "quality": q,
                "skipped": 0, "mean_underflow_after_warmup": 0.0, "final_underflow": 0.0,
                "final_log2_scale": 15.0, "s_per_step": 0.01, "diverged": False}

    rows = [row("fp32", 0, 3.0), row("fp32", 1, 3.2), row("fp16-dynamic", 0, 3.3),
            row("fp16-dynamic", 1, 3.6)]
    table = _report.summary_table(rows, ["fp32", "fp16-dynamic"])
    # mean 3.45, sample std sqrt(0.045) = 0.2121; paired gaps 0.3 and 0.4: +0.35 ± 0.0707
    assert "| fp16-dynamic | 2 | 3.4500 ± 0.2121 | +0.3500 ± 0.0707 | 0/0 |" in table


def test_progress_without_terminal():
    stream = io.StringIO()
    p = _progress.Progress(10, total_runs=2, stream=stream, every_s=0.0)
    p.start_run("code-gpt tiny fp32 seed 0")
    assert "compiling" in stream.getvalue()  # a line at once, before the first step
    for _ in range(5):
        p.step()
    p.note("done")
    p.close()
    text = stream.getvalue()
    assert " 50.0%" in text and "code-gpt tiny fp32 seed 0" in text and "done\n" in text


def test_progress_estimate_counts_compilation_apart(monkeypatch):
    """A first step that compiles for 10 s and steady steps of 0.1 s: with 2 runs of 100
    steps and the first run half done, about 5 s + 10 s + 99 x 0.1 s are left, not the
    first run's average extrapolated (which put hours on a 4-minute bench)."""
    now = [0.0]
    monkeypatch.setattr(_progress.time, "perf_counter", lambda: now[0])
    p = _progress.Progress(200, total_runs=2, stream=io.StringIO())
    p.start_run("run 0")
    now[0] += 10.0
    p.step()
    for _ in range(49):
        now[0] += 0.1
        p.step()
    assert abs(p.eta() - (50 * 0.1 + 10.0 + 99 * 0.1)) < 1e-6


@pytest.mark.skipif(not os.path.isdir(_data.FASHION_MNIST_DIR),
                    reason="dataset-fashion-mnist is not installed")
@pytest.mark.slow
def test_resnet_with_batchnorm_under_adaptive_scaling():
    # The bench's ResNet with one narrow stage: the same stem, BatchNorm and residual
    # block, a shorter compile.
    task = dataclasses.replace(
        _tasks.TASKS["fmnist-resnet"],
        make_model=lambda dtype, dg: _models.ResNet(widths=(4,), dtype=dtype))
    # Global adaptive scaling: what is tested is BatchNorm state around a skipped step
    # (retries=0: the blind first step is skipped, not retried); per-module scaling with
    # BatchNorm is covered by tests/test_stream_property.py.
    config = _configs.CONFIGS["fp16-ada-global"]
    config = dataclasses.replace(config, adaptive={**config.adaptive, "retries": 0})
    runner = _runner.Runner(task, config, "tiny", 3)
    carry = runner.init(0)
    row = runner.run(0)
    assert row["skipped"] == 1 and not row["diverged"]  # only the blind first step
    assert np.isfinite(row["quality"]) and row["final_underflow"] < 0.01
    # BatchNorm statistics: kept on the skipped first step, moved on the next (applied).
    batch = task.batches(0, 2)
    first = runner.step(carry, batch(0))[0]
    second = runner.step(first, batch(1))[0]
    mean = lambda c: np.asarray(c[1]["batch_stats"]["bn_stem"]["mean"])  # noqa: E731
    assert carry[1]["batch_stats"]["bn_stem"]["mean"].dtype == jnp.float32
    np.testing.assert_array_equal(mean(first), mean(carry))
    assert not np.allclose(mean(second), mean(first))


# ------------------------------------------------- the report as a user sees it (no compile)

_MODULES = ("embed", *(f"block_{i}/{m}" for i in range(2)
                       for m in ("attn/qkv", "attn/proj", "mlp/fc1", "mlp/fc2", "ln1", "ln2")),
            "ln_f")


def _row(config, seed, quality, *, metric="bits/byte", task="code-gpt", regime="tiny",
         steps=20, settings="s", skipped=0, diverged=False):
    """A runs.jsonl row with every field the report and the plots read."""
    adaptive = config.startswith(("fp16-ada", "e5m2", "e4m3"))
    scaled = adaptive or config in ("fp16-dynamic", "fp16-flax")
    log2 = 15.0 + 20 * adaptive if scaled else 0.0
    groups = ({"": log2, **{m: log2 + i % 4 for i, m in enumerate(_MODULES)}}
              if config.endswith("-module") else {"": log2})
    probes = [{"step": s, "underflow": 0.0, "module_underflow": {m: 0.0 for m in _MODULES},
               **({"group_log2_scales": {g: (v if s else 0.0) for g, v in groups.items()}}
                  if adaptive else {})} for s in _runner.probe_steps(steps)]
    row = {"task": task, "regime": regime, "config": config, "seed": seed, "steps": steps,
           "settings": settings, "metric": metric, "quality": quality, "eval_loss": quality,
           "diverged": diverged, "skipped": skipped, "retried": int(adaptive),
           "skipped_after_warmup": 0, "final_log2_scale": log2, "final_underflow": 0.0,
           "mean_underflow_after_warmup": 0.0 if scaled or config == "fp32" else 0.5,
           "s_per_step": 0.02, "first_step_s": 1.0,
           "loss_curve": list(3.0 + quality - np.linspace(0, 1, steps)),
           "log2_scale_curve": [log2] * steps, "applied_curve": [True] * steps,
           "probes": probes,  # a real run's options, as the runner writes them
           "spec": _configs.CONFIGS[config].spec() if config in _configs.CONFIGS else ""}
    if adaptive:
        row["group_log2_scales"] = groups
    return row


# Per-seed quality offsets from fp32: bf16 and the adaptive configs within noise of it.
_GAPS = {"fp32": (0, 0, 0), "bf16": (-2e-4, 1e-4, -1e-4), "fp16-none": (5.0, 5.1, 4.9),
         "fp16-dynamic": (0.05, 0.04, 0.045), "fp16-ada-global": (1e-4, -5e-5, 6e-5),
         "fp16-ada-module": (7e-5, -1e-4, 1e-4)}


def _quick_rows(gaps=_GAPS, **kw):
    return [_row(c, s, 3.4 + 0.01 * s + g[s], **kw) for c, g in gaps.items()
            for s in range(3)]


def test_console_table_fits_80_columns():
    """The terminal table is at most 80 columns wide, with every configuration in each
    of its tables, also for the full suite's 14 configs, 5 seeds and accuracy."""
    table = _report.text_table(_quick_rows(), list(_GAPS))
    assert max(map(len, table.splitlines())) <= 80
    for part in table.split("\n\n"):
        assert [line.split()[0] for line in part.splitlines()] == ["config", *_GAPS]
    for header in ("bits/byte", "gap to fp32", "skipped", "retried", "underflow",
                   "log2 scale", "ms/step"):
        assert header in table
    assert "+0.0450 ± 0.0050" in table  # fp16-dynamic's paired gap
    full = list(_configs.FULL["tiny"])
    rows = [_row(c, s, 0.85 + 0.001 * s, metric="accuracy", skipped=12) for c in full
            for s in range(5)]
    table = _report.text_table(rows, full)
    assert max(map(len, table.splitlines())) <= _report.CONSOLE_WIDTH
    assert "35..38 (14 groups)" in table
    # Narrower still: the columns split into more tables, none wider than asked.
    narrow = _report.text_table(rows, full, width=50)
    assert max(map(len, narrow.splitlines())) <= 50 and narrow.count("\n\n") > 1


def test_verdict_follows_the_numbers():
    rows = _quick_rows()
    line = _report.verdict(rows, list(_GAPS))
    # ada-module's mean gap (2.3e-5) is the smallest; ada-global's (3.7e-5) rounds to the
    # same +0.0000 and is named with it; bf16's is -0.0001.
    assert line == ("Verdict: adaptive fp16 matches fp32 within noise (0 of 120 steps "
                    "skipped); closest to fp32: fp16-ada-module, fp16-ada-global "
                    "(+0.0000 bits/byte).")
    # One adaptive config clearly worse (bits/byte: higher is worse), skips counted.
    gaps = {**_GAPS, "fp16-ada-global": (0.02, 0.021, 0.019)}
    rows = _quick_rows(gaps)
    for r in rows:
        r["skipped"] = 2 if r["config"] == "fp16-ada-global" else 0
    line = _report.verdict(rows, list(gaps))
    assert ("fp16-ada-global is worse than fp32 beyond noise (+0.0200 ± 0.0010 bits/byte, "
            "6 of 60 steps skipped); fp16-ada-module matches fp32 within noise (0 of 60 steps "
            "skipped)") in line
    assert "closest to fp32: fp16-ada-module (+0.0000" in line
    # Accuracy: higher is better, so the same positive gap is "better".
    rows = _quick_rows(gaps, metric="accuracy")
    assert "fp16-ada-global is better than fp32" in _report.verdict(rows, list(gaps))
    # A diverged adaptive run is said, and is never the closest.
    rows = _quick_rows()
    for r in rows:
        if r["config"] == "fp16-ada-module" and r["seed"] == 1:
            r.update(diverged=True, quality=float("nan"))
    line = _report.verdict(rows, list(_GAPS))
    assert "fp16-ada-module diverged in 1 of 3 runs" in line
    assert line.endswith("closest to fp32: fp16-ada-global (+0.0000 bits/byte).")
    assert "no fp32" in _report.verdict([r for r in rows if r["config"] != "fp32"],
                                        list(_GAPS))


def test_quick_console_and_report(small_gpt, tmp_path, monkeypatch, capsys):
    """`--quick` as a new user sees it, with made-up runs (no training): tables within 80
    columns, the verdict last and from the numbers, a report that mentions only what the
    run has (bits/byte, the tiny regime: no Fashion-MNIST, no ordinary regime)."""
    class FakeRunner:
        def __init__(self, task, config, regime, steps):
            self.task, self.config, self.regime, self.steps = task, config, regime, steps

        def run(self, seed, on_step=None):
            c = self.config.name
            return _row(c, seed, 3.4 + 0.01 * seed + _GAPS[c][seed],
                        task=self.task.name, regime=self.regime, steps=self.steps,
                        settings=self.task.settings)

    monkeypatch.setattr(_runner, "Runner", FakeRunner)
    out = str(tmp_path / "res")
    assert _cli.main(["--quick", "--out", out, "--no-plots"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    legend = next(i for i, x in enumerate(lines) if x.startswith("gap to fp32:"))
    assert lines[0].startswith("code-gpt, tiny regime: bits/byte (lower is better), 3 seeds")
    assert max(map(len, lines[:legend + 6])) <= 80  # tables and legend
    rows = _report.read_rows(os.path.join(out, "runs.jsonl"))
    assert len(rows) == 18
    assert lines[-1] == _report.verdict(rows, list(_configs.QUICK))
    assert lines[-1].startswith("Verdict: adaptive fp16 matches fp32 within noise")
    report = open(os.path.join(out, "report.md")).read()
    assert "bits/byte (lower is better)" in report and lines[-1][len("Verdict:"):] in report
    for absent in ("Fashion-MNIST", "accuracy", "ordinary"):
        assert absent not in report


def test_plots_tell_every_curve_apart(tmp_path, monkeypatch):
    """No two configurations (loss and root-scale panels) and no two scale groups share a
    colour, line style and marker; the loss curves carry markers."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    seen: dict = {}
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, *args, **kwargs):
        if kwargs.get("label"):
            seen.setdefault(id(self), []).append(
                (kwargs["label"], kwargs.get("color"), kwargs.get("ls"), kwargs.get("marker"),
                 kwargs.get("markevery")))
        return real_plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    written = _report.plot_group(_quick_rows(), list(_GAPS), "t", str(tmp_path / "g"))
    assert [os.path.basename(p) for p in written] == ["g_loss.png", "g_underflow.png",
                                                      "g_scales.png"]
    panels = list(seen.values())
    assert [len(p) for p in panels] == [6, 5, 3, 15]  # loss, gap, root scale, groups
    for lines in panels:
        assert len({line[1:4] for line in lines}) == len(lines), lines
    assert all(line[4] is not None for line in panels[0])
    styles = _report.line_styles(40)
    assert len({(str(s["color"]), s["ls"], s["marker"]) for s in styles}) == 40
