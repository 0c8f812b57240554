"""Adaptive loss scaling against fp32 and dynamic global scaling on a byte-level GPT.

Trains the byte-level pre-LN GPT of ``underflow_table.py`` (tied embedding, flax linen,
fp32 master weights; the same model definition for every config, only the compute
dtype switched) on the Python standard library's source as bytes (the same split by
file as ``underflow_table.py``, split seed 0 for every training seed), with AdamW, for
these configs, with the same initialisation and batches per seed:

* ``fp32``: float32 compute, no scaling;
* ``fp16-dynamic``: float16 compute, dynamic global scaling
  (``alj.loss_scaled(inner, alj.dynamic(initial_scale=2**15, period=200))``);
* ``fp16-ada-global``: float16, adaptive scaling with one statistics-driven scale
  (``alj.adaptive(groups="global")``);
* ``fp16-ada-amax``: float16, adaptive per-module scales, amax rule
  (``alj.adaptive(groups="module")``);
* ``fp16-ada-gauss``: float16, adaptive per-module scales, the reference's Gaussian rule
  (``alj.adaptive(statistic="gaussian", groups="module")``);
* ``fp16-ada-quant-global`` / ``fp16-ada-quant``: float16, the quantile rule with one
  global scale / per-module scales (``alj.adaptive(statistic="quantile", ...)``).

Regimes: ``tiny`` (default; the loss multiplied by 2^-20 before differentiation and the
gradients by 2^20 before AdamW, so fp32 training is unchanged: what a mean over ~10^6
tokens per step does to per-element gradients) and ``ordinary``.

Reported per config: held-out bits/byte after the last step (evaluated in the config's
compute dtype; mean +- sample std over seeds), gap to fp32, skipped steps, final root
scale (for the adaptive configs also min / median / max of the per-group log2 scales),
and seconds per step in steady state (the first step, which compiles, excluded).

Usage::

    python benchmarks/adaptive_gpt.py --seeds 0,1,2 --json adaptive_gpt.json
    python benchmarks/adaptive_gpt.py --regime ordinary --seeds 0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax.bench._steps import scaled_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from underflow_table import GPT, TINY, batches, load_corpus  # noqa: E402

CONFIGS = ("fp32", "fp16-dynamic", "fp16-ada-global", "fp16-ada-amax", "fp16-ada-gauss",
           "fp16-ada-quant-global", "fp16-ada-quant")


def scaling_of(config: str, period: int):
    """The config's scaler: a global scaler or an adaptive scaler."""
    return {
        "fp32": alj.no_scaling,
        "fp16-dynamic": lambda: alj.dynamic(initial_scale=2.0**15, period=period),
        "fp16-ada-global": lambda: alj.adaptive(groups="global"),
        "fp16-ada-amax": lambda: alj.adaptive(groups="module"),
        "fp16-ada-gauss": lambda: alj.adaptive(statistic="gaussian", groups="module"),
        "fp16-ada-quant-global": lambda: alj.adaptive(statistic="quantile", groups="global"),
        "fp16-ada-quant": lambda: alj.adaptive(statistic="quantile", groups="module"),
    }[config]()


def make_inner(regime: str, lr: float):
    inner = optax.adamw(lr, weight_decay=0.01)
    if regime == "tiny":  # undo the loss multiplier after unscaling: fp32 is unchanged
        inner = optax.chain(optax.scale(1.0 / TINY), inner)
    return inner


def make_step(config: str, model, multiplier: float, inner, period: int):
    """``(tx, step)``, the step jitted: ``(params, opt_state, batch) -> (params,
    opt_state, loss)``."""

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), batch[:, 1:])
        return jnp.mean(ce) * multiplier

    tx, step = scaled_step(loss_fn, inner, scaling_of(config, period))
    return tx, jax.jit(step)


def base_state(opt_state):
    """The LossScaleState (counters, root scale) and the adaptive state, if any."""
    try:
        return alj.scale_state(opt_state), alj.scale_state(opt_state)
    except ValueError:  # a global scaler: no AdaptiveScaleState
        return alj.scale_state(opt_state), None


def run_one(config, seed, args, train_data, val_batches):
    dtype = jnp.float32 if config == "fp32" else jnp.float16
    model = GPT(args.layers, args.d_model, args.heads, args.context, dtype)
    params = model.init(jax.random.key(seed), val_batches[0][:, :-1])["params"]
    multiplier = TINY if args.regime == "tiny" else 1.0
    tx, step = make_step(config, model, multiplier, make_inner(args.regime, args.lr),
                         args.period)
    opt_state = tx.init(params)
    data_iter = batches(train_data, args.batch, args.context, np.random.default_rng(seed + 2))

    t0 = time.time()
    losses, roots = [], []
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, next(data_iter))
        losses.append(loss)
        roots.append(base_state(opt_state)[0].loss_scale)
        if i == 0:
            jax.block_until_ready(params)
            t_first = time.time() - t0
            t1 = time.time()
    jax.block_until_ready(params)
    t_steady = (time.time() - t1) / max(1, args.steps - 1)

    def evaluate(m):
        @jax.jit
        def eval_loss(p, b):
            logits = m.apply({"params": p}, b[:, :-1])
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), b[:, 1:]))

        return float(np.mean([eval_loss(params, b) for b in val_batches])) / math.log(2)

    bpb = evaluate(model)
    bpb32 = bpb if dtype == jnp.float32 else evaluate(model.clone(dtype=jnp.float32))
    base, ada = base_state(opt_state)
    losses = np.asarray(jax.device_get(losses), np.float64) / multiplier / math.log(2)
    roots = np.log2(np.asarray(jax.device_get(roots), np.float64))
    row = {
        "config": config, "seed": seed, "regime": args.regime, "steps": args.steps,
        "val_bpb": bpb, "val_bpb_fp32_eval": bpb32,
        "train_bpb_last20": float(np.nanmean(losses[-20:])),
        "nonfinite_train_losses": int(np.sum(~np.isfinite(losses))),
        "skipped": int(base.total_skipped), "applied": int(base.total_applied),
        "nonfinite_loss_skips": int(base.total_nonfinite_loss),
        "log2_root_scale": float(np.log2(float(base.loss_scale))),
        "log2_root_trajectory": roots.tolist(),
        "first_step_s": t_first, "s_per_step": t_steady,
    }
    if ada is not None:
        row.update(alj.diagnostics.scale_summary(ada))
        row["bounds_hit"] = sorted(
            g or "(root)" for g, v in row["log2_group_scales"].items() if v <= -24 or v >= 64)
    return row


