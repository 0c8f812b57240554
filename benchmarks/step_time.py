"""Step time of bench configurations side by side, on one bench task.

The bench's ms/step column times each run on its own, so load on a shared machine moves
it; here every configuration's jitted step (the bench's own ``Runner.step``) is timed in
interleaved rounds, so noise hits all of them alike, and ratios against ``--base`` are
printed (median over rounds).

Usage::

    python benchmarks/step_time.py --task code-gpt-deep \\
        --configs fp16-dynamic,fp16-ada-module,e4m3-module,fp8-flax
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from adaloss_jax.bench import _configs, _runner, _tasks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="code-gpt-deep", choices=list(_tasks.TASKS))
    p.add_argument("--regime", default="tiny", choices=list(_runner.REGIMES))
    p.add_argument("--configs", default="fp32,fp16-dynamic,fp16-ada-global,fp16-ada-module,"
                   "e4m3-global,e4m3-module,fp8-flax")
    p.add_argument("--base", default="fp16-dynamic", help="the configuration ratios are to")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps per configuration per round")
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in [*names, args.base] if c not in _configs.CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; valid: {', '.join(_configs.CONFIGS)}")
    if args.base not in names:
        names.insert(0, args.base)
    task = _tasks.TASKS[args.task]
    batch = task.batches(0, args.steps)
    runs = {}
    for c in names:
        t0 = time.perf_counter()
        runner = _runner.Runner(task, _configs.CONFIGS[c], args.regime, args.steps)
        carry = runner.init(0)
        carry = jax.block_until_ready(runner.step(carry, batch(0))[0])  # compiles
        runs[c] = [runner, carry, []]
        print(f"{c:<16} first step (trace + compile + run) {time.perf_counter() - t0:6.1f} s",
              flush=True)
    for _ in range(args.rounds):
        for c in names:
            runner, carry, times = runs[c]
            t0 = time.perf_counter()
            for i in range(args.steps):
                carry = runner.step(carry, batch(i))[0]
            jax.block_until_ready(carry)
            times.append((time.perf_counter() - t0) / args.steps)
            runs[c][1] = carry
    base = statistics.median(runs[args.base][2])
    print(f"\n{args.task}, {args.regime} regime: median of {args.rounds} interleaved rounds "
          f"x {args.steps} steps")
    print(f"{'config':<16} {'ms/step':>8} {'x ' + args.base:>16}")
    for c in names:
        m = statistics.median(runs[c][2])
        print(f"{c:<16} {1e3 * m:8.1f} {m / base:16.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
