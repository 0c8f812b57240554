"""The core is flax-free: with flax and equinox made unimportable, ``import adaloss_jax``
works and a per-module adaptive step on pure-JAX ``scale_group`` functions trains under
``jit`` (in a fresh process, so that this process's flax import does not hide a
dependency)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("flax", "equinox"):
                raise ImportError(f"{name} is blocked in this test")

    sys.meta_path.insert(0, Block())
    import jax, jax.numpy as jnp, optax
    import adaloss_jax as alj

    dense = {n: alj.scale_group(n)(lambda p, x: jnp.tanh(x @ p["w"].astype(jnp.float16)))
             for n in ("a", "b")}
    params = {"a": {"w": jnp.full((4, 4), 0.1)}, "b": {"w": jnp.full((4, 2), 0.1)}}

    def loss_fn(p, x):
        y = dense["b"](p["b"], dense["a"](p["a"], x))
        return jnp.mean(y.astype(jnp.float32) ** 2) * 2.0**-20

    scaler = alj.adaptive(groups="module")
    tx = alj.adaptive_scaled(optax.sgd(0.1), scaler)

    @jax.jit
    def step(params, state, x):
        loss, g, stats = alj.adaptive_value_and_grad(loss_fn)(state, params, x)
        u, state = tx.update(g, state, params, loss=loss, scale_stats=stats)
        return optax.apply_updates(params, u), state

    state = tx.init(params)
    for _ in range(3):
        params, state = step(params, state, jnp.ones((8, 4), jnp.float16))
    ad = alj.scale_state(state)
    assert "flax" not in sys.modules
    assert bool(ad.base.last_applied)
    print(sorted((g, int(v)) for g, v in ad.log2_scales.items()))
''')


def test_core_imports_and_trains_without_flax():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    groups = dict(eval(out.stdout.strip().splitlines()[-1]))  # noqa: S307 - our own output
    assert set(groups) == {"", "a", "b"}
    assert all(v > 16 for v in groups.values()), groups  # moved by the 2^-20 loss
