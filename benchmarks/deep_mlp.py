"""Loss scaling on a deep un-normalised MLP (the stress task of DESIGN.md sections 4b and 5).

Model: a plain MLP on Fashion-MNIST, ``--depth`` (16) hidden Dense layers of ``--width``
(256) with ReLU, no normalisation, flax linen, He-normal hidden kernels (the output layer
keeps flax's LeCun-normal default), zero biases, fp32 master parameters; the same
definition with only the compute dtype switched (float32 or float16). The cross-entropy
is taken in fp32 from the logits.

Optimizer: SGD with momentum (``--lr`` 0.01, ``--momentum`` 0.9), batch 128, a fixed
number of steps. With flax's default LeCun init the 16-layer ReLU stack shrinks the
signal by ~2^-8 and some fp32 seeds do not learn at all (DESIGN.md 4b); He init with this
moderate learning rate learns reliably in fp32 (0.848 +- 0.005 test accuracy after 1000
steps, 3 seeds). ``--init lecun`` switches the hidden kernels back to flax's default (the
unsteady setting of DESIGN.md 4b: fp32 0.77 +- 0.03). At ``--lr 0.1`` even fp32 diverges.

Measured (2 shared CPU cores, default 1000 steps x 3 seeds x 6 configs: ~9 minutes per
regime): in this setting dynamic global scaling did NOT collapse (scale 2^15 -> 2^20, no
skips; 0.7-1.4% of parameter-gradient elements flushed in the tiny regime), so the
4b collapse is not reproduced here; the statistics-driven scalers cut the flush share to
~0.01-0.03% with equal accuracy within seed noise. The Gaussian rule sits ~25 binades below
overflow and flushes 2.6-5% (in the ordinary regime its scales go below 1: 2^-5..2^-2).

Regimes: ``tiny`` (default: the loss multiplied by 2^-20 before differentiation and the
gradients by 2^20 before the optimizer with ``optax.scale(2.0**20)`` in the inner chain,
so fp32 training is unchanged) and ``ordinary`` (no multiplier).

Configs, on the same initialisation and batches per seed:

* ``fp32``: float32 compute, no scaling;
* ``fp16-none``: float16 compute, no loss scaling;
* ``fp16-dynamic``: ``alj.loss_scaled(inner, alj.dynamic(initial_scale=2**15, period=200))``;
* ``fp16-ada-global``: ``alj.adaptive(groups="global")`` (one statistics-driven scale);
* ``fp16-ada-module``: ``alj.adaptive(groups="module")`` (one scale per Dense, amax rule);
* ``fp16-ada-gauss``: ``alj.adaptive(statistic="gaussian", groups="module")`` (per Dense,
  Gaussian rule);
* ``fp16-ada-quant-global`` / ``fp16-ada-quant``: ``alj.adaptive(statistic="quantile",
  ...)`` with one global scale / one scale per Dense.

Reported per config (mean +- sample std over seeds where it is a number): test accuracy
after the last step (the full 10k test set, evaluated in the config's compute dtype),
skipped steps, steps with a non-finite loss, longest run of consecutive skipped steps,
final scale (root scale; for the adaptive configs also min / median / max of the
per-Dense log2 scales), whether the run diverged (non-finite parameters, or a non-finite
training loss in the last 50 steps or test loss), and the parameter-gradient underflow
share at the end: on a fixed probe batch, with the final parameters and scale state, the
share of gradient elements that are non-zero in an fp32 recomputation of the same step
and zero in the config's own (scaled) gradients. A zero is a zero at any scale, so the
scaled gradients are compared directly. ``--json`` rows also hold it per parameter leaf,
the per-group log2 scales and unit amax, and the training loss every 50 steps.

Data: Debian's ``dataset-fashion-mnist`` (``apt-get install -y dataset-fashion-mnist``),
read from ``/usr/share/datasets/fashion-mnist`` (or ``--data``).

Usage::

    python benchmarks/deep_mlp.py                       # tiny regime, 1000 steps, seeds 0,1,2
    python benchmarks/deep_mlp.py --regime ordinary --json deep_mlp_ordinary.json
    python benchmarks/deep_mlp.py --steps 300 --seeds 0 --configs fp32,fp16-dynamic
    python benchmarks/deep_mlp.py --init lecun                # the unsteady 4b init

Progress goes to stderr; the tables to stdout; ``--json PATH`` writes the raw rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax.bench import _data, _models
from adaloss_jax.bench._steps import scaled_tx, scaled_value_and_grad

DATA_DIR = _data.FASHION_MNIST_DIR
CONFIGS = ("fp32", "fp16-none", "fp16-dynamic", "fp16-ada-global", "fp16-ada-module",
           "fp16-ada-gauss", "fp16-ada-quant-global", "fp16-ada-quant")
TINY_SHIFT = 20


# ---------------------------------------------------------------------- data, model
# Shared with the bench (adaloss_jax.bench): the idx reader, the epoch order, the model.
DeepMLP = _models.DeepMLP
batch_indices = _data.epoch_indices


def load_fashion_mnist(data_dir: str = DATA_DIR):
    """``(train_x uint8 [60000, 784], train_y, test_x [10000, 784], test_y)``."""
    try:
        tx, ty, vx, vy = _data.load_fashion_mnist(data_dir)
    except _data.DataUnavailable as e:
        raise SystemExit(f"{e}\n(or pass --data DIR holding the four idx .gz files)") from None
    return tx.reshape(len(tx), -1), ty, vx.reshape(len(vx), -1), vy


def _pixels(xb):
    return xb.astype(jnp.float32) / 255.0


def _xent(model, params, xb, yb):
    logits = model.apply({"params": params}, _pixels(xb)).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()


# -------------------------------------------------------------------------- configs


def make_scaler(config: str):
    """The config's scaler: a global scaler or an adaptive scaler."""
    return {
        "fp32": alj.no_scaling,
        "fp16-none": alj.no_scaling,
        "fp16-dynamic": lambda: alj.dynamic(initial_scale=2.0**15, period=200),
        "fp16-ada-global": lambda: alj.adaptive(groups="global"),
        "fp16-ada-module": lambda: alj.adaptive(groups="module"),
        "fp16-ada-gauss": lambda: alj.adaptive(statistic="gaussian", groups="module"),
        "fp16-ada-quant-global": lambda: alj.adaptive(statistic="quantile", groups="global"),
        "fp16-ada-quant": lambda: alj.adaptive(statistic="quantile", groups="module"),
    }[config]()


