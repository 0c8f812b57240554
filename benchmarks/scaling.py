"""Data-parallel step time of dynamic and adaptive scaling from 1 to 8 CPU devices.

A byte-level GPT (the model of ``underflow_table.py``) is trained in fp16 with a fixed
global batch sharded over a ``data`` mesh of 1, 2, 4 and 8 devices, in two ways:

* ``spmd``: one ``jax.jit`` over arrays with a ``NamedSharding`` (batch split, parameters
  and optimizer state replicated); statistics are global by construction.
* ``shard_map``: ``jax.shard_map`` over the batch, each device computing its shard's
  loss (divided by the device count, so that the summed gradients are the global
  mean's), with ``axis_name="data"`` on the unscale transformation.

Configurations: ``dynamic`` (global dynamic scaling), ``adaptive-global``
(``alj.adaptive()``) and ``adaptive-module`` (``groups="module"``). Step times are the
median of interleaved rounds (every configuration and device count in each round).
The 8-device run is checked against the 1-device run after the same steps from the same
start: equal scales and skip counters, and parameters equal up to fp rounding (the
batch reductions are summed in another order), reported as the largest parameter
difference relative to the largest parameter change. The optimizer is SGD with momentum
(the step cost of the scalers does not depend on it).

The devices are XLA's host-platform devices (``--xla_force_host_platform_device_count``):
on a machine with few cores they share the same cores, so this shows the cost of the
sharded program (partitioning, collectives of the statistics) and its correctness, not a
speed-up.

Run: ``python benchmarks/scaling.py`` (a few minutes on 2 cores); ``--size small`` for the
4-layer d=128 GPT of ``overhead.py``.
"""

from __future__ import annotations

import os

# Before jax initialises its backends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from underflow_table import GPT  # noqa: E402

import adaloss_jax as alj  # noqa: E402
from adaloss_jax.bench._steps import scaled_step  # noqa: E402

SIZES = {  # name: (layers, d_model, heads, context, global batch)
    "tiny": (2, 64, 4, 64, 16),
    "small": (4, 128, 4, 128, 16),
}
CONFIGS = ("dynamic", "adaptive-global", "adaptive-module")
MODES = ("spmd", "shard_map")


def make_step(config: str, mode: str, model, mesh):
    """``(tx, step)``: ``step(params, opt_state, batch) -> (params, opt_state, loss)``."""
    n = mesh.size
    axis = "data" if mode == "shard_map" else None
    # SGD, not Adam: Adam's first steps are ~lr * sign(g), so a gradient element near zero
    # whose sign flips with the batch reduction order would dominate the 8 vs 1 check.
    inner = optax.sgd(0.1, momentum=0.9)

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch[:, :-1]).astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        # Under shard_map the replicated parameters' gradients are summed over devices.
        return loss / n if mode == "shard_map" else loss

    scaling = alj.dynamic() if config == "dynamic" else alj.adaptive(
        groups="global" if config == "adaptive-global" else "module")
    tx, body = scaled_step(loss_fn, inner, scaling, axis_name=axis)

    if mode == "spmd":
        return tx, jax.jit(body)

    def local(params, opt_state, batch):
        params, opt_state, loss = body(params, opt_state, batch)
        return params, opt_state, jax.lax.psum(loss, "data")

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                           out_specs=(P(), P(), P()))
    return tx, jax.jit(mapped)


