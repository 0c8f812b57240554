"""Tests of the bench (adaloss_jax.bench): CLI, runner, regimes, data, report, progress."""

import dataclasses
import io
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
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
    # Tiny regime: the adaptive scaler's first pass flushes everything at scale 1 (as
    # fp16 without scaling would); its scales jump and the step is computed again at
    # them (a retry) and applied.
    ada = rows["fp16-ada-module"]
    assert ada["applied_curve"][0] is True and ada["retried"] >= 1 and ada["skipped"] == 0
    assert ada["probes"][0]["underflow"] < 0.5
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


@pytest.mark.parametrize("config", ["fp8-flax", "fp8-current"])
def test_fp8_peers_refuse_a_model_without_fp8_layers(small_gpt, config):
    """A model that ignores dot_general_cls would train in plain bf16 under an fp8
    label: refused, naming the tasks that take it."""
    plain = dataclasses.replace(
        small_gpt, make_model=lambda dtype, dg: _models.GPT(layers=1, d_model=32, heads=2,
                                                            context=64, dtype=dtype))
    runner = _runner.Runner(plain, _configs.CONFIGS[config], "tiny", 2)
    with pytest.raises(ValueError, match="no dense layer that takes dot_general_cls.*"
                                         "fmnist-sigmoid"):
        runner.init(0)


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