def make_tx(args, scaler):
    inner = optax.sgd(args.lr, momentum=args.momentum)
    if args.regime == "tiny":  # undo the loss multiplier after unscaling: fp32 unchanged
        inner = optax.chain(optax.scale(2.0**TINY_SHIFT), inner)
    return scaled_tx(inner, scaler)


def base_state(opt_state):
    """The LossScaleState (counters, root scale) and the adaptive state, if any."""
    try:
        return alj.scale_state(opt_state), alj.scale_state(opt_state)
    except ValueError:  # a global scaler: no AdaptiveScaleState
        return alj.scale_state(opt_state), None


class Runner:
    """Jitted step / probe / eval for one config, reused across seeds (one compile)."""

    def __init__(self, config: str, args, train_x, train_y):
        self.config = config
        self.dtype = jnp.float32 if config == "fp32" else jnp.float16
        self.model = DeepMLP(args.depth, args.width, dtype=self.dtype, init_scheme=args.init)
        ref = DeepMLP(args.depth, args.width, dtype=jnp.float32, init_scheme=args.init)
        self.multiplier = 2.0**-TINY_SHIFT if args.regime == "tiny" else 1.0
        self.scaler = make_scaler(config)
        self.tx = make_tx(args, self.scaler)
        model, mult, scaler, tx = self.model, self.multiplier, self.scaler, self.tx
        xs, ys = jnp.asarray(train_x), jnp.asarray(train_y, jnp.int32)

        def loss_fn(params, xb, yb):
            return _xent(model, params, xb, yb) * mult

        grads_of = scaled_value_and_grad(loss_fn, scaler)

        @jax.jit
        def step(params, opt_state, idx):
            xb, yb = xs[idx], ys[idx]
            loss, grads, extra = grads_of(opt_state, params, xb, yb)
            updates, opt_state = tx.update(grads, opt_state, params, loss=loss, **extra)
            applied = base_state(opt_state)[0].last_applied
            return optax.apply_updates(params, updates), opt_state, loss / mult, applied

        @jax.jit
        def underflow(params, opt_state, xb, yb):
            _, g_low, _ = grads_of(opt_state, params, xb, yb)
            g_ref = jax.grad(lambda p: _xent(ref, p, xb, yb) * mult)(params)
            r_leaves, l_leaves = jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_low)
            nzs = [jnp.sum(r != 0) for r in r_leaves]
            losts = [jnp.sum((r != 0) & (g == 0)) for r, g in zip(r_leaves, l_leaves)]
            nz, lost = sum(nzs), sum(losts)
            return lost / jnp.maximum(nz, 1), nz, jnp.stack(losts) / jnp.maximum(
                jnp.stack(nzs), 1)

        @jax.jit
        def evaluate(params, xb, yb):
            logits = model.apply({"params": params}, _pixels(xb)).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
            acc = jnp.mean(jnp.argmax(logits, -1) == yb)
            return ce, acc, jnp.all(jnp.isfinite(logits))

        self.step, self.underflow, self.evaluate = step, underflow, evaluate


