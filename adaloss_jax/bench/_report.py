"""The bench's outputs: raw rows (JSONL, CSV), a Markdown report and PNG plots."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable

import numpy as np

from adaloss_jax.bench import _configs

SCALAR_FIELDS = (
    "task", "regime", "config", "seed", "steps", "metric", "quality", "eval_loss",
    "diverged", "skipped", "retried", "skipped_after_warmup", "final_log2_scale",
    "final_underflow", "mean_underflow_after_warmup", "s_per_step", "first_step_s", "settings",
)


def row_key(row: dict) -> tuple:
    """A run's identity: rows with the same key are the same run (``spec``: the config's
    resolved options, :meth:`Config.spec`)."""
    return (row["task"], row["regime"], row["config"], row["seed"], row["steps"],
            row["settings"], row.get("spec", ""))


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


def _group_scales(rs: list[dict]) -> list[float]:
    """The final per-group log2 scales of every seed (the root group only when it is
    the only one); empty without per-group scales."""
    vals = []
    for r in rs:
        groups = r.get("group_log2_scales") or {}
        vals += [v for g, v in groups.items() if g] or list(groups.values())
    return vals


def _scale_cell(rs: list[dict], per_seed: bool = True) -> str:
    """The final log2 scale: per-group range over seeds with the group count, else each
    seed's (``per_seed``) or their range ("-" when the scale stayed 1 all along)."""
    groups = max((len([g for g in r.get("group_log2_scales", {}) if g]) for r in rs), default=0)
    if groups > 1:
        vals = _group_scales(rs)
        return f"{min(vals):.0f}..{max(vals):.0f} ({groups} groups)"
    vals = [r["final_log2_scale"] for r in rs]
    if not per_seed and not groups and not any(
            any(r.get("log2_scale_curve", [r["final_log2_scale"]])) for r in rs):
        return "-"
    if per_seed:
        return "/".join(f"{v:.0f}" for v in vals)
    lo, hi = f"{min(vals):.0f}", f"{max(vals):.0f}"
    return lo if lo == hi else f"{lo}..{hi}"


def config_stats(rows: list[dict], configs: list[str]) -> dict[str, dict]:
    """Per configuration present (in ``configs``' order): its rows by seed, the quality's
    mean and sample std over seeds and the paired gap to fp32 (``gap``, ``gap_std``,
    ``gap_n``: the mean, sample std and count of the per-seed differences)."""
    ref = {r["seed"]: r["quality"] for r in rows if r["config"] == "fp32"}
    out = {}
    for c in configs:
        rs = sorted((r for r in rows if r["config"] == c), key=lambda r: r["seed"])
        if not rs:
            continue
        m, s = _mean_std(r["quality"] for r in rs)
        # Seeds share initialisation and batches across configs: the per-seed difference
        # to fp32 is the gap, and its spread is the noise that matters for it.
        diffs = [r["quality"] - ref[r["seed"]] for r in rs if r["seed"] in ref]
        gm, gs = _mean_std(diffs)
        out[c] = {"rows": rs, "mean": m, "std": s, "gap": gm, "gap_std": gs,
                  "gap_n": len(diffs)}
    return out


