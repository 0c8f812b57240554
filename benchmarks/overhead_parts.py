"""Where per-module adaptive scaling's extra step time goes: the scale points' parts.

For the GPT of ``overhead.py`` (small size by default), compiles the per-module step
with parts of every scale point's backward pass switched off, and times them side by side
with dynamic scaling, interleaved in one process:

* ``adaptive``: as shipped (convert each cotangent by its ratio, measure its statistics);
* ``no-stats``: the statistics row is a constant (no reduction over the cotangent);
* ``no-convert``: the cotangent passes unconverted (ratios ignored);
* ``bare-points``: both off: the points are identities, what is left is the rest of the
  per-module machinery (parameter-side conversions, per-group unscale and update).

Switched-off variants compute wrong scales; they are timed, never trained. Run:
``python benchmarks/overhead_parts.py [--size small --layers 4]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import SIZES, build_step  # noqa: E402
from underflow_table import GPT  # noqa: E402

from adaloss_jax import _channel  # noqa: E402


def _constant_row(cts, ratio, cfg, amax=None):
    """A statistics row that reads nothing: amax 1, everything else 0."""
    del cts, ratio, amax
    return jnp.zeros((cfg.columns.width,), jnp.float32).at[0].set(1.0)


VARIANTS = {  # name: (statistics on, conversion on)
    "adaptive": (True, True),
    "no-stats": (False, True),
    "no-convert": (True, False),
    "bare-points": (False, False),
}


@contextlib.contextmanager
def variant(name):
    """The library's own scale point with parts switched off while tracing: the
    statistics row replaced by a constant, or every point built with ``convert=False``."""
    stats, convert = VARIANTS[name]
    point, row = _channel.scale_point, _channel.measure
    if not convert:
        _channel.scale_point = lambda cfg, *a: point(cfg._replace(convert=False), *a)
    if not stats:
        _channel.measure = _constant_row
    try:
        yield
    finally:
        _channel.scale_point, _channel.measure = point, row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    _, d, heads, ctx, batch = SIZES[args.size]
    data = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(batch, ctx + 1)),
                       jnp.int32)
    model = GPT(layers=args.layers, d_model=d, heads=heads, context=ctx, dtype=jnp.float16)
    params = model.init(jax.random.key(0), data[:, :-1])["params"]
    runs = {}
    for name in ["dynamic", *VARIANTS]:
        config = "dynamic" if name == "dynamic" else "adaptive"
        with variant(name) if name in VARIANTS else contextlib.nullcontext():
            tx, step = build_step(config, model, params)
            state = tx.init(params)
            compiled = jax.jit(step).lower(params, state, data).compile()
        jax.block_until_ready(compiled(params, state, data))
        runs[name] = (compiled, [params, state], [])
    for r in range(args.rounds):
        for compiled, st, times in runs.values():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                p, o, loss = compiled(st[0], st[1], data)
                st[0], st[1] = p, o
            jax.block_until_ready(loss)
            times.append((time.perf_counter() - t0) / args.steps)
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    base = statistics.median(runs["dynamic"][2])
    print(f"# jax {jax.__version__}, {args.size} GPT, {args.layers} layers, d={d}, "
          f"batch {batch}; median of {args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'variant':<12} {'step ms':>8} {'x dynamic':>10}")
    for name, (_, _, times) in runs.items():
        med = statistics.median(times)
        print(f"{name:<12} {1e3 * med:>8.1f} {med / base:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
