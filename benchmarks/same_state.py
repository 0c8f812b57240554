"""Per-module against global adaptive scaling on the same parameters and the same batch.

The bench compares configurations over whole training runs, whose trajectories part
after the first steps (a skipped step here, a different scale there), so the underflow of
two configurations at a probe step is measured on different parameters. This script
removes that: it trains the bench's byte GPT (``text-gpt`` or ``code-gpt``: 2 pre-LN
blocks, d=64, context 64, tied embedding) in fp32 with AdamW 2e-3 for ``--at`` steps, then
on those parameters and one held batch lets each scaler settle for ``--settle`` steps at
learning rate 0 (the tiny regime: loss x 2^-20) and counts, leaf by leaf, the gradient
elements that are non-zero in fp32 and zero in the scaled gradients.

Usage::

    python benchmarks/same_state.py --task text-gpt --format e4m3 --at 30,75,150,225 --seeds 0,1
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax.bench import _data, _models

FORMATS = {"fp16": {}, "e5m2": {"grad_dtype": jnp.float8_e5m2, "simulate": True},
           "e4m3": {"grad_dtype": jnp.float8_e4m3fn, "simulate": True}}
FILES = {"text-gpt": _data.python_doc_files, "code-gpt": _data.stdlib_files}
TINY = 2.0**-20


def _loss(model, tiny):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1]).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return ce.mean() * tiny

    return loss_fn


def underflow(grads, ref) -> tuple[float, dict[str, float]]:
    """(share over all leaves, {leaf: share}) of elements non-zero in ``ref``, zero here."""
    per, flushed, total = {}, 0, 0
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree_util.tree_leaves(ref)):
        g, r = np.asarray(g), np.asarray(r)
        n = int(np.sum((r != 0) & (g == 0)))
        per[jax.tree_util.keystr(path)] = n / r.size
        flushed, total = flushed + n, total + r.size
    return flushed / total, per


def settled(groups: str, fmt: str, loss16, params, batch, steps: int):
    """The scaled gradients after ``steps`` steps at lr 0, and the adaptive state."""
    scaler = alj.adaptive(groups=groups, **FORMATS[fmt])
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(0.0)))
    vg = alj.adaptive_value_and_grad(loss16)

    @jax.jit
    def step(state):
        loss, grads, stats = vg(state, params, batch)
        _, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        return state, grads

    state = tx.init(params)
    for _ in range(steps):
        state, grads = step(state)
    return grads, alj.scale_state(state)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="text-gpt", choices=sorted(FILES))
    p.add_argument("--format", default="e4m3", choices=sorted(FORMATS))
    p.add_argument("--at", default="30,75,150,225", help="fp32 training steps before each probe")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--settle", type=int, default=12, help="steps at lr 0 before measuring")
    args = p.parse_args(argv)
    at = sorted(int(x) for x in args.at.split(","))
    files = FILES[args.task]()
    data = np.frombuffer(b"".join(open(f, "rb").read() for f in files[:200]), np.uint8)
    m32, m16 = _models.GPT(dtype=jnp.float32), _models.GPT(dtype=jnp.float16)
    opt = optax.adamw(2e-3, weight_decay=0.01)

    @jax.jit
    def train(params, opt_state, batch):
        grads = jax.grad(_loss(m32, 1.0))(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    print(f"# {args.task}, {args.format} cotangents, tiny regime; settle {args.settle} steps")
    print("| seed | fp32 steps | global | per-module | leaves where per-module flushes more "
          "(global -> per-module) | log2 scales: global; per-module min..max |")
    print("|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        batches = jnp.asarray(_data.byte_batches(data, 16, 64, at[-1] + 1, seed))
        params = m32.init(jax.random.key(seed), batches[0][:, :-1])["params"]
        opt_state, done = opt.init(params), 0
        for k in at:
            for t in range(done, k):
                params, opt_state = train(params, opt_state, batches[t])
            done = k
            batch = batches[k]
            ref = jax.grad(_loss(m32, TINY))(params, batch)
            loss16 = _loss(m16, TINY)
            g_glob, s_glob = settled("global", args.format, loss16, params, batch, args.settle)
            g_mod, s_mod = settled("module", args.format, loss16, params, batch, args.settle)
            (u_glob, per_glob), (u_mod, per_mod) = underflow(g_glob, ref), underflow(g_mod, ref)
            worse = ", ".join(f"{k} {100 * per_glob[k]:.2f}% -> {100 * v:.2f}%"
                              for k, v in per_mod.items() if v > per_glob[k]) or "none"
            scales = [float(v) for v in s_mod.log2_scales.values()]
            print(f"| {seed} | {k} | {100 * u_glob:.2f}% | {100 * u_mod:.2f}% | {worse} | "
                  f"{float(s_glob.log2_scales['']):.0f}; {min(scales):.0f}..{max(scales):.0f} |",
                  flush=True)
            print(f"  seed {seed}, step {k} done", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