def summary_table(rows: list[dict], configs: list[str]) -> str:
    """A Markdown table for one (task, regime): one line per configuration."""
    if not rows:
        return "(no results)"
    metric = rows[0]["metric"]
    head = ["config", "seeds", f"{metric} (mean ± std)", "gap to fp32 (paired)",
            "skipped (per seed)", "retried (per seed)",
            "underflow after warm-up", "final underflow", "final log2 scale", "ms/step",
            "diverged"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, st in config_stats(rows, configs).items():
        rs, gm, gs = st["rows"], st["gap"], st["gap_std"]
        uw = float(np.mean([r["mean_underflow_after_warmup"] for r in rs]))
        uf = float(np.mean([r["final_underflow"] for r in rs]))
        lines.append("| " + " | ".join([
            c, str(len(rs)), f"{st['mean']:.4f} ± {st['std']:.4f}",
            "-" if c == "fp32" or not math.isfinite(gm) else f"{gm:+.4f} ± {gs:.4f}",
            "/".join(str(r["skipped"]) for r in rs),
            "/".join(str(r.get("retried", 0)) for r in rs), _pct(uw), _pct(uf), _scale_cell(rs),
            f"{1e3 * float(np.median([r['s_per_step'] for r in rs])):.1f}",
            f"{sum(r['diverged'] for r in rs)}/{len(rs)}",
        ]) + " |")
    return "\n".join(lines)


CONSOLE_WIDTH = 80

CONSOLE_LEGEND = (
    "gap to fp32: mean ± std over seeds of the per-seed difference (same initialisation "
    "and batches); skipped: steps not applied, retried: passes computed again at new "
    "scales (both summed over seeds); underflow: share of gradient "
    "elements flushed to zero after warm-up; log2 scale: final loss scale (range over "
    "seeds and groups; -: no scaling); ms/step: median steady-state step time. The full table (per "
    "seed, final underflow) is in the report."
)


def _aligned(names: list[str], cols: list[tuple[str, list[str]]]) -> list[str]:
    cells = [["config", *(h for h, _ in cols)]]
    cells += [[n, *(v[i] for _, v in cols)] for i, n in enumerate(names)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def text_table(rows: list[dict], configs: list[str], width: int = CONSOLE_WIDTH) -> str:
    """The summary for the terminal: aligned plain text no wider than ``width``; the
    columns are the quality (mean ± std, gap to fp32, skipped and diverged runs), then
    the scaling (retries, underflow after warm-up, final scales, time per step), in as
    many tables as it takes (see :data:`CONSOLE_LEGEND`)."""
    if not rows:
        return "(no results)"
    stats = config_stats(rows, configs)
    names = list(stats)
    col = {k: [] for k in ("q", "gap", "skip", "div", "retry", "under", "scale", "ms")}
    for c, st in stats.items():
        rs, gm = st["rows"], st["gap"]
        col["q"].append(f"{st['mean']:.4f} ± {st['std']:.4f}")
        col["gap"].append("-" if c == "fp32" or not math.isfinite(gm)
                          else f"{gm:+.4f} ± {st['gap_std']:.4f}")
        col["skip"].append(str(sum(r["skipped"] for r in rs)))
        col["div"].append(f"{sum(r['diverged'] for r in rs)}/{len(rs)}")
        col["retry"].append(str(sum(r.get("retried", 0) for r in rs)))
        col["under"].append(_pct(float(np.mean([r["mean_underflow_after_warmup"]
                                                 for r in rs]))))
        col["scale"].append(_scale_cell(rs, per_seed=False))
        col["ms"].append(f"{1e3 * float(np.median([r['s_per_step'] for r in rs])):.1f}")
    groups = [
        [(rows[0]["metric"], col["q"]), ("gap to fp32", col["gap"]), ("skipped", col["skip"]),
         ("diverged", col["div"])],
        [("retried", col["retry"]), ("underflow", col["under"]), ("log2 scale", col["scale"]),
         ("ms/step", col["ms"])],
    ]
    tables = []
    for group in groups:  # each group in one table if it fits, else split where it must
        cur: list = []
        for c in group:
            if cur and max(map(len, _aligned(names, [*cur, c]))) > width:
                tables.append(cur)
                cur = []
            cur.append(c)
        tables.append(cur)
    return "\n\n".join("\n".join(_aligned(names, t)) for t in tables)


def _higher_is_better(metric: str) -> bool:
    return "accuracy" in metric


def _is_adaptive_fp16(config: str) -> bool:
    c = _configs.CONFIGS.get(config)
    if c is None:
        return config.startswith("fp16-ada")
    return c.kind == "adaptive" and "grad_dtype" not in (c.adaptive or {})


def _judge(st: dict, higher_is_better: bool) -> str:
    """``"match"`` (the paired gap within two standard errors of 0), ``"worse"``,
    ``"better"``, ``"diverged"`` or ``"one seed"`` (no noise estimate)."""
    gm, gs, n = st["gap"], st["gap_std"], st["gap_n"]
    if any(r["diverged"] for r in st["rows"]) or not math.isfinite(gm):
        return "diverged"
    if n < 2:
        return "one seed"
    if abs(gm) <= 2 * gs / math.sqrt(n):
        return "match"
    return "better" if (gm > 0) == higher_is_better else "worse"


def _names(cs: list[str]) -> str:
    return cs[0] if len(cs) == 1 else ", ".join(cs[:-1]) + " and " + cs[-1]


def verdict(rows: list[dict], configs: list[str], higher_is_better: bool | None = None) -> str:
    """One line from the results: the configuration closest to fp32 (smallest mean paired
    gap; ties at the table's precision named together) and whether adaptive fp16 matches
    fp32 within noise (the gap within two standard errors of the per-seed differences),
    with its skipped steps counted."""
    if not rows:
        return "Verdict: no results."
    metric = rows[0]["metric"]
    if higher_is_better is None:
        higher_is_better = _higher_is_better(metric)
    stats = config_stats(rows, configs)
    if "fp32" not in stats:
        return "Verdict: no fp32 runs to compare with."
    others = {c: st for c, st in stats.items() if c != "fp32" and math.isfinite(st["gap"])
              and st["gap_n"] and not any(r["diverged"] for r in st["rows"])}
    parts = []
    ada = [c for c in stats if _is_adaptive_fp16(c)]
    if ada:
        by: dict[str, list[str]] = {}
        for c in ada:
            by.setdefault(_judge(stats[c], higher_is_better), []).append(c)
        says = []
        for outcome, cs in by.items():
            rs = [r for c in cs for r in stats[c]["rows"]]
            skips = f"{sum(r['skipped'] for r in rs)} of {sum(r['steps'] for r in rs)} " \
                    "steps skipped"
            gaps = ", ".join(f"{stats[c]['gap']:+.4f}" + (
                f" ± {stats[c]['gap_std']:.4f}" if stats[c]["gap_n"] > 1 else "") for c in cs)
            # One outcome for all: "adaptive fp16"; else the configurations by name.
            who, many = ("adaptive fp16", False) if len(by) == 1 else (_names(cs), len(cs) > 1)
            if outcome == "match":
                say = f"{'match' if many else 'matches'} fp32 within noise ({skips})"
            elif outcome in ("worse", "better"):
                say = (f"{'are' if many else 'is'} {outcome} than fp32 beyond noise ({gaps} "
                       f"{metric}, {skips})")
            elif outcome == "diverged":
                say = f"diverged in {sum(r['diverged'] for r in rs)} of {len(rs)} runs"
            else:
                say = f"gap {gaps} {metric} (one seed: no noise estimate; {skips})"
            says.append(f"{who}{':' if outcome == 'one seed' else ''} {say}")
        parts.append("; ".join(says))
    if others:
        best = min(abs(st["gap"]) for st in others.values())
        tie = f"{best:.4f}"
        closest = [c for c, st in others.items() if f"{abs(st['gap']):.4f}" == tie]
        closest.sort(key=lambda c: abs(others[c]["gap"]))
        parts.append(f"closest to fp32: {', '.join(closest)} "
                     f"({others[closest[0]]['gap']:+.4f} {metric})")
    if not parts:
        return "Verdict: nothing to compare with fp32."
    return "Verdict: " + "; ".join(parts) + "."


# ------------------------------------------------------------------------------ plots


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    if len(y) < k or k <= 1:
        return y
    c = np.cumsum(np.insert(np.nan_to_num(y, nan=np.nanmean(y)), 0, 0.0))
    return (c[k:] - c[:-k]) / k


_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def line_styles(n: int) -> list[dict]:
    """``n`` distinct matplotlib line styles (colour, line style, marker): tab20's ten
    dark hues, then its ten light ones, each with a line style and a marker cycling at
    other periods, so that no two of the first 40 are the same and curves lying on top
    of each other can still be told apart (the markers, hollow, at offset steps)."""
    import matplotlib

    tab20 = matplotlib.colormaps["tab20"]
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    return [{"color": tab20(order[i % 20]), "ls": _LINESTYLES[i % len(_LINESTYLES)],
             "marker": _MARKERS[i % len(_MARKERS)], "mfc": "none"} for i in range(n)]


def _marked(style: dict, i: int, n: int, length: int, marks: int = 8) -> dict:
    """``style`` with markers every ``length / marks`` points, offset by curve ``i`` of
    ``n`` so that the markers of curves on top of each other do not hide one another."""
    every = max(1, length // marks)
    return {**style, "markevery": (min(length - 1, i * every // max(n, 1)), every),
            "ms": 4.5}


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
    # One style per configuration (colour, line style, hollow marker), the same in every
    # plot: fp32, bf16 and the adaptive configurations lie on top of each other.
    styles = dict(zip(present, line_styles(len(present))))
    n = len(present)
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 4.5))
    ref = {r["seed"]: np.asarray(r["loss_curve"], np.float64) for r in by_cfg.get("fp32", [])}
    gap_lim = (-0.15, 0.3)
    off_scale = []
    top = []
    for i, c in enumerate(present):
        curves = np.array([r["loss_curve"] for r in by_cfg[c]], np.float64)
        y = _smooth(np.nanmean(curves, axis=0), 10)
        top += [float(np.nanmax(y))] if np.any(np.isfinite(y)) else []
        ax.plot(np.arange(len(y)) + 10, y, label=c, lw=1.2,
                **_marked(styles[c], i, n, len(y)))
        diffs = [np.asarray(r["loss_curve"], np.float64) - ref[r["seed"]]
                 for r in by_cfg[c] if r["seed"] in ref and c != "fp32"]
        if diffs:
            d = _smooth(np.nanmean(diffs, axis=0), 25)
            dax.plot(np.arange(len(d)) + 25, d, label=c, lw=1.2,
                     **_marked(styles[c], i, n, len(d)))
            if not np.any((d >= gap_lim[0]) & (d <= gap_lim[1])):
                off_scale.append(c)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats, unscaled; 10-step mean)")
    ax.set_title("training loss, mean over seeds", fontsize=9)
    finite = [r["loss_curve"][-1] for c in present for r in by_cfg[c]
              if math.isfinite(r["loss_curve"][-1])]
    if finite:  # a diverging curve is cut, not the axis stretched to it
        ax.set_ylim(min(finite) * 0.95,
                    min(np.percentile(finite, 90) * 1.6, max(top, default=np.inf) * 1.05))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    dax.axhline(0.0, color="black", lw=0.8, zorder=0)  # under the curves that lie on it
    dax.set_xlabel("step")
    dax.set_ylabel("loss - fp32 loss (same seed; 25-step mean)")
    dax.set_title("gap to fp32" + (f" (off the scale: {', '.join(off_scale)})"
                                   if off_scale else ""), fontsize=9)
    dax.set_ylim(*gap_lim)
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
        for i, c in enumerate(scaled):
            y = by_cfg[c][0]["log2_scale_curve"]
            ax.plot(y, label=c, lw=1.2, **_marked(styles[c], i, len(scaled), len(y)))
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
            ys = {g: [p["group_log2_scales"].get(g, math.nan) for p in r["probes"]]
                  for g in groups}
            for g, st in zip(groups, line_styles(len(groups))):
                ax.plot(xs, ys[g], lw=0.9, ms=5, label=g or "(root)", **st)
            ax.set_xlabel("step")
            ax.set_ylabel("log2 group scale")
            ax.set_title(f"{c}: per-group scales (seed {r['seed']})", fontsize=9)
            ax.grid(alpha=0.3)
            # The first probe holds the initial scales (log2 0): far below the rest, they
            # would squeeze the groups into a few pixels; the axis starts near the rest.
            later = [v for g in groups for v in ys[g][1:] if math.isfinite(v)]
            first = [ys[g][0] for g in groups if math.isfinite(ys[g][0])]
            if later and first and max(first) < min(later) - 4:
                ax.set_ylim(min(later) - 1, max(later) + 1)
                ax.text(0.02, 0.03, f"step {xs[0]}: log2 scale {min(first):.0f}"
                        + (f"..{max(first):.0f}" if max(first) > min(first) else "")
                        + " (initial), below the axis", transform=ax.transAxes, fontsize=7)
            if len(groups) <= 40:
                ax.legend(fontsize=6, ncol=1 + len(groups) // 20, loc="center left",
                          bbox_to_anchor=(1.01, 0.5))
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        written.append(f"{stem}_scales.png")
        fig.savefig(written[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------- report


_QUALITY = {  # metric: (what it is, on which tasks: said when the run has both)
    "bits/byte": ("bits/byte (lower is better)", "for the byte-level GPTs"),
    "accuracy": ("test accuracy (higher is better)", "for Fashion-MNIST"),
}
_REGIMES = {
    "ordinary": "**ordinary** trains as is.",
    "tiny": "**tiny** multiplies the loss by 2^-20 before differentiation and the unscaled "
            "gradients by 2^20 before the optimizer, so fp32 is unchanged and any gap is due "
            "to precision alone (what a mean over ~10^6 tokens per step does to per-element "
            "gradients).",
}


def write_report(path: str, plan: dict, rows: list[dict], header: list[str],
                 plots: dict, verdicts: dict | None = None) -> None:
    """``plan``: ``{(task, regime): [configs]}``; ``plots``: ``{(task, regime): [png]}``;
    ``verdicts``: ``{(task, regime): line}``. The notes mention only the metrics and
    regimes of the run."""
    verdicts = verdicts or {}
    out = ["# adaloss_jax bench report", ""] + header + [""]
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    quality = [" ".join(_QUALITY.get(m, (m, ""))[: 1 + (len(metrics) > 1)]).strip()
               for m in metrics]
    regimes = list(dict.fromkeys(r for _, r in plan))
    out += [
        ("Quality is measured on held-out data after the last step: "
         + "; ".join(quality) + ". " if quality else "")
        + "The gap to fp32 is the mean and spread over seeds of the per-seed difference "
        "(a seed's initialisation and batches are the same in every configuration). "
        "*Underflow* is the share of parameter-gradient elements that are non-zero in an "
        "fp32 recomputation of the same step (same weights and batch) and zero in the "
        "configuration's own gradients, on the probed steps (the first two, quarters, the "
        "last); *after warm-up* averages the probes from step 2 on. *Skipped* counts the "
        "steps not applied; *retried*, the passes an adaptive scaler computed again within "
        "a step at new scales (a first step whose gradients flush at the initial scale of 1 "
        "is computed again at the scales it measured, not skipped). ms/step "
        "is the median over seeds of the steady-state step time on this machine "
        "(compilation excluded). The verdict calls a gap *within noise* when it is within "
        "two standard errors of the per-seed differences.",
        "",
        ("Regime: " if len(regimes) == 1 else "Regimes: ")
        + " ".join(_REGIMES.get(r, f"**{r}**.") for r in regimes),
        "",
    ]
    for (task, regime), configs in plan.items():
        rs = [r for r in rows if r["task"] == task and r["regime"] == regime]
        out += [f"## {task}, {regime} regime", ""]
        if not rs:
            out += ["(not run)", ""]
            continue
        out += [summary_table(rs, configs), ""]
        if (task, regime) in verdicts:
            out += [verdicts[(task, regime)].replace("Verdict:", "**Verdict:**", 1), ""]
        for png in plots.get((task, regime), []):
            rel = os.path.relpath(png, os.path.dirname(os.path.abspath(path)))
            out += [f"![{os.path.basename(png)}]({rel})", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))
