"""Overhead of adaptive scaling against dynamic global scaling, side by side.

For a byte-level GPT (the model of ``underflow_table.py``) in fp16, compiles one jitted
training step per configuration and reports compile time (trace + lower + XLA compile of
a fresh ``jax.jit``, median of ``--compile-repeats`` interleaved repeats; ``--phases``
also prints the three apart, with the compiled program's fused kernels), XLA's temporary
memory, the host round trips found in the compiled HLO (callbacks, infeed/outfeed,
send/recv) and the steady-state step time, measured in interleaved rounds so that machine
noise hits every configuration alike. Ratios are against ``dynamic``.

Run: ``python benchmarks/overhead.py`` (a few minutes on 2 CPU cores);
``--processes 4`` runs the whole measurement in 4 fresh processes one after another and
prints each ratio's median and range over them (on a shared machine a process's ratios
move with the load from one process to the next, docs/results.md section 6: one run does
not decide a bound);
``--sizes small,large --layers 2,4,8`` for the growth with depth; ``--scan`` for the
same GPT with its blocks in one ``nn.scan`` (one compiled block whatever the depth):
``--scan --sizes small --layers 4,8,16,32``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from underflow_table import GPT  # noqa: E402

import adaloss_jax as alj  # noqa: E402
from adaloss_jax.bench._steps import scaled_step  # noqa: E402

SIZES = {  # name: (layers, d_model, heads, context, batch)
    "small": (4, 128, 4, 128, 16),  # the text-gpt model of the benchmarks
    "large": (6, 512, 8, 128, 8),
    "gpu": (12, 768, 12, 256, 8),  # benchmarks/gpu_check.py (batch: set to a >= 50 ms step)
}
CONFIGS = ("dynamic", "adaptive-global", "adaptive")
# Every configuration: compute dtype and scaling ("dynamic" is the baseline of the ratios).
ALL_CONFIGS = {
    "fp32": (jnp.float32, None),
    "bf16": (jnp.bfloat16, None),
    "dynamic": (jnp.float16, lambda: alj.dynamic()),
    "adaptive-global": (jnp.float16, lambda: alj.adaptive(groups="global")),
    # Per module: same-step scales since 0.3 (before, "adaptive" was "adaptive-delayed").
    "adaptive": (jnp.float16, lambda: alj.adaptive(groups="module")),
    # The same with the in-step retry loop (retries=4; the default until 0.4).
    "adaptive-retry": (jnp.float16, lambda: alj.adaptive(groups="module", retries=4)),
    # One group per block, points only at block boundaries (the GPT's blocks, embedding and
    # final norm are its top-level modules).
    "adaptive-block": (jnp.float16, lambda: alj.adaptive(groups="module", max_depth=1)),
    "global-block": (jnp.float16, lambda: alj.adaptive(groups="global", max_depth=1)),
    "e4m3-sim": (jnp.float16, lambda: alj.adaptive(groups="module", simulate=True,
                                                   grad_dtype="float8_e4m3fn")),
    # Scales chosen in the backward pass (same_step=True, the default per module: as
    # "adaptive" and "adaptive-retry"), and every scale the rule's (same_step=False), without
    # and with the retry loop.
    "adaptive-same": (jnp.float16, lambda: alj.adaptive(groups="module", same_step=True)),
    "adaptive-same-retry": (jnp.float16, lambda: alj.adaptive(groups="module", same_step=True,
                                                              retries=4)),
    "adaptive-delayed": (jnp.float16, lambda: alj.adaptive(groups="module", same_step=False)),
    "adaptive-delayed-retry": (jnp.float16, lambda: alj.adaptive(
        groups="module", same_step=False, retries=4)),
}
HOST_PATTERNS = ("callback", "outfeed", "infeed", " send(", " recv(", "host_compute")


def build_step(config: str, model, params):
    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    make = ALL_CONFIGS[config][1]
    tx, step = scaled_step(loss_fn, optax.adamw(1e-3),
                           alj.no_scaling() if make is None else make())
    return tx, step


def one_model(config: str, size: str, batch: int | None = None):
    """``(data, model, params)``: a random byte batch and the GPT of ``size`` in
    ``config``'s compute dtype (``batch``: the size's own by default)."""
    n_layers, d, heads, ctx, default_batch = SIZES[size]
    data = jnp.asarray(np.random.default_rng(0).integers(
        0, 256, size=(batch or default_batch, ctx + 1)), jnp.int32)
    model = GPT(layers=n_layers, d_model=d, heads=heads, context=ctx,
                dtype=ALL_CONFIGS[config][0])
    return data, model, model.init(jax.random.key(0), data[:, :-1])["params"]


def profiler_events(run) -> list[dict]:
    """The complete events (``ph == "X"``) of a ``jax.profiler`` trace of ``run()``, each
    with its process's name as ``"process"`` (``benchmarks/compile_passes.py``,
    ``benchmarks/step_profile.py``)."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            run()
        path = glob.glob(f"{log_dir}/**/*perfetto_trace.json.gz", recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    trace = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [{**e, "process": names.get(e.get("pid"), "")} for e in trace
            if e.get("ph") == "X"]


def host_round_trips(hlo_text: str) -> int:
    return sum(hlo_text.count(p) for p in HOST_PATTERNS)


def fused_kernels(hlo_text: str) -> int:
    """The fused kernels of a compiled program (its ``fusion`` instructions)."""
    return hlo_text.count(" fusion(")


def compile_step(step, args: tuple, clock=time.perf_counter):
    """``(compiled, (trace, lower, xla))``: a fresh ``jax.jit(step)`` compiled for
    ``args``, and the seconds each phase took."""
    t0 = clock()
    traced = jax.jit(step).trace(*args)
    t1 = clock()
    lowered = traced.lower()
    t2 = clock()
    compiled = lowered.compile()
    return compiled, (t1 - t0, t2 - t1, clock() - t2)


def interleaved_times(runners: dict, data: tuple, rounds: int, steps: int,
                      label: str = "") -> dict[str, list[float]]:
    """Seconds per step of each ``runners[config] = (compiled, [params, opt_state])``
    (``compiled(params, opt_state, *data) -> (params, opt_state, loss)``; the state is
    carried on in place), ``steps`` steps a round, in interleaved rounds (ABCABC...) so
    that load from other processes hits every configuration alike."""
    times: dict[str, list[float]] = {c: [] for c in runners}
    for r in range(rounds):
        for config, (compiled, state) in runners.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                state[0], state[1], loss = compiled(state[0], state[1], *data)
            jax.block_until_ready(loss)
            times[config].append((time.perf_counter() - t0) / steps)
        print(f"  {label} round {r + 1}/{rounds}", file=sys.stderr)
    return times


def measure(size: str, layers: int | None, rounds: int, steps: int,
            compile_repeats: int = 3, configs=CONFIGS, batch: int | None = None,
            scan: bool = False, clock=time.perf_counter) -> list[dict]:
    n_layers, d, heads, ctx, default_batch = SIZES[size]
    n_layers, batch = layers or n_layers, batch or default_batch
    rng = np.random.default_rng(0)
    data = jnp.asarray(rng.integers(0, 256, size=(batch, ctx + 1)), jnp.int32)
    models = {c: GPT(layers=n_layers, d_model=d, heads=heads, context=ctx,
                     dtype=ALL_CONFIGS[c][0], scan=scan) for c in configs}
    params = models[configs[0]].init(jax.random.key(0), data[:, :-1])["params"]
    rows, runners, steps_of = [], {}, {}
    for config in configs:
        tx, step = build_step(config, models[config], params)
        steps_of[config] = (tx.init(params), step)
        rows.append({"size": size, "layers": n_layers, "d_model": d, "config": config,
                     "batch": batch, "compile_times": [], "times": [], "phases": []})
    model_of = models
    # Interleaved (ABCABC...) so that load from other processes hits every config alike.
    for _ in range(compile_repeats):
        for row in rows:
            opt_state, _ = steps_of[row["config"]]
            # A fresh step function each time: jax caches traces and executables by it.
            _, step = build_step(row["config"], model_of[row["config"]], params)
            compiled, phases = compile_step(step, (params, opt_state, data), clock)
            row["compile_times"].append(sum(phases))
            row["phases"].append(phases)
            runners[row["config"]] = (compiled, [params, opt_state])
    for row in rows:
        compiled, state = runners[row["config"]]
        mem = compiled.memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", float("nan")) if mem is not None else np.nan
        row["compile_s"] = statistics.median(row["compile_times"])
        row["trace_s"], row["lower_s"], row["xla_s"] = (
            statistics.median(p) for p in zip(*row["phases"]))
        row["kernels"] = fused_kernels(compiled.as_text())
        row["temp_bytes"] = temp
        row["host_round_trips"] = host_round_trips(compiled.as_text())
        jax.block_until_ready(compiled(*state, data))  # warm-up
    times = interleaved_times(runners, (data,), rounds, steps, f"[{size} L={n_layers}]")
    for row in rows:
        row["times"] = times[row["config"]]
    base = next((r for r in rows if r["config"] == "dynamic"), rows[0])
    for row in rows:
        row["step_ms"] = 1e3 * statistics.median(row["times"])
        row["step_ratio"] = row["step_ms"] / (1e3 * statistics.median(base["times"]))
        row["compile_ratio"] = row["compile_s"] / base["compile_s"]
        row["temp_ratio"] = row["temp_bytes"] / base["temp_bytes"] if base["temp_bytes"] else 1.0
        row["spread_ms"] = 1e3 * (max(row["times"]) - min(row["times"]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="small,large", help=f"comma list of {list(SIZES)}")
    parser.add_argument("--layers", default="", help="comma list of layer counts (override)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--compile-repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per step (default: each size's own)")
    parser.add_argument("--scan", action="store_true", help="the blocks in one nn.scan")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="compile time as this process's CPU seconds (steadier than "
                             "wall time where other jobs share the cores)")
    parser.add_argument("--phases", action="store_true",
                        help="also print trace, lower and XLA compile apart (medians) "
                             "and the compiled program's fused kernels")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma list of {list(ALL_CONFIGS)}")
    parser.add_argument("--processes", type=int, default=1,
                        help="repeat the whole measurement in this many fresh processes, "
                             "one after another, and print each ratio's median and range")
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)  # (a child's rows)
    args = parser.parse_args(argv)
    if args.processes > 1:
        return over_processes(argv if argv is not None else sys.argv[1:], args.processes)
    configs = tuple(c for c in args.configs.split(",") if c)
    for c in configs:
        if c not in ALL_CONFIGS:
            parser.error(f"unknown config {c!r}; valid: {', '.join(ALL_CONFIGS)}")
    sizes = [s for s in args.sizes.split(",") if s]
    for s in sizes:
        if s not in SIZES:
            parser.error(f"unknown size {s!r}; valid: {', '.join(SIZES)}")
    layer_list = [int(x) for x in args.layers.split(",") if x] or [None]
    print(f"# jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs; median of {args.rounds} rounds x {args.steps} steps, "
          f"compile: median of {args.compile_repeats}"
          f"{' (CPU seconds)' if args.cpu_clock else ''}"
          f"{'; blocks in one nn.scan' if args.scan else ''}")
    header = ("size", "layers", "d", "config", "step ms", "x dyn", "compile s", "x dyn",
              "temp MiB", "x dyn", "host trips")
    print("{:<6} {:>6} {:>4} {:<16} {:>8} {:>6} {:>9} {:>6} {:>9} {:>6} {:>10}".format(*header))
    rows = []
    for size in sizes:
        for layers in layer_list:
            for r in measure(size, layers, args.rounds, args.steps,
                             args.compile_repeats, configs, scan=args.scan, batch=args.batch,
                             clock=time.process_time if args.cpu_clock else time.perf_counter):
                rows.append(r)
                print(f"{r['size']:<6} {r['layers']:>6} {r['d_model']:>4} {r['config']:<16} "
                      f"{r['step_ms']:>8.1f} {r['step_ratio']:>6.3f} {r['compile_s']:>9.2f} "
                      f"{r['compile_ratio']:>6.2f} {r['temp_bytes'] / 2**20:>9.1f} "
                      f"{r['temp_ratio']:>6.2f} {r['host_round_trips']:>10d}")
    if args.phases:
        print("# compile phases, seconds (median of the repeats), and fused kernels")
        print("{:<6} {:>6} {:<16} {:>7} {:>7} {:>7} {:>8}".format(
            "size", "layers", "config", "trace", "lower", "XLA", "kernels"))
        for r in rows:
            print(f"{r['size']:<6} {r['layers']:>6} {r['config']:<16} {r['trace_s']:>7.2f} "
                  f"{r['lower_s']:>7.2f} {r['xla_s']:>7.2f} {r['kernels']:>8d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k not in ("times", "compile_times",
                                                                 "phases")} for r in rows], f)
    slopes = compile_slopes(rows)
    if slopes:
        print("# compile seconds per added layer (least squares over the depths), and as a "
              "multiple of dynamic's slope")
        for (size, config), (slope, ratio) in slopes.items():
            print(f"{size:<6} {config:<16} {slope:>7.3f} s/layer {ratio:>6.2f} x dyn")
    return 0


