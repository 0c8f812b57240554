"""Runs one (task, regime, configuration) for several seeds: one compile, one row per seed.

Regimes: ``ordinary``, and ``tiny`` (the loss multiplied by 2^-20 before differentiation
and the unscaled gradients by 2^20 before the optimizer, so fp32 training is unchanged
and any gap to it is due to precision alone: what a mean over ~10^6 tokens per step does
to per-element gradients).

Per run it records the training loss and the root scale at every step, whether each
step was applied, and at a few *probe steps* the per-module parameter-gradient underflow
(share of the gradient elements that are non-zero in an fp32 recomputation of the same
step, same weights and batch, and zero in the configuration's own gradients) and, for
the adaptive configurations, every group's scale; at the end the task's quality on
held-out data and the time per step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale

import adaloss_jax as alj
from adaloss_jax import _tree
from adaloss_jax.bench import _configs, _fp8_peers, _steps, _tasks
from adaloss_jax.bench._configs import Config
from adaloss_jax.bench._fp8_peers import FP8_STATE
from adaloss_jax.bench._tasks import Task

TINY_SHIFT = 20
REGIMES = ("tiny", "ordinary")


def probe_steps(steps: int, n: int = 6) -> list[int]:
    """The steps whose gradients are probed: the first two, then ``n - 2`` evenly spaced
    over the run, the last step last (``n=6``: quarters)."""
    even = {steps * k // (n - 2) for k in range(1, n - 2)}
    return sorted({0, 1, steps - 1} | {s for s in even if 0 <= s < steps})


def module_of(leaf: str) -> str:
    """The module path owning a parameter leaf (``"(root)"`` for top-level parameters)."""
    return leaf.rpartition("/")[0] or "(root)"


_REFERENCES: dict = {}


def _reference(task: Task, regime: str):
    """``(params, model_state, batch, grads) -> (non-zero counts, flushed counts)`` per
    leaf against fp32 gradients of the same step; one compile per (task, regime), shared
    by every configuration (its gradients are all float32 pytrees of the same shape)."""
    key = (task.name, regime)
    if key not in _REFERENCES:
        ref_model = task.model(jnp.float32)
        mult = 2.0**-TINY_SHIFT if regime == "tiny" else 1.0

        @jax.jit
        def compare(params, model_state, batch, grads):
            plain = {k: v for k, v in model_state.items() if k != FP8_STATE}
            ref = jax.grad(lambda p: task.loss(ref_model, p, plain, batch)[0] * mult)(
                params)
            r, g = jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(grads)
            nz = jnp.stack([jnp.sum(a != 0) for a in r])
            lost = jnp.stack([jnp.sum((a != 0) & (b == 0)) for a, b in zip(r, g)])
            return nz, lost

        _REFERENCES[key] = compare
    return _REFERENCES[key]


class Runner:
    """The jitted step, probe and evaluation of one (task, regime, config)."""

    def __init__(self, task: Task, config: Config, regime: str, steps: int):
        if regime not in REGIMES:
            raise ValueError(f"unknown regime {regime!r}; choose from {', '.join(REGIMES)}")
        self.task, self.config, self.regime, self.steps = task, config, regime, steps
        kind = config.kind
        self.model = model = _fp8_peers.peer_model(
            task.model, config.dtype, config.fp8 if kind == "fp8" else None)
        self.mult = mult = 2.0**-TINY_SHIFT if regime == "tiny" else 1.0
        inner = task.make_optimizer(steps)
        if regime == "tiny":  # undo the loss multiplier after unscaling: fp32 unchanged
            inner = optax.chain(optax.scale(1.0 / mult), inner)

        def loss_fn(params, model_state, batch):
            loss, new_state = task.loss(model, params, model_state, batch)
            return loss * mult, new_state

        if kind in ("flax", "fp8"):
            tx = inner
        elif kind in ("global", "adaptive"):
            scaling = config.scaler()
            tx = _steps.scaled_tx(inner, scaling)
            vg = _steps.scaled_value_and_grad(loss_fn, scaling, has_aux=True)
        else:
            raise ValueError(f"config {config.name}: unknown kind {kind!r}")
        self.tx = tx

        def grads_of(carry, batch):
            """``(loss, new model state, gradients, update kwargs, flax scale, finite)``."""
            params, model_state, opt_state, ds = carry
            if kind == "fp8" and FP8_STATE not in model_state:  # current scaling
                (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                    params, model_state, batch)
                return loss, new_state, grads, {}, ds, jnp.bool_(True)
            if kind == "fp8":  # no loss scaling: flax scales each dense layer itself
                rest = {k: v for k, v in model_state.items() if k != FP8_STATE}

                def with_fp8(p, fp8):
                    return loss_fn(p, {**rest, FP8_STATE: fp8}, batch)

                (loss, new_state), (grads, fp8) = jax.value_and_grad(
                    with_fp8, argnums=(0, 1), has_aux=True)(params, model_state[FP8_STATE])
                return loss, {**new_state, FP8_STATE: fp8}, grads, {}, ds, jnp.bool_(True)
            if kind == "flax":
                ds, finite, (loss, new_state), grads = ds.value_and_grad(
                    loss_fn, has_aux=True)(params, model_state, batch)
                return loss, new_state, grads, {}, ds, finite
            (loss, new_state), grads, kw = vg(opt_state, params, model_state, batch)
            return loss, new_state, grads, {"loss": loss, **kw}, ds, None

        def step(carry, batch):
            params, model_state, opt_state, _ = carry
            loss, new_state, grads, kw, ds, finite = grads_of(carry, batch)
            updates, new_opt = tx.update(grads, opt_state, params, **kw)
            new_params = optax.apply_updates(params, updates)
            if kind == "fp8":  # nothing skips a step
                applied, log2 = finite, jnp.float32(0.0)
            elif kind == "flax":
                applied = finite
                new_params = alj.select_tree(finite, new_params, params)
                new_opt = alj.select_tree(finite, new_opt, opt_state)
                log2 = jnp.log2(ds.scale)
            else:
                base = alj.scale_state(new_opt)
                applied, log2 = base.last_applied, jnp.log2(base.loss_scale)
            model_state = alj.select_tree(applied, new_state, model_state)
            out = (jnp.asarray(loss, jnp.float32) / mult, applied, log2)
            return (new_params, model_state, new_opt, ds), out, grads

        self.step = jax.jit(step)
        self.reference = _reference(task, regime)
        self.evaluate = task.evaluator(model)

    def _fp8_inside(self, params, model_state) -> bool:
        """Whether the model computes in fp8 (flax's scaling state, or fp8 values in
        its traced loss: the casts of fp8-current and fp8-mxfp8, qwix's quantised
        operands)."""
        if FP8_STATE in model_state:
            return True
        batch = self.task.batches(0, 1)(0)
        jaxpr = jax.make_jaxpr(lambda p: self.task.loss(self.model, p, model_state,
                                                         batch)[0])(params)
        return "f8_e4m3" in str(jaxpr)

    def init(self, seed: int):
        params, model_state = self.task.init(self.model, seed)
        if self.config.kind == "fp8" and not self._fp8_inside(params, model_state):
            fp8_tasks = [t.name for t in _tasks.TASKS.values() if t.configs
                         and self.config.name in t.configs]
            if self.config.fp8 == "qwix":
                raise ValueError(
                    f"config {self.config.name}: task {self.task.name}'s model has no dense "
                    f"layer qwix quantizes (its rule takes every lax.dot_general but the "
                    f"embedding's), so it would train without fp8 under an fp8 label; run "
                    f"{self.config.name} on {', '.join(fp8_tasks)}, or give the model "
                    f"nn.Dense layers")
            raise ValueError(
                f"config {self.config.name}: task {self.task.name}'s model has no dense layer "
                f"that takes dot_general_cls, so it would train without fp8 under an fp8 "
                f"label; run {self.config.name} on {', '.join(fp8_tasks)}, or give the "
                f"model's nn.Dense layers dot_general_cls")
        ds = None
        if self.config.kind == "flax":
            # Arrays, not Python numbers: the state's types must not change after the
            # first step, or the step would compile twice.
            ds = DynamicScale(growth_interval=_configs.DYNAMIC_PERIOD - 1,
                              fin_steps=jnp.int32(0),
                              scale=jnp.float32(_configs.DYNAMIC_START))
        return params, model_state, self.tx.init(params), ds

    def _probe(self, step: int, before, batch, grads, names) -> dict:
        """Underflow of this step's gradients (and the scales it used) per module."""
        nz, lost = jax.device_get(self.reference(before[0], before[1], batch, grads))
        per_module: dict[str, list[int]] = {}
        for name, n, k in zip(names, nz, lost):
            acc = per_module.setdefault(module_of(name), [0, 0])
            acc[0] += int(n)
            acc[1] += int(k)
        out = {
            "step": step,
            "underflow": float(lost.sum() / max(1, nz.sum())),
            "module_underflow": {m: (k / n if n else 0.0) for m, (n, k) in per_module.items()},
        }
        if self.config.kind == "adaptive":
            out["group_log2_scales"] = alj.diagnostics.scale_summary(before[2])["log2_group_scales"]
        return out

    def run(self, seed: int, on_step=None) -> dict[str, Any]:
        """Trains ``self.steps`` steps from ``seed``; returns the row (plain data)."""
        steps = self.steps
        carry = self.init(seed)
        names = [_tree.name(p) for p in _tree.leaf_paths(carry[0])]
        batch = self.task.batches(seed, steps)
        probes_at = set(probe_steps(steps, self.task.probes))
        probes, outs = [], []
        probe_time, t_first, t1 = 0.0, 0.0, 0.0
        t0 = time.perf_counter()
        for i in range(steps):
            before, b = carry, batch(i)
            carry, out, grads = self.step(carry, b)
            outs.append(out)
            if i in probes_at:
                jax.block_until_ready(carry)  # the wait for queued steps is step time
                tp = time.perf_counter()
                probes.append(self._probe(i, before, b, grads, names))
                probe_time += time.perf_counter() - tp
            if i == 0:
                jax.block_until_ready(carry)
                t_first = time.perf_counter() - t0
                t1, probe_time = time.perf_counter(), 0.0
            if on_step is not None:
                on_step()
        jax.block_until_ready(carry)
        s_per_step = (time.perf_counter() - t1 - probe_time) / max(1, steps - 1)
        loss, applied, log2 = (np.asarray(x) for x in jax.device_get(
            tuple(jnp.stack(v) for v in zip(*outs))))
        ev = {k: float(v) for k, v in jax.device_get(self.evaluate(carry[0], carry[1])).items()}
        params_finite = all(bool(np.all(np.isfinite(x)))
                            for x in jax.device_get(jax.tree_util.tree_leaves(carry[0])))
        row = {
            "task": self.task.name, "regime": self.regime, "config": self.config.name,
            "seed": seed, "steps": steps, "settings": self.task.settings,
            "spec": self.config.spec(),
            "metric": self.task.metric, "quality": ev["quality"], "eval_loss": ev["eval_loss"],
            "diverged": not (params_finite and math.isfinite(ev["eval_loss"])),
            "skipped": int(np.sum(~applied)),
            "skipped_after_warmup": int(np.sum(~applied[10:])),
            "final_log2_scale": float(log2[-1]),
            "first_step_s": t_first, "s_per_step": s_per_step,
            "loss_curve": [float(x) for x in loss],
            "log2_scale_curve": [float(x) for x in log2],
            "applied_curve": [bool(x) for x in applied],
            "probes": probes,
            "final_underflow": probes[-1]["underflow"],
            "mean_underflow_after_warmup": float(np.mean(
                [p["underflow"] for p in probes if p["step"] >= 2] or [np.nan])),
        }
        row["retried"] = 0
        if self.config.kind == "adaptive":
            row["group_log2_scales"] = probes[-1]["group_log2_scales"]
            row["retried"] = int(alj.scale_state(carry[2]).total_retries)
        return row
