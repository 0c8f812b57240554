"""Where does fp16 underflow? Per-layer probe tables for a small byte-level GPT.

Trains a small pre-LN GPT (tied embedding, flax linen, computing in float16 with fp32
master weights) on the Python standard library's source as bytes, and probes it with
:func:`adaloss_jax.numerics.linen_probe` (same batch and weights, once in fp32 and once
as trained) at initialisation and after ``--steps`` steps, for:

* scaling: fp16 without loss scaling, and fp16 with dynamic global loss scaling
  (``alj.loss_scaled(optax.adamw(...), alj.dynamic(...))``);
* regime: ordinary, and tiny-gradient (the loss multiplied by 2^-20 before
  differentiation and the gradients by 2^20 before AdamW, so fp32 training is
  unchanged; what a mean over ~10^6 tokens per step does to per-element gradients).

For every parameter gradient and every module-output cotangent it prints the underflow
rate (non-zero in fp32, zero in fp16; of the non-zero fp32 values), the share of fp16
subnormals, and the headroom (binades between the largest scaled value and fp16's max).
See DESIGN.md section 4b for what an earlier throwaway measurement found.

Usage::

    python benchmarks/underflow_table.py               # defaults: a few minutes on 2 cores
    python benchmarks/underflow_table.py --steps 100 --layers 2 --d-model 64 --context 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax import numerics
from adaloss_jax.bench import _data, _models

TINY = 2.0**-20


# ---------------------------------------------------------------- data and model
# The GPT (Scores / Probs modules so that their cotangents are tapped, Attention and MLP
# return their last Dense's output) and the corpus live in adaloss_jax.bench.
GPT, Attention, MLP = _models.GPT, _models.Attention, _models.MLP


def load_corpus(seed: int, val_share: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The standard library's top-level ``*.py`` files as bytes, split by file (seeded)."""
    return _data.split_by_file(_data.stdlib_files(), seed, val_share)


def batches(data: np.ndarray, batch: int, context: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        yield np.stack([data[s : s + context + 1] for s in starts]).astype(np.int32)


def make_loss(multiplier: float):
    """``(model, params, batch) -> mean cross-entropy (nats) * multiplier``, in fp32."""

    def loss_fn(model, params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch[:, 1:])
        return jnp.mean(ce) * multiplier

    return loss_fn


def _tapped(path, module):
    # Attention and MLP return their last Dense's output: the same cotangent twice.
    del path
    return not isinstance(module, Attention | MLP)


# ---------------------------------------------------------------- training


def make_tx(scaling: str, regime: str, lr: float, period: int):
    inner = optax.adamw(lr, weight_decay=0.01)
    if regime == "tiny":  # undo the loss multiplier after unscaling: fp32 is unchanged
        inner = optax.chain(optax.scale(1.0 / TINY), inner)
    scaler = alj.no_scaling() if scaling == "none" else alj.dynamic(
        initial_scale=2.0**15, period=period)
    return alj.loss_scaled(inner, scaler)


def train(model, params, tx, loss_fn, data_iter, steps):
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads, stats = alj.value_and_grad(lambda p: loss_fn(model, p, batch))(
            opt_state, params)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, updates), opt_state, loss

    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, next(data_iter))
    return params, opt_state


def eval_bpb(model, params, val_batches):
    loss = make_loss(1.0)

    @jax.jit
    def f(p, b):
        return loss(model, p, b)

    return float(np.mean([f(params, b) for b in val_batches])) / math.log(2)


# ---------------------------------------------------------------- report


def _pct(x):
    if x == 0:
        return "0"
    return "<0.01%" if x < 1e-4 else f"{100 * x:.2f}%"


def _hr(x):
    return f"{x:.1f}" if math.isfinite(x) else str(x)


