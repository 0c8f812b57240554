"""Adaptive per-layer scaling on Flax NNX models (scale points on a private copy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import assert_fp32_trees_close
from flax import nnx

import adaloss_jax as alj
from adaloss_jax.flax import nnx_adaptive_value_and_grad, nnx_optimizer, nnx_train_step


class Block(nnx.Module):
    def __init__(self, d, rngs, dtype):
        self.norm = nnx.LayerNorm(d, rngs=rngs, dtype=dtype)
        self.fc = nnx.Linear(d, d, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        return x + self.fc(nnx.relu(self.norm(x)))  # residual


class Model(nnx.Module):
    """Tied embedding (``attend``), a block list, one block reachable twice, BatchNorm."""

    def __init__(self, rngs, dtype=jnp.float32, d=8):
        self.embed = nnx.Embed(16, d, rngs=rngs, dtype=dtype)
        self.blocks = nnx.List([Block(d, rngs, dtype), Block(d, rngs, dtype)])
        self.shared = self.blocks[0]
        self.bn = nnx.BatchNorm(d, rngs=rngs, dtype=dtype)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.shared(x)  # the first block again
        x = self.bn(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        return self.embed.attend(x)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 16, size=(4, 6)))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@pytest.mark.parametrize("statistic,max_depth", [("amax", None), ("quantile", None),
                                                 ("amax", 2)])
def test_fp32_exact_under_arbitrary_per_group_scales(statistic, max_depth):
    model = Model(nnx.Rngs(0))
    scaler = alj.adaptive(compute_dtype="float16",  # an fp32 model, scaled all the same
                          groups="module", statistic=statistic, max_depth=max_depth,
                          max_rise=1000)  # applied at the chosen scales
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))
    state = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))
    ad = state[0]
    groups = sorted(ad.log2_scales)
    block = "blocks/0" if max_depth else "blocks/0/fc"
    if max_depth:  # a block (list index included in the path) and its children: one group
        assert set(groups) == {"", "embed", "blocks/0", "blocks/1", "bn"}
    assert {"", "embed", block, "bn"} <= set(groups)
    assert not any(g.startswith("shared") for g in groups)  # shared = blocks/0
    rng = np.random.default_rng(1)
    state = (ad.with_log2_scales({g: int(rng.integers(-6, 14)) for g in groups}),
             state[1])
    ref_model = Model(nnx.Rngs(0))
    ref = nnx.grad(loss_fn)(ref_model, TOKENS)

    @nnx.jit
    def grads(model, state):
        loss, g, stats = nnx_adaptive_value_and_grad(loss_fn)(state, model, TOKENS)
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        updates, new = tx.update(nnx.as_pure(g), state, params, loss=loss, scale_stats=stats)
        return updates, new, stats

    updates, new, stats = grads(model, state)
    assert block in stats.log2_scales and "embed" in stats.log2_scales
    assert bool(new[0].base.last_applied)
    # fp32 reduction order differs between the jitted step and eager nnx.grad.
    assert_fp32_trees_close(updates, nnx.as_pure(ref), atol=1e-6)
    # BatchNorm's running statistics were written back to the model, as nnx.grad does.
    np.testing.assert_allclose(model.bn.mean[...], ref_model.bn.mean[...], rtol=1e-6)
    assert not np.allclose(model.bn.mean[...], 0)
    # The user's classes were not touched.
    assert type(model.blocks[0]) is Block and type(model) is Model


def test_max_depth_that_cuts_a_module_list_is_refused_with_the_depth_that_works():
    model = Model(nnx.Rngs(0), dtype=jnp.float16)
    scaler = alj.adaptive(groups="module", max_depth=1)
    state = alj.adaptive_unscale(scaler).init(nnx.as_pure(nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match=r"max_depth=1: modules under \['blocks'\].*"
                                         r"pass max_depth=2"):
        nnx_adaptive_value_and_grad(loss_fn)(state, model, TOKENS)
    glob = alj.adaptive(groups="global", max_depth=1)  # unmeasured blocks: refused too
    state = alj.adaptive_unscale(glob).init(nnx.as_pure(nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match=r"max_depth=1: .*no scale point.*pass max_depth=2"):
        nnx_adaptive_value_and_grad(loss_fn)(state, model, TOKENS)
    with pytest.raises(ValueError, match="max_depth must be"):
        alj.adaptive(max_depth=0)


def test_nnx_train_step_adaptive_fp16_skips_and_learns():
    model = Model(nnx.Rngs(0), dtype=jnp.float16)
    optimizer = nnx_optimizer(model, optax.adam(1e-2), alj.adaptive(groups="module"))

    @nnx.jit
    def step(model, optimizer, tokens, factor):
        return nnx_train_step(model, optimizer, lambda m, t: loss_fn(m, t) * factor, tokens)

    # Step 0 runs at fp16's start, 2**15, each module at its own choice: applied. Step
    # 3's loss is not finite: skipped.
    skipped = (3,)
    losses = []
    for t in range(8):
        factor = jnp.float32(jnp.inf if t == 3 else 1.0)
        before = nnx.as_pure(nnx.state(model, nnx.Param))
        metrics = step(model, optimizer, TOKENS, factor)
        after = nnx.as_pure(nnx.state(model, nnx.Param))
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                         jax.tree_util.tree_leaves(after)))
        assert bool(metrics["applied"]) == (t not in skipped)
        assert same == (t in skipped)
        if t not in skipped:
            losses.append(float(metrics["loss"]))
    st = alj.scale_state(optimizer)
    assert (int(st.total_applied), int(st.total_skipped), int(st.total_nonfinite_loss)) == (
        7, 1, 1)
    assert int(st.total_retries) == 0
    assert losses[-1] < losses[0]
    scales = alj.scale_state(nnx.as_pure(optimizer.opt_state)).log2_scales
    assert len({float(v) for v in scales.values()}) > 1  # per-group scales really differ


def test_scale_table_and_summary_accept_every_nnx_state_in_model_order():
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import adaloss_jax as alj
    from adaloss_jax.flax import nnx_optimizer, nnx_train_step

    class Chain(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.List([nnx.Linear(4, 4, rngs=rngs, dtype=jnp.float16)
                               for _ in range(11)])

        def __call__(self, x):
            for layer in self.l:
                x = layer(x)
            return x

    model = Chain(nnx.Rngs(0))
    opt = nnx_optimizer(model, optax.adam(1e-3), alj.adaptive(groups="module"))

    @nnx.jit
    def step(model, opt, x):
        return nnx_train_step(model, opt, lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2), x)

    step(model, opt, jnp.ones((2, 4)))
    expected = [""] + [f"l/{i}" for i in range(11)]
    for held in (opt, opt.opt_state, nnx.as_pure(opt.opt_state)):
        assert list(alj.diagnostics.scale_summary(held)["log2_group_scales"]) == expected
        rows = [line.split()[0]
                for line in alj.diagnostics.scale_table(held, legend=False).splitlines()[1:]]
        assert rows == ["(root)"] + expected[1:]