def longest_run(flags: np.ndarray) -> int:
    best = cur = 0
    for f in flags:
        cur = cur + 1 if f else 0
        best = max(best, cur)
    return best


def run_one(runner: Runner, seed: int, args, batches, probe, test):
    params = runner.model.init(jax.random.key(seed), jnp.zeros((1, 784), jnp.float32))["params"]
    opt_state = runner.tx.init(params)
    losses, applied = [], []
    t0 = time.time()
    t_first, t1 = 0.0, t0
    for i in range(args.steps):
        params, opt_state, loss, ok = runner.step(params, opt_state, batches[i])
        losses.append(loss)
        applied.append(ok)
        if i == 0:
            jax.block_until_ready(params)
            t_first = time.time() - t0
            t1 = time.time()
        if args.progress and (i + 1) % args.progress == 0:
            base = base_state(opt_state)[0]
            print(f"    step {i + 1:5d}  loss {float(loss):8.4f}  "
                  f"skipped {int(base.total_skipped):4d}  "
                  f"log2 root scale {math.log2(float(base.loss_scale)):6.1f}",
                  file=sys.stderr, flush=True)
    jax.block_until_ready(params)
    s_per_step = (time.time() - t1) / max(1, args.steps - 1)
    losses = np.asarray(jax.device_get(jnp.stack(losses)), np.float64)
    applied = np.asarray(jax.device_get(jnp.stack(applied)), bool)

    flushed, nz, per_leaf = runner.underflow(params, opt_state, *probe)
    leaf_names = ["/".join(str(getattr(k, "key", k)) for k in path)
                  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    test_ce, test_acc, logits_finite = runner.evaluate(params, *test)
    params_finite = all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(params))
    base, ada = base_state(opt_state)
    tail = losses[-50:]
    diverged = (not params_finite or not bool(logits_finite) or not np.isfinite(float(test_ce))
                or not np.all(np.isfinite(tail)))
    row = {
        "config": runner.config, "seed": seed, "regime": args.regime, "steps": args.steps,
        "lr": args.lr, "momentum": args.momentum, "init": args.init,
        "test_acc": float(test_acc), "test_loss": float(test_ce),
        "train_loss_last50": float(np.nanmean(tail)) if np.any(np.isfinite(tail)) else None,
        "skipped": int(base.total_skipped), "applied": int(base.total_applied),
        "nonfinite_loss_steps": int(base.total_nonfinite_loss),
        "nonfinite_train_losses": int(np.sum(~np.isfinite(losses))),
        "longest_skip_run": longest_run(~applied),
        "log2_root_scale": float(np.log2(float(base.loss_scale))),
        "diverged": bool(diverged), "params_finite": params_finite,
        "grad_underflow": float(flushed), "grad_nonzero_fp32": int(nz),
        "grad_underflow_per_leaf": dict(zip(leaf_names, map(float, per_leaf))),
        "first_step_s": t_first, "s_per_step": s_per_step,
        "loss_every_50": [float(x) for x in losses[::50]],
    }
    if ada is not None:
        row.update(alj.diagnostics.scale_summary(ada))
        groups = row["log2_group_scales"]
        lo, hi = math.log2(runner.scaler.min_scale), math.log2(runner.scaler.max_scale)
        row["bounds_hit"] = sorted(g or "(root)" for g, v in groups.items() if v <= lo or v >= hi)
    return row


# --------------------------------------------------------------------------- output


def _ms(xs):
    xs = np.asarray(xs, np.float64)
    return float(np.mean(xs)), (float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0)


