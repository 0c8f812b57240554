"""What a skipped step does to the optimizer after the scaler, for each way of skipping.

A 2-layer MLP (fp16 compute) on Fashion-MNIST with ``adamw(1e-3, weight_decay=1e-4)``
behind adaptive scaling, 200 steps; steps 100 and 150 are made to overflow (the loss is
multiplied by 2**60). Three chains:

* ``nan``: the old signal (NaN updates on a skipped step) in the literal chain
  ``optax.chain(adaptive_unscale(), adamw)``;
* ``literal``: the same chain as shipped (a skipped step hands adamw ``-0.0``: a zero
  gradient);
* ``exact``: ``adaptive_scaled(adamw)`` (``skip_nonfinite`` around adamw).

Printed per chain: whether the parameters stay finite, the parameter change on the
skipped steps relative to the median change of an applied step, how far Adam's first and
second moments moved on them (relative norm of the change), and the final test accuracy.

Usage: ``python benchmarks/skip_options.py``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import adaloss_jax as alj
from adaloss_jax.bench import _data

STEPS, BAD = 200, (100, 150)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256, dtype=jnp.float16)(x.astype(jnp.float16)))
        return nn.Dense(10, dtype=jnp.float16)(x)


def nan_signal():
    """The old skipped-step signal: NaN instead of -0.0."""
    def update(updates, state, params=None, **extra):
        skip = alj._skip.is_skip_signal(updates)
        return jax.tree_util.tree_map(lambda u: jnp.where(skip, jnp.nan, u), updates), state
    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def norm(tree):
    return float(np.sqrt(sum(float(jnp.sum(jnp.square(x.astype(jnp.float32))))
                             for x in jax.tree_util.tree_leaves(tree))))


def adam_moments(opt_state):
    found = [s for s in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)]
    return found[0].mu, found[0].nu


def main() -> None:
    train_x, train_y, test_x, test_y = _data.load_fashion_mnist()
    prep = lambda a: a.reshape(a.shape[0], -1).astype(np.float32) / 255.0
    train_x, test_x = prep(train_x), prep(test_x)
    idx = _data.epoch_indices(len(train_x), 128, STEPS, 0)
    params0 = MLP().init(jax.random.key(0), train_x[:2])["params"]

    def loss_fn(p, x, y, blow):
        logits = MLP().apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * blow

    vg = alj.adaptive_value_and_grad(loss_fn)
    adamw = optax.adamw(1e-3, weight_decay=1e-4)
    chains = {
        "nan": optax.chain(alj.adaptive_unscale(), nan_signal(), adamw),
        "literal": optax.chain(alj.adaptive_unscale(), adamw),
        "exact": alj.adaptive_scaled(adamw),
    }
    print(f"{'chain':<8} {'params finite':>13} {'skipped':>8} {'|dp| skip / applied':>20} "
          f"{'|d mu| / |mu|':>14} {'|d nu| / |nu|':>14} {'test acc':>9}")
    for name, tx in chains.items():
        @jax.jit
        def step(params, opt_state, x, y, blow, tx=tx):
            loss, grads, stats = vg(opt_state, params, x, y, blow)
            updates, opt_state = tx.update(grads, opt_state, params, loss=loss,
                                           scale_stats=stats)
            return optax.apply_updates(params, updates), opt_state

        params, state = params0, tx.init(params0)
        applied_dp, skip_dp, dmu, dnu = [], [], [], []
        for t in range(STEPS):
            b = idx[t]
            blow = 2.0**60 if t in BAD else 1.0
            new_params, new_state = step(params, state, train_x[b], train_y[b],
                                         jnp.float32(blow))
            dp = norm(jax.tree_util.tree_map(lambda a, c: a - c, new_params, params))
            if t in BAD:
                skip_dp.append(dp)
                (m0, v0), (m1, v1) = adam_moments(state), adam_moments(new_state)
                dmu.append(norm(jax.tree_util.tree_map(lambda a, c: a - c, m1, m0)) / norm(m0))
                dnu.append(norm(jax.tree_util.tree_map(lambda a, c: a - c, v1, v0)) / norm(v0))
            elif t > 10:
                applied_dp.append(dp)
            params, state = new_params, new_state
        finite = all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree_util.tree_leaves(params))
        skipped = int(alj.scale_state(state).base.total_skipped)
        logits = MLP().apply({"params": params}, test_x).astype(jnp.float32)
        acc = (float(np.mean(np.argmax(np.asarray(logits), -1) == test_y)) if finite
               else float("nan"))
        ratio = np.mean(skip_dp) / np.median(applied_dp) if finite else float("nan")
        print(f"{name:<8} {str(finite):>13} {skipped:>8} {ratio:>20.3f} {np.mean(dmu):>14.3f} "
              f"{np.mean(dnu):>14.3f} {acc:>9.3f}")


if __name__ == "__main__":
    main()