def state_summary(config: str, opt_state) -> dict:
    """Scales and counters as plain numbers (for the 8 vs 1 device check)."""
    if config == "dynamic":
        st = alj.scale_state(opt_state)
        return {"scale": float(st.loss_scale), "skipped": int(st.total_skipped)}
    st = alj.scale_state(opt_state)
    out = {f"s[{g}]": float(v) for g, v in st.log2_scales.items()}
    out["skipped"] = int(st.base.total_skipped)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--check-steps", type=int, default=4)
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.devices.split(",")]
    if max(counts) > jax.device_count():
        parser.error(f"only {jax.device_count()} devices")
    layers, d, heads, ctx, batch = SIZES[args.size]
    if any(batch % n for n in counts):
        parser.error(f"the global batch {batch} must split evenly over {counts}")
    model = GPT(layers=layers, d_model=d, heads=heads, context=ctx, dtype=jnp.float16)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(args.check_steps, batch, ctx + 1)).astype(np.int32)
    params0 = model.init(jax.random.key(0), jnp.asarray(data[0, :, :-1]))["params"]

    runs = {}  # (n, mode, config) -> dict
    for n in counts:
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                             axis_types=(jax.sharding.AxisType.Auto,))
        rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        for mode in MODES:
            for config in CONFIGS:
                tx, step = make_step(config, mode, model, mesh)
                params, opt_state = jax.device_put((params0, tx.init(params0)), rep)
                batches = [jax.device_put(b, shard) for b in data]
                t0 = time.perf_counter()
                compiled = step.lower(params, opt_state, batches[0]).compile()
                compile_s = time.perf_counter() - t0
                for b in batches:  # the steps the 8 vs 1 check compares
                    params, opt_state, loss = compiled(params, opt_state, b)
                jax.block_until_ready(loss)
                runs[(n, mode, config)] = dict(
                    compiled=compiled, state=[params, opt_state], batch=batches[0],
                    compile_s=compile_s, times=[], params=jax.device_get(params),
                    summary=state_summary(config, opt_state), loss=float(loss))
        print(f"  compiled and checked {n} device(s)", file=sys.stderr)

    for r in range(args.rounds):
        for run in runs.values():
            compiled, state = run["compiled"], run["state"]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state[0], state[1], loss = compiled(state[0], state[1], run["batch"])
            jax.block_until_ready(loss)
            run["times"].append((time.perf_counter() - t0) / args.steps)
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)

    print(f"# jax {jax.__version__}, {os.cpu_count()} CPUs, {jax.device_count()} host devices; "
          f"GPT {args.size} (layers, d, heads, context, global batch) = {SIZES[args.size]}; "
          f"median of {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'mode':<10} {'config':<16} " + " ".join(f"{f'{n} dev ms':>9}" for n in counts)
          + " " + " ".join(f"{f'x1 @{n}':>7}" for n in counts[1:])
          + f" {'x dyn @' + str(counts[-1]):>10}")
    for mode in MODES:
        for config in CONFIGS:
            ms = [1e3 * statistics.median(runs[(n, mode, config)]["times"]) for n in counts]
            dyn = 1e3 * statistics.median(runs[(counts[-1], mode, "dynamic")]["times"])
            print(f"{mode:<10} {config:<16} " + " ".join(f"{m:>9.1f}" for m in ms) + " "
                  + " ".join(f"{m / ms[0]:>7.2f}" for m in ms[1:]) + f" {ms[-1] / dyn:>10.3f}")

    lo, hi = counts[0], counts[-1]
    print(f"\n# {hi} devices vs {lo} after {args.check_steps} steps from the same start")
    print(f"{'mode':<10} {'config':<16} {'scales+counters':>16} {'max|dp|/max|step|':>18} "
          f"{'loss diff':>10}")
    ok = True
    for mode in MODES:
        for config in CONFIGS:
            a, b = runs[(lo, mode, config)], runs[(hi, mode, config)]
            same = a["summary"] == b["summary"]
            la = jax.tree_util.tree_leaves(a["params"])
            lb = jax.tree_util.tree_leaves(b["params"])
            l0 = jax.tree_util.tree_leaves(params0)
            diff = max(float(np.max(np.abs(x - y))) for x, y in zip(la, lb))
            moved = max(float(np.max(np.abs(x - np.asarray(z)))) for x, z in zip(la, l0))
            rel = diff / moved
            ok &= same and rel < 1e-2
            print(f"{mode:<10} {config:<16} {str(same):>16} {rel:>18.2e} "
                  f"{abs(a['loss'] - b['loss']):>10.2e}")
    print("\nresult:", "8 devices equal 1 device (scales exactly, parameters within 1e-2 of "
          "the update)" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
