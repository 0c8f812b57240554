"""Step time of a recurrent model (a GRU over time) under adaptive scaling, against
dynamic global scaling, side by side in one process.

``overhead.py``'s GPT has no scan over time; here Flax's ``nn.RNN`` of a GRU cell runs
``--length`` steps (width ``--width``, batch ``--batch``, fp16, Adam) after a Dense per
step, with a Dense head on the last step. Per module, every Dense of the cell is a group
with points inside the scan's body, run at every time step; ``adaptive-block``
(``max_depth=1``) puts points only at the RNN's boundary. Steady-state step times are
measured in interleaved rounds, so machine noise hits every configuration alike, and compile
times as the median of interleaved fresh compiles (``overhead.py``'s helpers); ratios are
against ``dynamic``::

    python benchmarks/rnn_overhead.py                    # about a minute on 2 CPU cores
    python benchmarks/rnn_overhead.py --configs dynamic,adaptive,adaptive-delayed
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import ALL_CONFIGS, compile_step, interleaved_times  # noqa: E402

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
    ap.add_argument("--compile-repeats", type=int, default=3)
    args = ap.parse_args(argv)
    names = ["dynamic", *(c for c in args.configs.split(",") if c and c != "dynamic")]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, args.length, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=(args.batch,)), jnp.int32)

    def build(name):
        dtype, make = ALL_CONFIGS[name]
        model = Gru(args.width, dtype)

        def loss_fn(p, x, y):
            logits = model.apply({"params": p}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        tx, step = scaled_step(loss_fn, optax.adam(1e-3),
                               alj.no_scaling() if make is None else make())
        return model, tx, step

    runners, compile_s = {}, {n: [] for n in names}
    for _ in range(args.compile_repeats):  # interleaved, a fresh step function each time
        for name in names:
            model, tx, step = build(name)
            params = model.init(jax.random.key(0), x)["params"]
            opt_state = tx.init(params)
            compiled, phases = compile_step(step, (params, opt_state, x, y))
            compile_s[name].append(sum(phases))
            runners[name] = (compiled, [params, opt_state])
    for compiled, state in runners.values():  # (warm-up)
        state[0], state[1], loss = compiled(state[0], state[1], x, y)
        jax.block_until_ready(loss)
    times = interleaved_times(runners, (x, y), args.rounds, args.steps, "[gru]")
    step_s = {n: statistics.median(t) for n, t in times.items()}
    comp = {n: statistics.median(c) for n, c in compile_s.items()}
    print(f"GRU over {args.length} steps, width {args.width}, batch {args.batch}; medians "
          f"of {args.rounds} rounds of {args.steps} steps and of {args.compile_repeats} "
          f"compiles")
    print(f"{'config':18s} {'step ms':>8s} {'x dynamic':>10s} {'compile s':>10s} "
          f"{'x dynamic':>10s}")
    for name in names:
        print(f"{name:18s} {step_s[name] * 1e3:8.2f} {step_s[name] / step_s['dynamic']:10.3f} "
              f"{comp[name]:10.2f} {comp[name] / comp['dynamic']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
