"""Where XLA's compile time goes, per configuration of ``overhead.py``: the CPU compiler's
own phases and its slowest HLO passes, read from a profiler trace of one compile.

For the small GPT of ``overhead.py`` in fp16, lowers one jitted training step per
configuration, compiles it under ``jax.profiler.trace`` and sums the trace's events by
name (wall seconds; a pass that runs in several pipelines counts once per run). Shows
what the retry loop of ``AdaptiveScale.retries`` costs at compile time beside the same
step without it: the HLO passes that handle a ``while`` loop (loop-invariant code
motion, which hoists the forward pass out of the loop, and the loop simplifier) and the
backend's time on the loop's extra kernels.

Run: ``python benchmarks/compile_passes.py`` (about a minute);
``--configs dynamic,adaptive,adaptive-retry --top 12``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402

# The compiler's phases, in the order they nest (XLA's CPU backend, jax 0.10).
PHASES = ("PjRtCpuClient::Compile", "HLO passes through layout assignment (jit_step)",
          "HLO passes after layout assignment (jit_step)", "CpuCompiler::RunBackend",
          "FusionCompiler::Compile")
# Passes that are only there for while loops (besides their share of the rest).
LOOP_PASSES = ("while-loop-invariant-code-motion", "simplify-while-loops")


def events(config: str, size: str = "small") -> collections.Counter:
    """Seconds per trace event name of one compile of ``config``'s step."""
    data, model, params = overhead.one_model(config, size)
    tx, step = overhead.build_step(config, model, params)
    lowered = jax.jit(step).lower(params, tx.init(params), data)
    trace = overhead.profiler_events(lowered.compile)
    out: collections.Counter = collections.Counter()
    for e in trace:
        out[e["name"]] += e.get("dur", 0) / 1e6
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="dynamic,adaptive,adaptive-retry",
                        help=f"comma list of {list(overhead.ALL_CONFIGS)}")
    parser.add_argument("--top", type=int, default=8,
                        help="also list each configuration's slowest HLO passes")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    by_config = {}
    for c in configs:
        print(f"  compiling {c} under the profiler", file=sys.stderr)
        by_config[c] = events(c)
    names = [*PHASES, *LOOP_PASSES]
    width = max(len(n) for n in names)
    print(f"# jax {jax.__version__}, backend {jax.default_backend()}; wall seconds of one "
          f"compile, from a profiler trace")
    print(f"{'phase or pass':{width}s} " + " ".join(f"{c:>14s}" for c in configs))
    for n in names:
        print(f"{n:{width}s} " + " ".join(f"{by_config[c].get(n, 0.0):14.3f}"
                                           for c in configs))
    if args.top:
        skip = set(names) | {"CpuCompiler::CompileCpuExecutable", "TaskDispatcher::dispatch",
                             "Codegen", "JitCompiler::Compile"}
        for c in configs:
            passes = [(v, k) for k, v in by_config[c].items() if k not in skip
                      and not k.startswith(("$", "backend_compile"))
                      and "(jit_step)" not in k and "::" not in k]
            top = ", ".join(f"{k} {v:.2f}" for v, k in sorted(passes, reverse=True)[:args.top])
            print(f"# {c}: slowest passes: {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
