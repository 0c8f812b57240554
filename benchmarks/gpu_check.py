"""The GPU check: one command for a CUDA machine (a few minutes).

1. installs this checkout with the ``cuda`` and ``test`` extras (``--no-install`` skips);
2. runs the test suite (``--no-tests`` skips);
3. on a GPT of 12 layers, d = 768 (context 256), with the batch doubled from 8 until a
   dynamic-scaling step takes at least ``--min-step-ms`` (50), measures step time,
   compile time and XLA temporary memory of fp32, bf16, fp16 with dynamic scaling,
   adaptive global, adaptive per-layer, one group per block (``max_depth=1``) and
   per-layer with simulated e4m3 cotangents, side by side in one process (interleaved
   rounds), as ratios to dynamic scaling;
4. prints the table as markdown for docs/results.md.

Run: ``python benchmarks/gpu_check.py``. On a machine without a GPU it stops after the
tests and says so (``--allow-cpu`` measures anyway, with ``--layers``/``--d`` for a
model a CPU can compile).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--no-tests", action="store_true")
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--min-step-ms", type=float, default=50.0)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768, help="model width (heads: d / 64)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    if not args.no_install:
        print("== installing .[cuda,test]", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".[cuda,test]"],
                       cwd=ROOT, check=True)
    if not args.no_tests:
        print("== test suite", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
        # The suite pins itself to CPU (8 virtual devices): what it checks is the library,
        # which must also pass where a GPU is present.
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q"], cwd=ROOT, env=env)
        print(f"== tests {'passed' if r.returncode == 0 else 'FAILED'}", flush=True)
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import overhead

    backend = jax.default_backend()
    print(f"== jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    if backend != "gpu" and not args.allow_cpu:
        print("no GPU found: the measurement needs one (--allow-cpu measures anyway)")
        return 0
    configs = ("dynamic", "fp32", "bf16", "adaptive-global", "adaptive", "adaptive-block",
               "e4m3-sim")
    overhead.SIZES["check"] = (args.layers, args.d, max(args.d // 64, 1), args.context, 8)
    batch = 8
    while True:  # the smallest batch (doubling) whose dynamic step takes >= min_step_ms
        row = overhead.measure("check", None, 2, 3, 1, ("dynamic",), batch)[0]
        print(f"   batch {batch}: dynamic step {row['step_ms']:.1f} ms", flush=True)
        if row["step_ms"] >= args.min_step_ms or batch >= 1024:
            break
        batch *= 2
    rows = overhead.measure("check", None, args.rounds, args.steps, 3, configs, batch)
    print(f"\nGPT {args.layers} layers, d={args.d}, context {args.context}, batch {batch}; jax "
          f"{jax.__version__} on {jax.devices()[0].device_kind}; median of {args.rounds} "
          f"interleaved rounds x {args.steps} steps, compile: median of 3; ratios to dynamic\n")
    print("| config | step ms | x dynamic | compile s | x dynamic | temp MiB | x dynamic | "
          "host round trips |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['step_ms']:.1f} | {r['step_ratio']:.3f} | "
              f"{r['compile_s']:.2f} | {r['compile_ratio']:.2f} | "
              f"{r['temp_bytes'] / 2**20:.1f} | {r['temp_ratio']:.2f} | "
              f"{r['host_round_trips']} |")
    print(f"\n(whole check: {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
