"""Transformations x front ends: what a transformed loss measures and computes, against its
untransformed twin (issue 22).

For each front end (pure JAX, Equinox, linen, NNX) and each transformation around the
model (a per-example ``vmap``, ``jax.checkpoint``, ``jax.jit``, ``lax.cond``,
``shard_map`` over 2 devices) or inside it (the same around each layer's call, in each
framework's own spelling), at the same random per-group scales:

* ``stat diff``: the largest difference of a group's log2 amax from the twin's, in
  binades (fp16 model, ``groups="module"``);
* ``grad err``: the largest relative difference of a scaled gradient leaf from the twin's
  (fp16, the same scales);
* ``fp32 err``: the largest relative error of the unscaled gradients against
  ``jax.grad`` of the fp32 loss, under arbitrary per-group scales (exactness).

The models and transformations are those of ``tests/test_jax_transformations.py``.

Usage::

    python benchmarks/transforms_table.py          # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from test_jax_transformations import (  # noqa: E402
    AROUND,
    FRONT_ENDS,
    INSIDE,
    _run,
    _x,
    build,
    scan_twins,
    unscaled_through_optimizer,
)

import adaloss_jax as alj  # noqa: E402


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def row(front_end: str, around: str, inside: str) -> tuple[float, float, float]:
    scaler = alj.adaptive(groups="module")
    plain = build(front_end, "none", "none", jnp.float16, scaler)
    case = build(front_end, around, inside, jnp.float16, scaler)
    rng = np.random.default_rng(0)
    log2 = {g: int(rng.integers(2, 14)) for g in plain.state.groups}
    (_, ga, sa), (_, gb, sb) = _run(case, log2), _run(plain, log2)
    stat = max(abs(np.log2(float(sa.amax[g])) - np.log2(float(sb.amax[g]))) for g in sa.amax)
    grad = max(_rel(u, v) for u, v in zip(jax.tree_util.tree_leaves(ga),
                                          jax.tree_util.tree_leaves(gb)))
    exact = alj.adaptive(groups="module", max_rise=1000)  # applied at the drawn scales
    c32 = build(front_end, around, inside, jnp.float32, exact)
    log2 = {g: int(rng.integers(-8, 16)) for g in c32.state.groups}
    unscaled, _ = unscaled_through_optimizer(c32, exact, log2)
    fp32 = max(_rel(u, r) for u, r in zip(jax.tree_util.tree_leaves(unscaled),
                                          jax.tree_util.tree_leaves(c32.reference())))
    return stat, grad, fp32


def main() -> int:
    print(f"# jax {jax.__version__}; groups='module'; stat diff in binades, errors relative")
    print(f"{'front end':<9} {'where':<7} {'transformation':<10} {'stat diff':>9} "
          f"{'grad err':>9} {'fp32 err':>9}")
    for front_end in FRONT_ENDS:
        cases = [("around", a, "none") for a in AROUND if a != "none"]
        cases += [("inside", "none", i) for i in INSIDE if i != "none"]
        for where, around, inside in cases:
            name = around if where == "around" else inside
            stat, grad, fp32 = row(front_end, around, inside)
            print(f"{front_end:<9} {where:<7} {name:<10} {stat:>9.2g} {grad:>9.2g} "
                  f"{fp32:>9.2g}", flush=True)
    stat, grad, fp32 = scan_row()
    print(f"{'jax':<9} {'inside':<7} {'scan':<10} {stat:>9.2g} {grad:>9.2g} {fp32:>9.2g}"
          f"   (against the unrolled stack; stat diff with groups='global')")
    print("\n# an Equinox MLP under jax.vmap(model)(x), and its layers batched: log2 of the "
          "root group's unit amax")
    for batch, (per_example, batched) in vmap_rows().items():
        print(f"batch {batch:>4}: per-example vmap {per_example:7.2f}, batched {batched:7.2f}")
    return 0


def vmap_rows(batches=(1, 16, 256)) -> dict:
    import equinox as eqx

    from adaloss_jax.equinox import eqx_adaptive_value_and_grad

    mlp = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0), dtype=jnp.float16)
    scaler = alj.adaptive(groups="global")
    state = alj.adaptive_unscale(scaler).init(eqx.filter(mlp, eqx.is_inexact_array))
    state = state.with_log2_scales({"": 14})
    per_example = eqx.filter_jit(eqx_adaptive_value_and_grad(
        lambda m, x: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)))
    params = [(layer.weight.T, layer.bias) for layer in mlp.layers]
    layers = [alj.scale_group(f"layers/{i}")(lambda p, h: h @ p[0] + p[1]) for i in range(3)]

    def batched_loss(p, x):
        h = x
        for i, layer in enumerate(layers):
            h = layer(p[i], h)
            h = jax.nn.relu(h) if i < 2 else h
        return jnp.mean(h.astype(jnp.float32) ** 2)

    bstate = alj.adaptive_unscale(scaler).init(params).with_log2_scales({"": 14})
    batched = jax.jit(alj.adaptive_value_and_grad(batched_loss))
    rng, out = np.random.default_rng(0), {}
    for b in batches:
        x = jnp.asarray(rng.normal(size=(b, 16)), jnp.float16)
        a = float(per_example(state, mlp, x)[2].amax[""])
        c = float(batched(bstate, params, x)[2].amax[""])
        out[b] = (np.log2(a) - 14, np.log2(c) - 14)
    return out


def scan_row() -> tuple[float, float, float]:
    x = _x(jnp.float32)
    params, scanned, unrolled = scan_twins(jnp.float16)
    state = alj.adaptive_unscale(alj.adaptive(groups="global")).init(params)
    state = state.with_log2_scales({"": 12})
    (_, ga, sa), (_, gb, sb) = (jax.jit(alj.adaptive_value_and_grad(f))(state, params, x)
                                for f in (scanned, unrolled))
    stat = abs(np.log2(float(sa.amax[""])) - np.log2(float(sb.amax[""])))
    grad = _rel(ga["stack"]["w"], gb["stack"]["w"])
    params, scanned, _ = scan_twins(jnp.float32)
    state = alj.adaptive_unscale(alj.adaptive(groups="module")).init(params)
    state = state.with_log2_scales({"": 9, "stack": -5})
    _, g, _ = jax.jit(alj.adaptive_value_and_grad(scanned))(state, params, x)
    fp32 = _rel(np.asarray(g["stack"]["w"]) * 2.0**5, jax.grad(scanned)(params, x)["stack"]["w"])
    return stat, grad, fp32


if __name__ == "__main__":
    raise SystemExit(main())