def _mean_spread(xs):
    xs = np.asarray(xs, np.float64)
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def table(rows, configs) -> str:
    ref = [r["val_bpb"] for r in rows if r["config"] == "fp32"]
    ref_mean = float(np.mean(ref)) if ref else float("nan")
    header = ["config", "seeds", "val bits/byte", "gap to fp32", "fp32-eval bpb", "skipped",
              "log2 root scale", "log2 group scale min/med/max", "s/step", "1st step s"]
    lines = [header]
    for c in configs:
        rs = [r for r in rows if r["config"] == c]
        if not rs:
            continue
        m, s = _mean_spread([r["val_bpb"] for r in rs])
        roots = sorted({round(r["log2_root_scale"]) for r in rs})
        grp = "-"
        if "group_log2_min_med_max" in rs[0]:
            grp = "; ".join("{:.0f}/{:.1f}/{:.0f}".format(*r["group_log2_min_med_max"])
                            for r in rs)
        lines.append([
            c, ",".join(str(r["seed"]) for r in rs), f"{m:.4f} +- {s:.4f}",
            f"{m - ref_mean:+.4f}",
            "{:.4f} +- {:.4f}".format(*_mean_spread([r["val_bpb_fp32_eval"] for r in rs])),
            ",".join(str(r["skipped"]) for r in rs),
            ",".join(str(x) for x in roots), grp,
            f"{np.mean([r['s_per_step'] for r in rs]):.3f}",
            f"{np.mean([r['first_step_s'] for r in rs]):.1f}",
        ])
    widths = [max(len(x) for x in col) for col in zip(*lines, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def group_table(row) -> str:
    lines = [f"{'group':<28} {'log2 scale':>10} {'log2 unit amax':>15} overflowed"]
    for g in sorted(row["log2_group_scales"]):
        lines.append(f"{(g or '(root)'):<28} {row['log2_group_scales'][g]:>10.0f} "
                     f"{row['log2_unit_amax'][g] or '-':>15} {row['overflowed'][g]}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regime", choices=("tiny", "ordinary"), default="tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--period", type=int, default=200,
                    help="dynamic scaling: finite steps per doubling (start 2^15)")
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the raw rows to this JSON file")
    ap.add_argument("--groups", action="store_true",
                    help="print each adaptive run's final per-group scales")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        ap.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")

    t0 = time.time()
    train_data, val_data = load_corpus(0)
    vrng = np.random.default_rng(12345)
    val_batches = [next(batches(val_data, args.batch, args.context, vrng))
                   for _ in range(args.val_batches)]
    print(f"# byte-level GPT: {args.layers} pre-LN blocks, d={args.d_model}, {args.heads} "
          f"heads, context {args.context}, tied embedding; fp32 master weights; AdamW lr "
          f"{args.lr} (wd 0.01), batch {args.batch}, {args.steps} steps, seeds {seeds}")
    print(f"# data: {len(train_data)} train / {len(val_data)} val bytes of "
          f"{os.path.dirname(os.__file__)}/*.py (split by file, seed 0); eval on "
          f"{args.val_batches} fixed val batches in each config's compute dtype")
    print(f"# regime {args.regime}" + (": loss x 2^-20 before differentiation, gradients "
                                        "x 2^20 before AdamW" if args.regime == "tiny" else ""))
    print(f"# jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"{os.cpu_count()} CPUs visible")
    sys.stdout.flush()

    rows = []
    for config in configs:
        for seed in seeds:
            row = run_one(config, seed, args, train_data, val_batches)
            rows.append(row)
            extra = ""
            if "group_log2_min_med_max" in row:
                extra = " groups log2 min/med/max {:.0f}/{:.1f}/{:.0f}".format(
                    *row["group_log2_min_med_max"])
                if row["bounds_hit"]:
                    extra += f" AT BOUNDS: {row['bounds_hit']}"
            print(f"[{time.time() - t0:6.0f}s] {config} seed {seed}: val {row['val_bpb']:.4f} "
                  f"bpb (fp32 eval {row['val_bpb_fp32_eval']:.4f}), train(last20) "
                  f"{row['train_bpb_last20']:.4f}, skipped "
                  f"{row['skipped']}, root 2^{row['log2_root_scale']:.0f}{extra}, "
                  f"{row['s_per_step']:.3f} s/step (1st {row['first_step_s']:.1f}s)",
                  file=sys.stderr, flush=True)
            if args.groups and "log2_group_scales" in row:
                print(f"\n## {config} seed {seed}: final per-group scales\n{group_table(row)}")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)

    print(f"\n## regime {args.regime}: held-out bits/byte after {args.steps} steps "
          f"(mean +- sample std over seeds)")
    print(table(rows, configs))
    print(f"\n# total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