def merged_table(rows_by_setting: dict[str, list]) -> str:
    """One line per tensor: underflow / subnormal / headroom for each scaling setting."""
    settings = list(rows_by_setting)
    first = rows_by_setting[settings[0]]
    header = ["kind", "tensor", "shape"]
    for s in settings:
        header += [f"uflow[{s}]", f"subn[{s}]", f"headroom[{s}]"]
    header += [f"rel_err[{s}]" for s in settings]
    lines = [header]
    by_name = {s: {(r.kind, r.name): r for r in rows_by_setting[s]} for s in settings}
    for r0 in first:
        key = (r0.kind, r0.name)
        line = ["param" if r0.kind == "param" else "cotan", numerics.display_name(r0.name),
                "x".join(map(str, r0.shape))]
        for s in settings:
            r = by_name[s][key]
            line += [_pct(r.underflow_rate), _pct(r.subnormal_share), _hr(r.headroom)]
        line += [f"{by_name[s][key].rel_error:.2g}" for s in settings]
        lines.append(line)
    widths = [max(len(x) for x in col) for col in zip(*lines, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def summary(rows) -> str:
    worst = sorted(rows, key=lambda r: -r.underflow_rate)[:3]
    finite = [r.headroom for r in rows if math.isfinite(r.headroom)]
    name = numerics.display_name
    text = "worst underflow: " + ", ".join(f"{name(r.name)} ({r.kind}) {_pct(r.underflow_rate)}"
                                           for r in worst)
    if not finite:
        return text + "; headroom: no finite value (every tensor all zero or overflowed)"
    return (text + f"; headroom min {min(finite):.1f} / median {np.median(finite):.1f} / "
                   f"max {max(finite):.1f} binades ({len(finite)} of {len(rows)} finite)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--period", type=int, default=200,
                    help="dynamic scaling: finite steps per doubling (start 2^15)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--regimes", default="ordinary,tiny")
    ap.add_argument("--json", default=None, help="also write all rows to this JSON file")
    args = ap.parse_args(argv)

    t0 = time.time()
    train_data, val_data = load_corpus(args.seed)
    model = GPT(args.layers, args.d_model, args.heads, args.context, jnp.float16)
    rng = np.random.default_rng(args.seed + 1)
    probe_batch = next(batches(val_data, args.batch, args.context, rng))
    val_batches = [next(batches(val_data, args.batch, args.context, rng)) for _ in range(8)]
    params0 = model.init(jax.random.key(args.seed), probe_batch[:, :-1])["params"]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params0))
    print(f"# byte-level GPT: {args.layers} pre-LN blocks, d={args.d_model}, "
          f"{args.heads} heads, context {args.context}, tied embedding, {n_params} params; "
          f"compute float16, fp32 master weights; AdamW lr {args.lr}, batch {args.batch}")
    print(f"# data: {len(train_data)} train / {len(val_data)} val bytes of "
          f"{os.path.dirname(os.__file__)}/*.py (split by file, seed {args.seed})")
    print(f"# dynamic scaling: start 2^15, x2 every {args.period} finite steps, /2 and skip "
          f"on overflow; tiny regime: loss x 2^-20, gradients x 2^20 before AdamW")
    print("# uflow: share of the non-zero fp32 values that are zero in fp16; subn: share of "
          "elements in fp16's subnormal range (as stored, scaled); headroom: "
          "log2(65504 / amax of the scaled tensor) in binades; rel_err: ||g16/s - g32|| / "
          "||g32||")
    print("# cotan rows: cotangent of the module's output ((root) = logits)")

    records = []
    for regime in args.regimes.split(","):
        loss_fn = make_loss(TINY if regime == "tiny" else 1.0)
        probe = numerics.linen_probe(model, loss_fn, filter=_tapped)
        states = {}
        for scaling in ("none", "dynamic"):
            tx = make_tx(scaling, regime, args.lr, args.period)
            states[scaling] = {"init": (params0, tx.init(params0))}
            data_iter = batches(train_data, args.batch, args.context,
                                np.random.default_rng(args.seed + 2))
            t = time.time()
            params, opt_state = train(model, params0, tx, loss_fn, data_iter, args.steps)
            st = alj.scale_state(opt_state)
            states[scaling][f"step {args.steps}"] = (params, opt_state)
            print(f"# trained [{regime}, {scaling}] {args.steps} steps in {time.time() - t:.0f}s: "
                  f"val {eval_bpb(model, params, val_batches):.3f} bits/byte, scale "
                  f"2^{round(math.log2(float(st.loss_scale)))}, applied "
                  f"{int(st.total_applied)}, skipped {int(st.total_skipped)}")
        for when in ("init", f"step {args.steps}"):
            rows = {}
            for scaling in ("none", "dynamic"):
                params, opt_state = states[scaling][when]
                rows[scaling] = probe(params, probe_batch, opt_state)
                records += numerics.rows_as_dicts(rows[scaling], regime=regime, when=when,
                                                  scaling=scaling)
            scales = ", ".join(f"{s}: 2^{round(math.log2(rows[s][0].scale))}" for s in rows)
            print(f"\n## regime {regime}, {when} (loss scale {scales})")
            print(merged_table(rows))
            for s in rows:
                print(f"# {s}: {summary(rows[s])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, default=list)
    print(f"\n# total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
