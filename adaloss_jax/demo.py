"""A small, true demonstration: fp16 training with and without loss scaling.

A byte-level next-byte MLP is trained on the Python standard library's source (always
present) in the tiny-gradient regime: the loss is multiplied by ``2**-shift`` before
differentiation and the gradients by ``2**shift`` before the optimizer, what a mean over
many tokens per step does to per-element gradients. fp32 is unchanged by this; fp16
flushes small gradients to zero unless the loss is scaled.

Run: ``python -m adaloss_jax.demo`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import adaloss_jax as alj

CONTEXT = 8


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """The standard library's ``*.py`` files (sorted, deterministic), as uint8."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python source found under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


class ByteMLP(nn.Module):
    """Embeds the previous CONTEXT bytes and predicts the next one."""

    width: int = 256
    depth: int = 3
    dtype: jnp.dtype = jnp.float16

    @nn.compact
    def __call__(self, ctx):
        x = nn.Embed(256, 32, dtype=self.dtype)(ctx).reshape(ctx.shape[0], -1)
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width, dtype=self.dtype)(x))
        return nn.Dense(256, dtype=self.dtype)(x)


def _batches(data: np.ndarray, batch: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(data) - CONTEXT - 1, size=batch)
        ctx = np.stack([data[i : i + CONTEXT] for i in idx])
        yield jnp.asarray(ctx, jnp.int32), jnp.asarray(data[idx + CONTEXT], jnp.int32)


def _xent(model, params, ctx, y):
    logits = model.apply(params, ctx).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def run(config: str, data, eval_data, *, steps: int, shift: int, seed: int = 0) -> dict:
    """Trains one configuration; returns final eval bits/byte and underflow share."""
    dtype = jnp.float32 if config == "fp32" else jnp.float16
    model = ByteMLP(dtype=dtype)
    ref = ByteMLP(dtype=jnp.float32)
    params = model.init(jax.random.key(seed), jnp.zeros((1, CONTEXT), jnp.int32))
    inner = optax.chain(optax.scale(2.0**shift), optax.adam(1e-3))
    policy = {
        "fp32": alj.no_scaling(),
        "fp16 no scaling": alj.no_scaling(),
        "fp16 dynamic": alj.dynamic(initial_scale=2.0**15, period=100),
        "fp16 adaptive global": alj.adaptive(groups="global"),
        "fp16 adaptive per-module": alj.adaptive(groups="module"),
    }[config]
    tiny = 2.0**-shift
    loss_fn = lambda p, ctx, y: _xent(model, p, ctx, y) * tiny
    if isinstance(policy, alj.AdaptiveScale):
        tx = optax.chain(alj.adaptive_unscale(policy), alj.skip_nonfinite(inner))

        def grads_of(opt_state, params, ctx, y):
            loss, grads, stats = alj.adaptive_value_and_grad(loss_fn, policy)(
                opt_state, params, ctx, y
            )
            return loss, grads, {"scale_stats": stats}
    else:
        tx = alj.loss_scaled(inner, policy)

        def grads_of(opt_state, params, ctx, y):
            loss, grads = alj.value_and_grad(loss_fn)(opt_state, params, ctx, y)
            return loss, grads, {}

    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, ctx, y):
        loss, grads, extra = grads_of(opt_state, params, ctx, y)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss, **extra)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def underflow(params, opt_state, ctx, y):
        """Share of gradient elements non-zero in fp32 and zero as trained (a zero is a
        zero at any scale, so the scaled gradients can be compared directly)."""
        _, g_low, _ = grads_of(opt_state, params, ctx, y)
        g_ref = jax.grad(lambda p: _xent(ref, p, ctx, y) * tiny)(params)
        nz_ref = sum(jnp.sum(r != 0) for r in jax.tree_util.tree_leaves(g_ref))
        lost = sum(
            jnp.sum((r != 0) & (g == 0))
            for r, g in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_low))
        )
        return lost / nz_ref

    t0 = time.perf_counter()
    for ctx, y in _batches(data, 64, steps, seed):
        params, opt_state, _ = step(params, opt_state, ctx, y)
    ctx, y = next(_batches(data, 64, 1, seed + 1))
    flushed = float(underflow(params, opt_state, ctx, y))
    ectx, ey = eval_data
    bpb = float(_xent(ref, params, ectx, ey)) / math.log(2)
    st = alj.scale_state(opt_state)
    return {
        "config": config,
        "eval_bits_per_byte": bpb,
        "grad_underflow": flushed,
        "skipped": int(st.total_skipped),
        "final_scale": float(st.loss_scale),
        "seconds": time.perf_counter() - t0,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps per config")
    parser.add_argument("--shift", type=int, default=20, help="loss multiplied by 2**-shift")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    data = stdlib_bytes(2_000_000)
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    eval_data = next(_batches(held, 2048, 1, 1234))
    print(
        f"Byte-level MLP on the Python standard library source, {args.steps} steps, "
        f"loss x 2^-{args.shift} (gradients x 2^{args.shift} before Adam; fp32 unaffected)"
    )
    rows = []
    configs = [
        "fp32", "fp16 no scaling", "fp16 dynamic", "fp16 adaptive global",
        "fp16 adaptive per-module",
    ]
    for i, config in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] {config} ...", end="", flush=True, file=sys.stderr)
        rows.append(run(config, train, eval_data, steps=args.steps, shift=args.shift))
        print(f" {rows[-1]['seconds']:.1f}s", file=sys.stderr)
    header = ("config", "eval bits/byte", "grad underflow", "skipped", "scale")
    print("{:<25} {:>14} {:>15} {:>8} {:>8}".format(*header))
    for r in rows:
        scale = "2^" + str(round(math.log2(r["final_scale"])))
        print(
            f"{r['config']:<25} {r['eval_bits_per_byte']:>14.3f} {r['grad_underflow']:>14.1%} "
            f"{r['skipped']:>8d} {scale:>8}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