def over_processes(argv: list[str], n: int) -> int:
    """The measurement ``argv`` asks for, in ``n`` fresh processes one after another (a
    process's own ratios move with the machine's load and with what its first compile
    warmed), then the median and range of each ratio over them."""
    argv = [a for i, a in enumerate(argv) if not a.startswith("--processes")
            and not (i and argv[i - 1] == "--processes")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            out = os.path.join(tmp, f"{i}.json")
            print(f"# process {i + 1}/{n}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--json", out],
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs.append(json.load(f))
    print(f"# ratios to dynamic over {n} fresh processes: median [min, max]")
    print("{:<6} {:>6} {:<16} {:>22} {:>22}".format("size", "layers", "config", "step x dyn",
                                                      "compile x dyn"))
    for key, ratios in spread(runs).items():
        size, layers, config = key
        cells = [f"{statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]"
                 for v in (ratios["step_ratio"], ratios["compile_ratio"])]
        print(f"{size:<6} {layers:>6} {config:<16} {cells[0]:>22} {cells[1]:>22}")
    return 0


def spread(runs: list[list[dict]]) -> dict:
    """``{(size, layers, config): {"step_ratio": [...], "compile_ratio": [...]}}``, one
    value per run, in the order the first run measured them."""
    out: dict = {}
    for rows in runs:
        for r in rows:
            cell = out.setdefault((r["size"], r["layers"], r["config"]),
                                  {"step_ratio": [], "compile_ratio": []})
            cell["step_ratio"].append(r["step_ratio"])
            cell["compile_ratio"].append(r["compile_ratio"])
    return out


def compile_slopes(rows: list[dict]) -> dict:
    """``{(size, config): (seconds per layer, ratio to dynamic's slope)}`` where a
    (size, config) was measured at two or more depths; the ratio is nan without dynamic."""
    by = {}
    for r in rows:
        by.setdefault((r["size"], r["config"]), []).append((r["layers"], r["compile_s"]))
    fits = {k: float(np.polyfit(*zip(*v), 1)[0]) for k, v in by.items()
            if len({n for n, _ in v}) > 1}
    return {(size, c): (m, m / fits[(size, "dynamic")] if (size, "dynamic") in fits
                        else float("nan"))
            for (size, c), m in fits.items()}


if __name__ == "__main__":
    raise SystemExit(main())

