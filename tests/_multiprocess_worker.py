"""One process of tests/test_multiprocess.py: trains a few steps of a small fp16 MLP with
global and per-layer adaptive scaling on a global mesh, batch sharded with NamedSharding,
and writes what every process must agree on to an .npz file.

Usage: python _multiprocess_worker.py OUT PROCESS_ID NUM_PROCESSES PORT
(NUM_PROCESSES=1: the single-process reference, on all of its local devices.)"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import adaloss_jax as alj

STEPS, BATCH = 4, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.tanh(nn.Dense(32, dtype=jnp.float16)(x))
        return nn.Dense(4, dtype=jnp.float16)(x)


def loss_fn(params, x, y):
    logits = MLP().apply({"params": params}, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * 2.0**-20


def main(out, pid, nproc, port):
    if nproc > 1:  # before any computation: jax's backends start on first use
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                   num_processes=nproc, process_id=pid,
                                   initialization_timeout=120)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, BATCH, 8)).astype(np.float32)
    ys = rng.integers(0, 4, size=(STEPS, BATCH)).astype(np.int32)
    # This process's rows of the global batch.
    lo, hi = pid * BATCH // nproc, (pid + 1) * BATCH // nproc
    params0 = MLP().init(jax.random.key(0), xs[0])["params"]
    result = {"devices": np.asarray(jax.device_count())}
    for groups in ("global", "module"):
        scaler = alj.adaptive(groups=groups)
        tx = alj.adaptive_scaled(optax.adam(1e-2), scaler)

        @jax.jit
        def step(params, state, x, y, tx=tx, scaler=scaler):
            loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(state, params, x, y)
            updates, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
            return optax.apply_updates(params, updates), state

        params = jax.tree_util.tree_map(
            lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)), params0)
        state = jax.tree_util.tree_map(
            lambda a: jax.make_array_from_process_local_data(rep, np.asarray(a)),
            tx.init(params0))
        applied = []
        for t in range(STEPS):
            x = jax.make_array_from_process_local_data(data, xs[t, lo:hi])
            y = jax.make_array_from_process_local_data(data, ys[t, lo:hi])
            params, state = step(params, state, x, y)
            ad = alj.scale_state(jax.tree_util.tree_map(
                lambda a: np.asarray(a.addressable_data(0)), state))
            applied.append(bool(ad.base.last_applied))
        local = lambda a: np.asarray(a.addressable_data(0))
        ad = alj.scale_state(jax.tree_util.tree_map(local, state))
        result[f"{groups}/applied"] = np.asarray(applied)
        result[f"{groups}/counters"] = np.asarray(
            [int(ad.base.total_applied), int(ad.base.total_skipped), int(ad.base.notfinite_count)])
        for g, v in ad.log2_scales.items():
            result[f"{groups}/scale/{g or '(root)'}"] = np.asarray(v)
            result[f"{groups}/amax/{g or '(root)'}"] = np.asarray(ad.log2_amax[g])
        for i, leaf in enumerate(jax.tree_util.tree_leaves(params)):
            result[f"{groups}/param/{i}"] = local(leaf)
    np.savez(out, **result)
    if nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
