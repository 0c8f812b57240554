"""Where a training step's time goes, per configuration of ``overhead.py``: the events of
a profiler trace of a few steps, summed by name, beside dynamic scaling's.

For a GPT of ``overhead.py`` (the small one by default), compiles one jitted training
step per configuration, takes ``--warmup`` steps (so the scales have settled and no step
retries), then runs ``--steps`` more under ``jax.profiler.trace`` and reads the trace.
Per configuration and per step it prints the time and count of:

* every event on a device's timeline (a GPU's kernels and copies), or where the trace has
  none (the CPU backend) every event on the host threads that run the compiled program;
* host-device copies (``memcpy``/``DtoH``/``HtoD`` in the name): a ``while`` loop's
  condition or a conditional's predicate read on the host would show up there;
* control flow (``while``/``conditional`` in the name);
* the host's time in the jitted call itself (``PjitFunction``: flattening the arguments,
  launching, the outputs),

and the ``--top`` kinds of event that take most time beyond dynamic scaling's (XLA's
names without their instance numbers: a fused kernel is named after its operations).
Made for a GPU (``docs/results.md``, section 7, says why); on the CPU machine the
kernels are named only in part (most run as ``ThunkExecutor::Execute``).

Run: ``python benchmarks/step_profile.py`` (a minute or two);
``--configs dynamic,adaptive,adaptive-retry --size gpu --batch 64 --top 15``.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402

COPY = ("memcpy", "dtoh", "htod", "copy to host", "copy from host")
CONTROL = ("while", "conditional")


def _kind(name: str) -> str:
    """An event's name without XLA's instance numbers (``loop_add_fusion_12``,
    ``ynn_fusion.3``): kernels of one kind add up, across configurations alike."""
    return re.sub(r"([._]\d+)+$", "", name)


def summarise(trace: list[dict], steps: int) -> dict:
    """Per step: the seconds and count of each event name on the devices' timelines (the
    host's where there is no device timeline), and the totals of copies and control
    flow."""
    device = [e for e in trace if "/device:" in e["process"].lower()
              and "cpu" not in e["process"].lower()]
    host = [e for e in trace if e["process"].lower().startswith("/host:")
            and not e["name"].startswith("$")]  # ("$...": the Python tracer's frames)
    events = device or host
    by_name: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        name = _kind(e["name"])
        by_name[name] += e.get("dur", 0) / 1e6 / steps
        count[name] += 1 / steps
    low = {n: n.lower() for n in by_name}
    pick = lambda keys: [n for n in by_name if any(k in low[n] for k in keys)]
    return {
        "timeline": "device" if device else "host",
        # the host's time in the jitted call itself (arguments in, launch, outputs out)
        "dispatch_s": sum(e.get("dur", 0) for e in host
                          if e["name"].startswith("PjitFunction")) / 1e6 / steps,
        "by_name": by_name, "count": count,
        "total_s": sum(by_name.values()), "events": sum(count.values()),
        "copies": sum(count[n] for n in pick(COPY)),
        "copy_s": sum(by_name[n] for n in pick(COPY)),
        "control": sum(count[n] for n in pick(CONTROL)),
        "control_s": sum(by_name[n] for n in pick(CONTROL)),
    }


def profile(config: str, size: str, batch: int | None, warmup: int, steps: int) -> dict:
    data, model, params = overhead.one_model(config, size, batch)
    tx, step = overhead.build_step(config, model, params)
    compiled = jax.jit(step).lower(params, tx.init(params), data).compile()
    state = [params, tx.init(params)]

    def run(n):
        loss = None
        for _ in range(n):
            state[0], state[1], loss = compiled(state[0], state[1], data)
        jax.block_until_ready(loss)

    run(warmup)
    return summarise(overhead.profiler_events(lambda: run(steps)), steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="dynamic,adaptive,adaptive-retry",
                        help=f"comma list of {list(overhead.ALL_CONFIGS)}; the first is "
                             "the baseline")
    parser.add_argument("--size", default="small", choices=list(overhead.SIZES))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in overhead.ALL_CONFIGS:
            parser.error(f"unknown config {c!r}; valid: {', '.join(overhead.ALL_CONFIGS)}")
    out = {}
    for c in configs:
        print(f"  profiling {c}", file=sys.stderr)
        out[c] = profile(c, args.size, args.batch, args.warmup, args.steps)
    base = out[configs[0]]
    print(f"# jax {jax.__version__}, backend {jax.default_backend()}, size {args.size}; "
          f"{args.steps} steps after {args.warmup}, per step; events of the "
          f"{base['timeline']} timeline (ms, and counts)")
    print(f"{'config':<18} {'events ms':>10} {'events':>8} {'copies':>7} {'copy ms':>8} "
          f"{'control':>8} {'ctl ms':>7} {'dispatch ms':>12}")
    for c, s in out.items():
        print(f"{c:<18} {1e3 * s['total_s']:>10.2f} {s['events']:>8.0f} {s['copies']:>7.0f} "
              f"{1e3 * s['copy_s']:>8.2f} {s['control']:>8.0f} {1e3 * s['control_s']:>7.2f} "
              f"{1e3 * s['dispatch_s']:>12.3f}")
    for c in configs[1:]:
        s = out[c]
        extra = {n: s["by_name"][n] - base["by_name"].get(n, 0.0) for n in s["by_name"]}
        print(f"# {c}: the {args.top} event names with most time beyond {configs[0]}'s "
              "(ms per step, count per step)")
        for n, t in sorted(extra.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {1e3 * t:>8.3f}  {s['count'][n]:>6.1f}  {n[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
