"""``python -m adaloss_jax.bench``: the bench command (see ``--help``)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import textwrap
import time

import jax

from adaloss_jax.bench import _configs, _report, _runner, _tasks
from adaloss_jax.bench._progress import Progress

EPILOG = """\
examples:
  python -m adaloss_jax.bench --quick           # code-gpt, tiny regime, 6 configs, 3 seeds
  python -m adaloss_jax.bench                   # the full suite (about 3 hours on 2 cores)
  python -m adaloss_jax.bench --tasks fmnist-deep --regimes tiny --configs fp32,fp16-dynamic
  python -m adaloss_jax.bench --tasks fmnist-sigmoid,code-gpt-deep   # where depth matters
  python -m adaloss_jax.bench --tasks fmnist-sigmoid-scan,code-gpt-deep-scan  # scanned stacks
  python -m adaloss_jax.bench --list            # tasks and configurations

Results go to --out (default bench-results/): runs.jsonl (raw rows, one per run),
results.csv, report.md and plots/*.png. Runs already in runs.jsonl with the same task,
regime, config, seed, steps and model settings are not rerun (--rerun forces them); an
interrupted bench keeps every run that finished.
"""


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _check_names(kind: str, names: list[str], valid) -> None:
    bad = [n for n in names if n not in valid]
    if bad:
        raise SystemExit(f"error: unknown {kind} {', '.join(map(repr, bad))}; valid {kind}: "
                         f"{', '.join(valid)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m adaloss_jax.bench",
        description="Measure what loss scaling buys: fp32, bf16, fp16 without scaling, "
                    "dynamic global scaling and adaptive scaling, side by side.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="the README's main job: code-gpt, tiny regime, 6 configs, 3 seeds, "
                        "fewer steps (under 5 minutes on 2 CPU cores)")
    p.add_argument("--tasks", help=f"comma-separated; default all: {', '.join(_tasks.TASKS)}")
    p.add_argument("--regimes", help="comma-separated: ordinary, tiny (default both)")
    p.add_argument("--configs", help="comma-separated; default: the suite's set per regime")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    p.add_argument("--steps", type=int, help="training steps per run (default: per task)")
    p.add_argument("--out", default="bench-results", help="results folder")
    p.add_argument("--rerun", action="store_true", help="rerun runs already in the folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--list", action="store_true", help="list tasks and configs, then exit")
    return p.parse_args(argv)


def make_plan(args) -> dict:
    """``{(task, regime): [configs]}`` in run order."""
    if args.quick:
        tasks = _split(args.tasks) if args.tasks else ["code-gpt"]
        regimes = _split(args.regimes) if args.regimes else ["tiny"]
    else:
        tasks = _split(args.tasks) if args.tasks else list(_tasks.TASKS)
        regimes = _split(args.regimes) if args.regimes else list(_runner.REGIMES)
    _check_names("tasks", tasks, _tasks.TASKS)
    _check_names("regimes", regimes, _runner.REGIMES)
    if args.configs:
        configs = _split(args.configs)
        _check_names("configs", configs, _configs.CONFIGS)
    plan = {}
    for t in tasks:
        task = _tasks.TASKS[t]
        for r in regimes:
            if not args.regimes and task.regimes is not None and r not in task.regimes:
                continue  # a task's own regimes, unless asked for explicitly
            if args.configs:
                plan[(t, r)] = configs
            elif args.quick:
                plan[(t, r)] = list(_configs.QUICK)
            else:
                plan[(t, r)] = list(task.configs or _configs.FULL[r])
    return plan


def _header(args, argv) -> list[str]:
    cmd = "python -m adaloss_jax.bench" + ("" if not argv else " " + " ".join(argv))
    dev = jax.devices()[0]
    return [
        f"Command: `{cmd}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs visible, jax {jax.__version__} "
        f"on {dev.platform} ({dev.device_kind}); Python {platform.python_version()}; "
        f"written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
    ]


def _available(plan: dict, kind: str, names, why, explicit: bool, drop) -> dict:
    """``plan`` without the ``names`` (tasks or configs) that cannot run here (``why(name)``:
    the reason, or ``None``): an explicit request for one stops the bench, the default
    suite skips it and says so."""
    for name in sorted(names):
        msg = why(name)
        if msg is None:
            continue
        if explicit:
            raise SystemExit(f"error: {kind} {name}: {msg}")
        print(f"skipping {kind} {name}: {msg}", file=sys.stderr)
        plan = drop(plan, name)
    return plan


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list:
        print("tasks:")
        for t in _tasks.TASKS.values():
            print(f"  {t.name:<15} {t.description} ({t.metric}; {t.steps} steps, "
                  f"{t.quick_steps} under --quick)")
        print("configs:")
        for c in _configs.CONFIGS.values():
            print(f"  {c.name:<16} {c.description}")
        print(f"regimes: {', '.join(_runner.REGIMES)}")
        return 0
    plan = make_plan(args)
    try:
        seeds = [int(s) for s in _split(args.seeds)]
    except ValueError:
        raise SystemExit(
            f"error: --seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds or (args.steps is not None and args.steps < 2):
        raise SystemExit("error: need at least one seed and --steps >= 2")

    # A configuration's missing package (fp8-qwix needs qwix) stops an explicit request,
    # and is skipped (with the install command) in the default suite.
    plan = _available(plan, "config", {c for cs in plan.values() for c in cs},
                      lambda c: _configs.CONFIGS[c].available(), bool(args.configs),
                      lambda p, c: {k: [x for x in v if x != c] for k, v in p.items()})
    plan = {k: v for k, v in plan.items() if v}
    # Then the data, alike.
    print(f"adaloss_jax bench: loading the data of {', '.join(sorted({t for t, _ in plan}))}",
          file=sys.stderr, flush=True)
    plan = _available(plan, "task", {t for t, _ in plan},
                      lambda t: _tasks.TASKS[t].available(), bool(args.tasks),
                      lambda p, t: {k: v for k, v in p.items() if k[0] != t})
    if not plan:
        raise SystemExit("error: nothing to run")

    os.makedirs(os.path.join(args.out, "plots"), exist_ok=True)
    raw = os.path.join(args.out, "runs.jsonl")
    done = {_report.row_key(r) for r in _report.read_rows(raw)}

    def steps_of(task):
        t = _tasks.TASKS[task]
        return args.steps or (t.quick_steps if args.quick else t.steps)

    def key(task, regime, config, seed) -> tuple:  # as _report.row_key of its run's row
        return (task, regime, config, seed, steps_of(task), _tasks.TASKS[task].settings,
                _configs.CONFIGS[config].spec())

    todo = []
    for (task, regime), configs in plan.items():
        for c in configs:
            missing = [s for s in seeds if args.rerun or key(task, regime, c, s) not in done]
            if missing:
                todo.append((task, regime, c, missing))
    # The tiny regime (where the configurations differ) first, for every task.
    todo.sort(key=lambda x: _runner.REGIMES.index(x[1]))
    total = sum(steps_of(t) * len(s) for t, _, _, s in todo)
    n_runs = sum(len(s) for *_, s in todo)
    print(f"adaloss_jax bench: {len(plan)} task/regime pairs, {n_runs} runs to do "
          f"({sum(len(v) for v in plan.values()) * len(seeds) - n_runs} already in {raw})",
          file=sys.stderr)
    progress = Progress(total, n_runs)
    interrupted = False
    # A `kill` (SIGTERM) stops the bench like Ctrl-C: the report is still written.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for task, regime, config, missing in todo:
            runner = _runner.Runner(_tasks.TASKS[task], _configs.CONFIGS[config], regime,
                                    steps_of(task))
            for seed in missing:
                progress.start_run(f"{task} {regime} {config} seed {seed}")
                t0 = time.perf_counter()
                row = runner.run(seed, on_step=progress.step)
                _report.append_row(raw, row)
                progress.note(
                    f"{task:<13} {regime:<8} {config:<16} seed {seed}: {row['metric']} "
                    f"{row['quality']:.4f}, skipped {row['skipped']}, underflow "
                    f"{100 * row['mean_underflow_after_warmup']:.2f}%, log2 scale "
                    f"{row['final_log2_scale']:.0f}, {1e3 * row['s_per_step']:.1f} ms/step "
                    f"({time.perf_counter() - t0:.0f} s)")
    except KeyboardInterrupt:
        interrupted = True
        progress.note("interrupted: writing the report from the runs that finished")
    finally:
        signal.signal(signal.SIGTERM, previous)
    progress.close()

    wanted = {key(t, r, c, s) for (t, r), cs in plan.items() for c in cs for s in seeds}
    rows = [r for r in _report.read_rows(raw) if _report.row_key(r) in wanted]
    _report.write_csv(os.path.join(args.out, "results.csv"), rows)
    plots = {}
    verdicts = []
    for (task, regime), configs in plan.items():
        rs = [r for r in rows if r["task"] == task and r["regime"] == regime]
        if rs and not args.no_plots:
            plots[(task, regime)] = _report.plot_group(
                rs, configs, f"{task}, {regime} regime",
                os.path.join(args.out, "plots", f"{task}_{regime}"))
        if rs:
            t = _tasks.TASKS[task]
            print(f"\n{task}, {regime} regime: {t.metric} "
                  f"({'higher' if t.higher_is_better else 'lower'} is better), "
                  f"{len({r['seed'] for r in rs})} seeds")
            print(_report.text_table(rs, configs))
            verdicts.append(((task, regime),
                             _report.verdict(rs, configs, t.higher_is_better)))
    if verdicts:
        print("\n" + textwrap.fill(_report.CONSOLE_LEGEND, _report.CONSOLE_WIDTH))
    if not args.no_plots and rows and not any(plots.values()):
        print("\n(plots skipped: matplotlib is not installed; pip install matplotlib)")
    report = os.path.join(args.out, "report.md")
    _report.write_report(report, plan, rows, _header(args, argv), plots,
                         dict(verdicts))
    print(f"\nreport: {report}\nraw rows: {raw}\ntable: "
          f"{os.path.join(args.out, 'results.csv')}")
    # Last, one line per (task, regime): what the tables say.
    for (task, regime), line in verdicts:
        if len(verdicts) > 1:
            line = line.replace("Verdict:", f"Verdict ({task}, {regime}):", 1)
        print(("\n" if (task, regime) == verdicts[0][0] else "") + line)
    return 130 if interrupted else 0
