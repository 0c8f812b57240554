"""How much a step flushes when it is computed below the scale its statistics call for:
the measurement behind ``AdaptiveScale.max_rise`` (issue 22).

For each bench task, loss multiplier and scaler, the parameters at initialisation and
after a few fp32 training steps, and one batch: the scales the rule settles on for that
batch (``T_k``, repeated updates from scale 1 until they stop moving) are lowered by
``r`` binades for every group and the step's gradient is computed at ``T_k - r``.
Reported per ``r``: the rise the rule sees (``max_k`` new scale minus the scale used)
and the share of the non-zero fp32 gradient elements that the step flushes beyond what
the step at ``T_k`` flushes ("flushed by a too-low scale"). The last column is the
largest ``r`` whose excess stays <= 1%.

Usage::

    python benchmarks/underscaled_steps.py                 # every task, about 10 minutes
    python benchmarks/underscaled_steps.py --tasks code-gpt --max-r 24
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax.bench import _tasks

SCALERS = {
    "fp16-global": dict(groups="global"),
    "fp16-module": dict(groups="module"),
    "e4m3-module": dict(groups="module", grad_dtype="float8_e4m3fn", simulate=True),
    "e5m2-module": dict(groups="module", grad_dtype="float8_e5m2", simulate=True),
}


def _flushed(ref, got) -> float:
    nz = lost = 0
    for r, g in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        r, g = np.asarray(r), np.asarray(g)
        nz += int(np.sum(r != 0))
        lost += int(np.sum((r != 0) & (g == 0)))
    return lost / max(nz, 1)


def measure(task_name: str, scaler_name: str, multiplier: float, trained: int,
            max_r: int) -> dict:
    task = _tasks.TASKS[task_name]
    m16, m32 = task.model(jnp.float16), task.model(jnp.float32)
    params, model_state = task.init(m32, 0)
    batch = task.batches(0, trained + 1)
    if trained:  # a few fp32 steps with the task's optimizer: a state past initialisation
        opt = task.make_optimizer(trained)
        opt_state = opt.init(params)

        @jax.jit
        def fp32_step(params, opt_state, model_state, b):
            (_, ms), g = jax.value_and_grad(task.loss, argnums=1, has_aux=True)(
                m32, params, model_state, b)
            u, opt_state = opt.update(g, opt_state, params)
            return optax.apply_updates(params, u), opt_state, ms

        for i in range(trained):
            params, opt_state, model_state = fp32_step(params, opt_state, model_state, batch(i))
    b = batch(trained)
    loss = lambda model: (lambda p, b: task.loss(model, p, model_state, b)[0] * multiplier)
    ref = jax.jit(jax.grad(loss(m32)))(params, b)
    scaler = alj.adaptive(**SCALERS[scaler_name], max_rise=1000)  # every step applied
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))

    @jax.jit
    def step(state):
        lv, g, stats = alj.adaptive_value_and_grad(loss(m16))(state, params, b)
        updates, state = tx.update(g, state, params, loss=lv, scale_stats=stats)
        return updates, state

    state = tx.init(params)
    target = None
    for _ in range(12):  # from scale 1 (all flushed: blind jump) until the scales settle
        _, state = step(state)
        scales = {g: float(v) for g, v in state[0].log2_scales.items()}
        if scales == target:
            break
        target = scales
    rows = []
    for r in range(max_r + 1):
        st = (state[0].with_log2_scales({g: v - r for g, v in target.items()}), state[1])
        updates, new = step(st)
        new_s = new[0]
        rise = max(float(new_s.log2_scales[g]) - (target[g] - r) for g in target)
        rows.append((r, rise, _flushed(ref, updates), bool(new_s.overflowed[""]) or any(
            bool(v) for v in new_s.overflowed.values())))
    base = rows[0][2]
    ok = [r for r, _, f, bad in rows if f - base <= 0.01 and not bad]
    first_bad = next((r for r, _, f, _ in rows if f - base > 0.01), None)
    return {"task": task_name, "scaler": scaler_name, "multiplier": multiplier,
            "trained": trained, "rows": rows, "base": base,
            "largest_ok": max(r for r in ok if first_bad is None or r < first_bad)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="code-gpt,fmnist-deep,fmnist-resnet,fmnist-sigmoid")
    parser.add_argument("--scalers", default=",".join(SCALERS))
    parser.add_argument("--multipliers", default="1,2**-12,2**-20")
    parser.add_argument("--trained", default="0,50", help="fp32 steps before the probe")
    parser.add_argument("--max-r", type=int, default=20)
    args = parser.parse_args(argv)
    mults = [float(eval(m, {})) for m in args.multipliers.split(",")]  # noqa: S307
    print(f"# jax {jax.__version__}; excess = flushed at T-r minus flushed at T; "
          f"rise = largest new scale minus scale used")
    print(f"{'task':<15} {'scaler':<12} {'loss x':>7} {'trained':>7} {'flushed at T':>12}  "
          f"excess at r = 1 / 2 / 4 / 8 / 12 / 16 / 20 (rise seen)   largest r <= 1%")
    t0 = time.perf_counter()
    for task in args.tasks.split(","):
        if _tasks.TASKS[task].available() is not None:
            print(f"{task}: data not installed, skipped", file=sys.stderr)
            continue
        for scaler in args.scalers.split(","):
            for mult in mults:
                for trained in (int(t) for t in args.trained.split(",")):
                    res = measure(task, scaler, mult, trained, args.max_r)
                    cells = []
                    for r in (1, 2, 4, 8, 12, 16, 20):
                        if r <= args.max_r:
                            _, rise, f, _ = res["rows"][r]
                            cells.append(f"{100 * (f - res['base']):5.2f}% ({rise:4.1f})")
                    print(f"{task:<15} {scaler:<12} {np.log2(mult):>7.0f} {trained:>7} "
                          f"{100 * res['base']:>11.3f}%  {' '.join(cells)}  "
                          f"{res['largest_ok']:>3}", flush=True)
    print(f"# {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
