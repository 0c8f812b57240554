"""The bench's outputs: raw rows (JSONL, CSV), a Markdown report and PNG plots."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable

import numpy as np

SCALAR_FIELDS = (
    "task", "regime", "config", "seed", "steps", "metric", "quality", "eval_loss",
    "diverged", "skipped", "retried", "skipped_after_warmup", "final_log2_scale",
    "final_underflow", "mean_underflow_after_warmup", "s_per_step", "first_step_s", "settings",
)


def row_key(row: dict) -> tuple:
    return (row["task"], row["regime"], row["config"], row["seed"], row["steps"],
            row["settings"])


def read_rows(path: str) -> list[dict]:
    """The rows of ``runs.jsonl`` (a later row with the same key replaces an earlier one)."""
    if not os.path.exists(path):
        return []
    rows: dict[tuple, dict] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                rows[row_key(row)] = row
    return list(rows.values())


def append_row(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def write_csv(path: str, rows: Iterable[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SCALAR_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _mean_std(xs) -> tuple[float, float]:
    xs = np.asarray(list(xs), np.float64)
    if xs.size == 0:
        return math.nan, math.nan
    return float(np.mean(xs)), (float(np.std(xs, ddof=1)) if xs.size > 1 else 0.0)


def _pct(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if x == 0:
        return "0"
    return "<0.01%" if x < 1e-4 else f"{100 * x:.2f}%"


def _scale_cell(rs: list[dict]) -> str:
    if "group_log2_scales" in rs[0]:
        vals = [v for g, v in rs[0]["group_log2_scales"].items() if g] or [
            rs[0]["group_log2_scales"][""]]
        if len(vals) > 1:
            return f"{min(vals):.0f}..{max(vals):.0f} ({len(vals)} groups)"
    return "/".join(f"{r['final_log2_scale']:.0f}" for r in rs)


def summary_table(rows: list[dict], configs: list[str]) -> str:
    """A Markdown table for one (task, regime): one line per configuration."""
    if not rows:
        return "(no results)"
    metric = rows[0]["metric"]
    ref = {r["seed"]: r["quality"] for r in rows if r["config"] == "fp32"}
    head = ["config", "seeds", f"{metric} (mean ± std)", "gap to fp32 (paired)",
            "skipped (per seed)", "retried (per seed)",
            "underflow after warm-up", "final underflow", "final log2 scale", "ms/step",
            "diverged"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in configs:
        rs = sorted((r for r in rows if r["config"] == c), key=lambda r: r["seed"])
        if not rs:
            continue
        m, s = _mean_std(r["quality"] for r in rs)
        # Seeds share initialisation and batches across configs: the per-seed difference
        # to fp32 is the gap, and its spread is the noise that matters for it.
        gm, gs = _mean_std(r["quality"] - ref[r["seed"]] for r in rs if r["seed"] in ref)
        uw = float(np.mean([r["mean_underflow_after_warmup"] for r in rs]))
        uf = float(np.mean([r["final_underflow"] for r in rs]))
        lines.append("| " + " | ".join([
            c, str(len(rs)), f"{m:.4f} ± {s:.4f}",
            "-" if c == "fp32" or not math.isfinite(gm) else f"{gm:+.4f} ± {gs:.4f}",
            "/".join(str(r["skipped"]) for r in rs),
            "/".join(str(r.get("retried", 0)) for r in rs), _pct(uw), _pct(uf), _scale_cell(rs),
            f"{1e3 * float(np.median([r['s_per_step'] for r in rs])):.1f}",
            f"{sum(r['diverged'] for r in rs)}/{len(rs)}",
        ]) + " |")
    return "\n".join(lines)


def text_table(rows: list[dict], configs: list[str]) -> str:
    """The summary as aligned plain text (for the terminal)."""
    md = summary_table(rows, configs).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for i, line in enumerate(md)
             if i != 1]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


# ------------------------------------------------------------------------------ plots


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    if len(y) < k or k <= 1:
        return y
    c = np.cumsum(np.insert(np.nan_to_num(y, nan=np.nanmean(y)), 0, 0.0))
    return (c[k:] - c[:-k]) / k


def plot_group(rows: list[dict], configs: list[str], title: str, stem: str) -> list[str]:
    """Loss curves, an underflow heat map (module x probe step) and scale traces for one
    (task, regime); returns the PNG paths written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    present = [c for c in configs if any(r["config"] == c for r in rows)]
    by_cfg = {c: sorted((r for r in rows if r["config"] == c), key=lambda r: r["seed"])
              for c in present}

    # Loss curves (mean over seeds, moving average over 10 steps), and each config's
    # difference to fp32 paired by seed: the gap is easier to see there.
    styles = {c: {"color": plt.cm.tab20(i % 20), "ls": ("-", "--", ":")[i // 10 % 3]}
              for i, c in enumerate(present)}
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 4.5))
    ref = {r["seed"]: np.asarray(r["loss_curve"], np.float64) for r in by_cfg.get("fp32", [])}
    for c in present:
        curves = np.array([r["loss_curve"] for r in by_cfg[c]], np.float64)
        y = _smooth(np.nanmean(curves, axis=0), 10)
        ax.plot(np.arange(len(y)) + 10, y, label=c, lw=1.2, **styles[c])
        diffs = [np.asarray(r["loss_curve"], np.float64) - ref[r["seed"]]
                 for r in by_cfg[c] if r["seed"] in ref and c != "fp32"]
        if diffs:
            d = _smooth(np.nanmean(diffs, axis=0), 25)
            dax.plot(np.arange(len(d)) + 25, d, label=c, lw=1.2, **styles[c])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats, unscaled; 10-step mean)")
    ax.set_title("training loss, mean over seeds", fontsize=9)
    finite = [r["loss_curve"][-1] for c in present for r in by_cfg[c]
              if math.isfinite(r["loss_curve"][-1])]
    if finite:
        ax.set_ylim(min(finite) * 0.95, np.percentile(finite, 90) * 1.6)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    dax.axhline(0.0, color="black", lw=0.8)
    dax.set_xlabel("step")
    dax.set_ylabel("loss - fp32 loss (same seed; 25-step mean)")
    dax.set_title("gap to fp32 (off-scale curves: see the table)", fontsize=9)
    dax.set_ylim(-0.15, 0.3)
    dax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    written.append(f"{stem}_loss.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # Underflow heat map, module x probe step, for the low-precision configs.
    low = [c for c in present if c not in ("fp32", "bf16")]
    if low:
        modules = list(by_cfg[low[0]][0]["probes"][0]["module_underflow"])
        steps = [p["step"] for p in by_cfg[low[0]][0]["probes"]]
        fig, axes = plt.subplots(1, len(low), figsize=(2.2 * len(low) + 2.5,
                                                       0.22 * len(modules) + 1.8),
                                 sharey=True, squeeze=False)
        im = None
        for ax, c in zip(axes[0], low):
            grid = np.mean([[[p["module_underflow"].get(m, np.nan) for p in r["probes"]]
                             for m in modules] for r in by_cfg[c]], axis=0)
            im = ax.imshow(100 * grid, aspect="auto", cmap="magma_r", vmin=0, vmax=100,
                           interpolation="nearest")
            ax.set_title(c, fontsize=8)
            ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=6, rotation=90)
            ax.set_xlabel("step", fontsize=7)
        axes[0][0].set_yticks(range(len(modules)), modules, fontsize=6)
        fig.colorbar(im, ax=axes[0].tolist(), label="parameter-gradient underflow (%)",
                     fraction=0.03)
        fig.suptitle(f"{title}: underflow per module (mean over seeds)", fontsize=9)
        written.append(f"{stem}_underflow.png")
        fig.savefig(written[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)

    # Scale traces: the root scale every step; per-group scales at the probe steps.
    scaled = [c for c in present if any(r["final_log2_scale"] != 0 for r in by_cfg[c])
              or "group_log2_scales" in by_cfg[c][0]]
    if scaled:
        module_cfgs = [c for c in scaled if len(by_cfg[c][0].get("group_log2_scales", {})) > 1]
        n = 1 + len(module_cfgs[:2])
        fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
        ax = axes[0][0]
        for c in scaled:
            ax.plot(by_cfg[c][0]["log2_scale_curve"], label=c, lw=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("log2 root (loss) scale")
        ax.set_title(f"root scale (seed {by_cfg[scaled[0]][0]['seed']})", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        for ax, c in zip(axes[0][1:], module_cfgs):
            r = by_cfg[c][0]
            # The groups shown may change (a stack's slots replace it once measured).
            groups = list(dict.fromkeys(g for p in r["probes"] for g in p["group_log2_scales"]))
            xs = [p["step"] for p in r["probes"]]
            for g in groups:
                ax.plot(xs, [p["group_log2_scales"].get(g, math.nan) for p in r["probes"]],
                        marker=".", lw=0.8, label=g or "(root)")
            ax.set_xlabel("step")
            ax.set_ylabel("log2 group scale")
            ax.set_title(f"{c}: per-group scales (seed {r['seed']})", fontsize=9)
            ax.grid(alpha=0.3)
            if len(groups) <= 24:
                ax.legend(fontsize=5, ncol=2)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        written.append(f"{stem}_scales.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------- report


def write_report(path: str, plan: dict, rows: list[dict], header: list[str],
                 plots: dict) -> None:
    """``plan``: ``{(task, regime): [configs]}``; ``plots``: ``{(task, regime): [png]}``."""
    out = ["# adaloss_jax bench report", ""] + header + [""]
    out += [
        "Quality is measured on held-out data after the last step: bits/byte (lower is "
        "better) for the GPT tasks, test accuracy (higher is better) for Fashion-MNIST. "
        "The gap to fp32 is the mean and spread over seeds of the per-seed difference "
        "(a seed's initialisation and batches are the same in every configuration). "
        "*Underflow* is the share of parameter-gradient elements that are non-zero in an "
        "fp32 recomputation of the same step (same weights and batch) and zero in the "
        "configuration's own gradients, on the probed steps (the first two, quarters, the "
        "last); *after warm-up* averages the probes from step 2 on. Skipped steps include "
        "the adaptive scalers' first step, which sees every gradient flush at the initial "
        "scale of 1 and jumps. ms/step is the median over seeds of the steady-state step "
        "time on this machine (compilation excluded).",
        "",
        "Regimes: **ordinary** trains as is. **tiny** multiplies the loss by 2^-20 before "
        "differentiation and the unscaled gradients by 2^20 before the optimizer, so fp32 "
        "is unchanged and any gap is due to precision alone (what a mean over ~10^6 tokens "
        "per step does to per-element gradients).",
        "",
    ]
    for (task, regime), configs in plan.items():
        rs = [r for r in rows if r["task"] == task and r["regime"] == regime]
        out += [f"## {task}, {regime} regime", ""]
        if not rs:
            out += ["(not run)", ""]
            continue
        out += [summary_table(rs, configs), ""]
        for png in plots.get((task, regime), []):
            rel = os.path.relpath(png, os.path.dirname(os.path.abspath(path)))
            out += [f"![{os.path.basename(png)}]({rel})", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))
