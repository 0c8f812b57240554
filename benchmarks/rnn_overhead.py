"""Step time of a recurrent model (a GRU over time) under adaptive scaling, against
dynamic global scaling, side by side in one process.

``overhead.py``'s GPT has no scan over time; here Flax's ``nn.RNN`` of a GRU cell runs
``--length`` steps (width ``--width``, batch ``--batch``, fp16, Adam) after a Dense per
step, with a Dense head on the last step. Per module, every Dense of the cell is a group
with points inside the scan's body, run at every time step; ``adaptive-block``
(``max_depth=1``) puts points only at the RNN's boundary. Steady-state step times are
measured in interleaved rounds, so machine noise hits every configuration alike, after one
compile per configuration (``dynamic`` compiled twice, the first discarded); ratios are
against ``dynamic``::

    python benchmarks/rnn_overhead.py                    # about a minute on 2 CPU cores
    python benchmarks/rnn_overhead.py --configs dynamic,adaptive,adaptive-delayed
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import ALL_CONFIGS  # noqa: E402

import adaloss_jax as alj  # noqa: E402
from adaloss_jax.bench._steps import scaled_step  # noqa: E402

CONFIGS = ("dynamic", "adaptive", "adaptive-delayed", "adaptive-block")


class Gru(nn.Module):
    width: int
    dtype: jnp.dtype = jnp.float16

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width, dtype=self.dtype)(x)
        h = nn.RNN(nn.GRUCell(self.width, dtype=self.dtype))(x)[:, -1]
        return nn.Dense(10, dtype=self.dtype)(h)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma list of {list(ALL_CONFIGS)} (dynamic is always run)")
    ap.add_argument("--length", type=int, default=32, help="time steps")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps per round")
    args = ap.parse_args(argv)
    names = ["dynamic", *(c for c in args.configs.split(",") if c and c != "dynamic")]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, args.length, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=(args.batch,)), jnp.int32)
    runs, compile_s = {}, {}
    for name in ["dynamic", *names]:  # (the first compile in a process pays its set-up)
        dtype, make = ALL_CONFIGS[name]
        model = Gru(args.width, dtype)
        params = model.init(jax.random.key(0), x)["params"]

        def loss_fn(p, x, y, model=model):
            logits = model.apply({"params": p}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        tx, step = scaled_step(loss_fn, optax.adam(1e-3),
                               alj.no_scaling() if make is None else make())
        opt_state = tx.init(params)
        t0 = time.perf_counter()
        compiled = jax.jit(step).lower(params, opt_state, x, y).compile()
        compile_s[name] = time.perf_counter() - t0
        for _ in range(3):  # (warm-up)
            params, opt_state, loss = compiled(params, opt_state, x, y)
        jax.block_until_ready(loss)
        runs[name] = [compiled, params, opt_state]
        print(f"compiled {name} in {compile_s[name]:.1f} s", file=sys.stderr)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            compiled, params, opt_state = runs[name]
            t0 = time.perf_counter()
            for _ in range(args.steps):
                params, opt_state, loss = compiled(params, opt_state, x, y)
            jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - t0) / args.steps)
            runs[name][1:] = [params, opt_state]
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    base_t, base_c = statistics.median(times["dynamic"]), compile_s["dynamic"]
    print(f"GRU over {args.length} steps, width {args.width}, batch {args.batch}; "
          f"medians of {args.rounds} rounds of {args.steps} steps")
    print(f"{'config':18s} {'step ms':>8s} {'x dynamic':>10s} {'compile s':>10s} "
          f"{'x dynamic':>10s}")
    for name in names:
        t = statistics.median(times[name])
        print(f"{name:18s} {t * 1e3:8.2f} {t / base_t:10.3f} {compile_s[name]:10.2f} "
              f"{compile_s[name] / base_c:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