def table(rows, configs) -> str:
    header = ["config", "test acc", "skipped", "nonfin loss", "max skip run",
              "log2 root scale", "group log2 min/med/max", "diverged", "grad underflow",
              "ms/step"]
    lines = [header]
    for c in configs:
        rs = [r for r in rows if r["config"] == c]
        if not rs:
            continue
        m, s = _ms([r["test_acc"] for r in rs])
        us = [r["grad_underflow"] for r in rs]
        grp = "-"
        if "group_log2_min_med_max" in rs[0]:
            grp = "; ".join("{:.0f}/{:.0f}/{:.0f}".format(*r["group_log2_min_med_max"])
                            for r in rs)
        lines.append([
            c, f"{m:.4f} +- {s:.4f}",
            "/".join(str(r["skipped"]) for r in rs),
            "/".join(str(r["nonfinite_loss_steps"]) for r in rs),
            "/".join(str(r["longest_skip_run"]) for r in rs),
            "/".join(f"{r['log2_root_scale']:.0f}" for r in rs),
            grp,
            f"{sum(r['diverged'] for r in rs)}/{len(rs)}",
            f"{100 * np.mean(us):.2f}% ({100 * min(us):.2f}-{100 * max(us):.2f})",
            f"{1e3 * np.mean([r['s_per_step'] for r in rs]):.1f}",
        ])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(line, widths)) for line in lines)


def per_seed_table(rows) -> str:
    lines = ["config            seed  test acc  test loss  skipped  nonfin  max run  "
             "log2 root  diverged  underflow"]
    for r in rows:
        lines.append(
            f"{r['config']:<17} {r['seed']:>4}  {r['test_acc']:8.4f}  {r['test_loss']:9.4f}  "
            f"{r['skipped']:>7}  {r['nonfinite_loss_steps']:>6}  {r['longest_skip_run']:>7}  "
            f"{r['log2_root_scale']:>9.0f}  {str(r['diverged']):>8}  "
            f"{100 * r['grad_underflow']:8.2f}%")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regime", choices=("tiny", "ordinary"), default="tiny")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--init", choices=("he", "lecun"), default="he",
                   help="hidden kernel init; lecun (flax's default) is the unsteady 4b setting")
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--data", default=DATA_DIR, help="folder with the idx .gz files")
    p.add_argument("--progress", type=int, default=0, help="print a line every N steps")
    p.add_argument("--json", default=None, help="write the raw rows here")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configs {bad}; choose from {', '.join(CONFIGS)}")
    if args.steps < 1 or not seeds:
        p.error("--steps must be >= 1 and --seeds non-empty")

    train_x, train_y, test_x, test_y = load_fashion_mnist(args.data)
    test = (jnp.asarray(test_x), jnp.asarray(test_y, jnp.int32))
    probe_idx = np.random.default_rng(999).choice(len(train_x), args.batch, replace=False)
    probe = (jnp.asarray(train_x[probe_idx]), jnp.asarray(train_y[probe_idx], jnp.int32))
    batches = {s: jnp.asarray(batch_indices(len(train_x), args.batch, args.steps, s))
               for s in seeds}
    title = (f"Deep MLP ({args.depth} x {args.width} ReLU, no normalisation, {args.init} init) on "
             f"Fashion-MNIST, SGD lr {args.lr} momentum {args.momentum}, batch {args.batch}, "
             f"{args.steps} steps, seeds {','.join(map(str, seeds))}, regime {args.regime}"
             + (f" (loss x 2^-{TINY_SHIFT}, grads x 2^{TINY_SHIFT} before SGD)"
                if args.regime == "tiny" else ""))
    print(title, file=sys.stderr, flush=True)

    rows = []
    t_all = time.time()
    for c in configs:
        runner = Runner(c, args, train_x, train_y)
        for s in seeds:
            t0 = time.time()
            row = run_one(runner, s, args, batches[s], probe, test)
            rows.append(row)
            extra = ""
            if "group_log2_min_med_max" in row:
                extra = " groups {:.0f}/{:.0f}/{:.0f}".format(*row["group_log2_min_med_max"])
            print(f"[{c} seed {s}] acc {row['test_acc']:.4f} skipped {row['skipped']} "
                  f"nonfinite-loss {row['nonfinite_loss_steps']} max-run "
                  f"{row['longest_skip_run']} log2 root {row['log2_root_scale']:.0f}{extra} "
                  f"diverged {row['diverged']} underflow {100 * row['grad_underflow']:.2f}% "
                  f"({time.time() - t0:.1f}s, {1e3 * row['s_per_step']:.1f} ms/step)",
                  file=sys.stderr, flush=True)
    print(title)
    print(table(rows, configs))
    print()
    print(per_seed_table(rows))
    print(f"\ntotal {time.time() - t_all:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
