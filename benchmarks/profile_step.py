"""Where the adaptive scaler's extra compile time and step time go: HLO inspection.

For the byte-level GPT of ``overhead.py``, builds each configuration's jitted training
step and reports, side by side: the time spent tracing (Python), lowering to StableHLO
and compiling with XLA; the size of the lowered module (StableHLO ops) and of the
optimized HLO (instructions, fusions, reductions, library calls for the matmuls);
XLA's cost analysis (flops, bytes accessed) and temporary memory. Nothing is run.
``total_cpu_s`` is this process's CPU time for trace + lower + compile: on a machine
shared with other jobs it varies far less than the wall-clock times.

Run: ``python benchmarks/profile_step.py`` (about a minute on 2 CPU cores);
``--size large`` for the d=512 model; ``--dump DIR`` writes the optimized HLO texts.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import CONFIGS, SIZES, build_step  # noqa: E402
from underflow_table import GPT  # noqa: E402

_OP = re.compile(r"=\s*[\w\[\]{}:,\s]*?\b([a-z][\w-]*)\(")


def hlo_counts(text: str) -> Counter:
    """Opcode counts of the instructions in the entry and fused computations."""
    counts = Counter()
    for line in text.splitlines():
        line = line.strip()
        if "=" not in line or line.startswith(("HloModule", "ENTRY", "%fused", "}")):
            continue
        m = re.search(r"=\s*\S+\s+([a-z][\w-]*)\(", line)
        if m:
            counts[m.group(1)] += 1
    return counts


def entry_counts(text: str) -> Counter:
    """Opcode counts of the top-level (ENTRY) computation: the kernels that run."""
    counts, inside = Counter(), False
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        if inside:
            m = re.search(r"=\s*\S+\s+([a-z][\w-]*)\(", line.strip())
            if m:
                counts[m.group(1)] += 1
    return counts


def profile(config: str, size: str, dump: str | None) -> dict:
    n_layers, d, heads, ctx, batch = SIZES[size]
    model = GPT(layers=n_layers, d_model=d, heads=heads, context=ctx, dtype=jnp.float16)
    data = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, ctx + 1)), jnp.int32)
    params = model.init(jax.random.key(0), data[:, :-1])["params"]
    tx, step = build_step(config, model, params)
    opt_state = tx.init(params)
    c0, t0 = time.process_time(), time.perf_counter()
    traced = jax.jit(step).trace(params, opt_state, data)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3, c3 = time.perf_counter(), time.process_time()
    text = compiled.as_text()
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{size}-{config}.hlo.txt"), "w") as f:
            f.write(text)
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0]
    mem = compiled.memory_analysis()
    stablehlo_ops = sum(1 for ln in lowered.as_text().splitlines() if " = " in ln)
    entry = entry_counts(text)
    allc = hlo_counts(text)
    return {
        "config": config, "trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
        # CPU time of this process for all three: robust to other processes' load.
        "total_cpu_s": c3 - c0,
        "jaxpr_eqns": len(traced.jaxpr.eqns), "stablehlo_ops": stablehlo_ops,
        "hlo_instr": sum(allc.values()), "kernels": sum(
            v for k, v in entry.items() if k not in
            ("parameter", "get-tuple-element", "tuple", "constant", "bitcast", "copy-start",
             "copy-done")),
        "fusions": entry["fusion"], "reduces": allc["reduce"],
        "matmul_calls": entry["custom-call"] + entry["dot"],
        "gflops": cost.get("flops", np.nan) / 1e9,
        "gbytes": cost.get("bytes accessed", np.nan) / 1e9,
        "temp_mib": getattr(mem, "temp_size_in_bytes", np.nan) / 2**20,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dump", default=None, help="folder for the optimized HLO texts")
    args = parser.parse_args(argv)
    rows = [profile(c, args.size, args.dump) for c in args.configs.split(",")]
    keys = [k for k in rows[0] if k != "config"]
    print(f"# jax {jax.__version__}, {args.size} GPT {SIZES[args.size]}")
    print(f"{'':<14}" + "".join(f"{r['config']:>17}" for r in rows))
    for k in keys:
        vals = [r[k] for r in rows]
        fmt = (lambda v: f"{v:>17.2f}") if isinstance(vals[0], float) else (
            lambda v: f"{v:>17d}")
        print(f"{k:<14}" + "".join(fmt(v) for v in vals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
