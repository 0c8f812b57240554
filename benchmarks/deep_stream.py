"""Per-layer scales along the backward stream: the deep sigmoid stacks of issue 10.

Two measurements, each global (``groups="global"``) against per-layer
(``groups="module"``) adaptive scaling:

* ``depth``: ``--depth`` (24) x (Dense(128) + sigmoid) then Dense(10), fp16 compute, fp32
  parameters, one random batch of 128 (64 features, 10 classes). The scales settle over
  6 steps at learning rate 0; then the share of each layer's kernel-gradient elements
  that are non-zero in an fp32 recomputation and zero in the scaled fp16 gradients is
  printed per layer, with the fp32 gradient's log2 amax. Sigmoid's derivative (<= 1/4)
  shrinks the cotangent about 2 binades a layer, so the layers' ranges spread far wider
  than fp16's. ``--e4m3``: cotangents rounded to e4m3 (try ``--depth 8``). Each is
  measured on the stack written as a Python loop and on its twin in one ``nn.scan``
  (the same weights, layers 1.. stacked).
* ``fp8``: ``--fp8-depth`` (8) x (Dense(128) + sigmoid) on Fashion-MNIST (Debian's
  ``dataset-fashion-mnist``), Adam ``--lr`` (1e-3), batch 128, ``--steps`` (3000: by
  then fp32 learns on every seed), fp16 compute with cotangents rounded to e4m3 where
  they enter each Dense (``simulate=True``), and fp32; per seed: test accuracy, skipped
  steps and per-layer underflow at the end (of all kernel-gradient elements, and of those
  within the span below the layer's amax that any one scale per tensor holds).
  ``--scan``: the stack in one ``nn.scan``, from the weights the loop starts from.

Usage::

    python benchmarks/deep_stream.py depth
    python benchmarks/deep_stream.py depth --depth 8 --e4m3
    python benchmarks/deep_stream.py fp8 --seeds 0,1,2 [--scan]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax.bench import _data, _models
from adaloss_jax.bench._deep import (
    guaranteed_span,
    layer_groups,
    layer_underflow,
    settle_and_probe,
    xent_loss,
)
from adaloss_jax.bench._steps import scaled_step


def run_depth(args) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(128, 64)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, size=128))
    fmt = {"grad_dtype": "float8_e4m3fn", "simulate": True} if args.e4m3 else {}
    span = guaranteed_span(alj.adaptive(**fmt)) if args.e4m3 else np.inf
    rows, scales = {}, {}
    for scan in (False, True):
        m16 = _models.sigmoid_mlp(jnp.float16, depth=args.depth, scan=scan)
        m32 = _models.sigmoid_mlp(jnp.float32, depth=args.depth, scan=scan)
        for groups in ("global", "module"):
            t0 = time.perf_counter()
            key = f"{groups}{'-scanned' if scan else ''}"
            params = _models.sigmoid_mlp(jnp.float32, depth=args.depth).init(
                jax.random.key(0), x)["params"]  # the scanned twin: the same weights
            scaled, ref, ad = settle_and_probe(m16, m32, alj.adaptive(groups=groups, **fmt),
                                               x, y, params=_models.stack_layers(params)
                                               if scan else params)
            rows[key] = layer_underflow(scaled, ref, span)
            print(f"[{key}: {time.perf_counter() - t0:.1f} s; skipped "
                  f"{int(ad.base.total_skipped)} of 6]", flush=True)
            if groups == "module":
                # (a state without slots, before 0.2's scanned stacks: the stack's one)
                scales[key] = [float(ad.log2_scales[g if g in ad.groups else g[:g.rfind("[")]])
                               for g in layer_groups(args.depth, scan)]
    held = (f", share of the elements within {span:.1f} binades of the layer's amax (of "
            f"all elements)") if args.e4m3 else ""
    print(f"\n{args.depth} x (Dense(128) + sigmoid), {'e4m3' if args.e4m3 else 'fp16'} "
          f"cotangents, batch 128; kernel-gradient underflow per layer after 6 settling "
          f"steps{held}; unrolled layers and the same layers (same weights) in one "
          f"nn.scan")
    cols = list(rows)
    print(f"{'layer':<7} {'log2 amax fp32':>14} " + " ".join(f"{c:>15}" for c in cols)
          + f" {'log2 scale':>10} {'(scanned)':>9}")
    pick = 2 if args.e4m3 else 0
    for i in range(args.depth + 1):
        print(f"{i:<7} {rows['global'][i][1]:>14.1f} "
              + " ".join(f"{100 * rows[c][i][pick]:>14.2f}%" if not args.e4m3 else
                         f"{100 * rows[c][i][2]:>5.2f}% ({100 * rows[c][i][0]:>5.1f}%)"
                         for c in cols)
              + f" {scales['module'][i]:>10.0f} {scales['module-scanned'][i]:>9.0f}")
    print("\nworst layer: " + ", ".join(
        f"{c} {100 * max(r[pick] for r in rows[c]):.2f}%" for c in cols))


def run_fp8(args) -> None:
    train_x, train_y, test_x, test_y = _data.load_fashion_mnist()
    prep = lambda a: (a.reshape(a.shape[0], -1).astype(np.float32) / 255.0)
    train_x, test_x = prep(train_x), prep(test_x)
    probe = (jnp.asarray(test_x[:128]), jnp.asarray(test_y[:128]))
    m16 = _models.sigmoid_mlp(jnp.float16, depth=args.fp8_depth, scan=args.scan)
    m32 = _models.sigmoid_mlp(jnp.float32, depth=args.fp8_depth, scan=args.scan)
    kw = {k: float(v) for k, v in (a.split("=") for a in args.scaler.split(",") if a)}
    kw = {k: int(v) if k in ("margin", "backoff") else v for k, v in kw.items()}
    configs = {
        "fp32": None,
        "e4m3-global": alj.adaptive(grad_dtype="float8_e4m3fn", simulate=True, **kw),
        "e4m3-module": alj.adaptive(grad_dtype="float8_e4m3fn", simulate=True,
                                    groups="module", **kw),
    }
    if args.configs:
        configs = {k: configs[k] for k in args.configs.split(",")}
    results: dict = {k: [] for k in configs}
    for seed in [int(s) for s in args.seeds.split(",")]:
        idx = _data.epoch_indices(len(train_x), 128, args.steps, seed)
        for name, scaler in configs.items():
            t0 = time.perf_counter()
            params = _models.sigmoid_mlp(jnp.float32, depth=args.fp8_depth).init(
                jax.random.key(seed), probe[0])["params"]
            if args.scan:  # the unrolled stack's scanned twin: the same weights
                params = _models.stack_layers(params)
            if scaler is None:
                loss32 = xent_loss(m32)
                tx = optax.adam(args.lr)
                opt_state = tx.init(params)

                @jax.jit
                def step(params, opt_state, xb, yb, tx=tx, loss32=loss32):
                    loss, g = jax.value_and_grad(loss32)(params, xb, yb)
                    u, opt_state = tx.update(g, opt_state, params)
                    return optax.apply_updates(params, u), opt_state, loss
            else:
                tx, step = scaled_step(xent_loss(m16), optax.adam(args.lr), scaler)
                opt_state = tx.init(params)
                step = jax.jit(step)
            for t in range(args.steps):
                b = idx[t]
                params, opt_state, loss = step(params, opt_state, jnp.asarray(train_x[b]),
                                               jnp.asarray(train_y[b]))
            model = m32 if scaler is None else m16
            logits = jax.jit(lambda p, model=model: model.apply({"params": p},
                                                                jnp.asarray(test_x)))(params)
            acc = float(np.mean(np.argmax(np.asarray(logits, np.float32), -1) == test_y))
            row = {"seed": seed, "acc": acc, "loss": float(loss)}
            if scaler is not None:
                vg = jax.jit(alj.adaptive_value_and_grad(xent_loss(m16)))
                _, scaled, _ = vg(opt_state, params, *probe)
                ref = jax.jit(jax.grad(xent_loss(m32)))(params, *probe)
                under = layer_underflow(scaled, ref, guaranteed_span(scaler))
                row["underflow"] = [u[0] for u in under]
                row["held"] = [u[2] for u in under]
                row["skipped"] = int(alj.scale_state(opt_state).base.total_skipped)
            results[name].append(row)
            extra = ""
            if "underflow" in row:
                extra = (f" skipped {row['skipped']}, max layer underflow "
                         f"{100 * max(row['underflow']):.1f}% (within the format's span: "
                         f"{100 * max(row['held']):.2f}%)")
            print(f"seed {seed} {name:<12} acc {acc:.3f}{extra} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n{args.fp8_depth} x (Dense(128) + sigmoid){' in one nn.scan' if args.scan else ''}, "
          f"Fashion-MNIST, Adam {args.lr:g}, "
          f"{args.steps} steps, e4m3 cotangents")
    span = guaranteed_span(configs.get("e4m3-module") or alj.adaptive(
        grad_dtype="float8_e4m3fn", groups="module"))
    print(f"{'config':<13} {'test acc per seed':<24} {'mean':>6} {'gap to fp32 (paired)':>21} "
          f"{'skipped':>8} {'worst layer underflow':>22} {f'within {span:.1f} binades':>20}")
    base = [r["acc"] for r in results.get("fp32", [])]
    for name, rows in results.items():
        accs = [r["acc"] for r in rows]
        gap = "-"
        if base and name != "fp32":
            d = np.asarray(accs) - np.asarray(base)
            gap = f"{d.mean():+.3f} ± {d.std(ddof=1) if len(d) > 1 else 0.0:.3f}"
        skipped = "-" if name == "fp32" else str(sum(r["skipped"] for r in rows))
        worst = lambda key, name=name, rows=rows: "-" if name == "fp32" else (
            f"{100 * max(max(r[key]) for r in rows):.2f}%")
        print(f"{name:<13} {' '.join(f'{a:.3f}' for a in accs):<24} {np.mean(accs):>6.3f} "
              f"{gap:>21} {skipped:>8} {worst('underflow'):>22} {worst('held'):>20}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("depth", "fp8"))
    p.add_argument("--depth", type=int, default=24)
    p.add_argument("--fp8-depth", type=int, default=8)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--scaler", default="", help="fp8: extra numeric AdaptiveScale "
                   "arguments for the e4m3 configs, e.g. margin=3,decay=0.25")
    p.add_argument("--configs", default="", help="fp8: comma-separated subset of "
                   "fp32,e4m3-global,e4m3-module (default all)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--e4m3", action="store_true", help="depth: e4m3 cotangents "
                   "(simulated) instead of fp16; try --depth 8")
    p.add_argument("--scan", action="store_true", help="fp8: the stack as one nn.scan, "
                   "with the weights the unrolled stack starts from")
    args = p.parse_args(argv)
    (run_depth if args.what == "depth" else run_fp8)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
