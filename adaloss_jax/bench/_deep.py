"""Per-layer underflow of the deep sigmoid stacks (:func:`~adaloss_jax.bench._models.
sigmoid_mlp`), unrolled or scanned: shared by ``benchmarks/deep_stream.py`` and the
tests, so that both measure alike."""

from __future__ import annotations

import jax
import numpy as np
import optax

import adaloss_jax as alj
from adaloss_jax.bench._models import layer_kernels
from adaloss_jax.bench._steps import scaled_step


def xent_loss(model):
    """Mean cross-entropy of ``model`` in fp32: ``loss(params, x, y)``."""

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x).astype(np.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def layer_underflow(scaled, ref, span: float = np.inf) -> list[tuple]:
    """Per hidden layer (and the head), unrolled or scanned: (share of kernel-gradient
    elements non-zero in fp32 and zero in the scaled gradients, log2 amax of the fp32
    kernel gradient, the same share among the elements within ``span`` binades of that
    amax)."""
    out = []
    for a, r in zip(layer_kernels(scaled), layer_kernels(ref)):
        a, r = np.asarray(a), np.asarray(r)
        amax = float(np.max(np.abs(r)))
        shares = []
        for lo in (0.0, amax * 2.0**-span):
            keep = (r != 0) & (np.abs(r) >= lo)
            shares.append(float(np.sum(keep & (a == 0)) / max(np.sum(keep), 1)))
        out.append((shares[0], float(np.log2(amax)) if amax > 0 else -np.inf, shares[1]))
    return out


def guaranteed_span(scaler) -> float:
    """Binades below a tensor's amax that every scale the amax rule can pick still holds
    (the format's range less the margin and the rounding of the scale to a power of two):
    what one scale per tensor can promise at all."""
    fmt = scaler.format
    return float(np.log2(fmt.max / fmt.min_subnormal)) - scaler.margin - 1


def settle_and_probe(model16, model32, scaler, x, y, steps: int = 6, params=None):
    """Scales settled over ``steps`` steps at learning rate 0; the scaled gradients of the
    next step, the fp32 reference and the scaler's state. ``params``: the model's
    (default: initialised with key 0)."""
    if params is None:
        params = model32.init(jax.random.key(0), x)["params"]
    loss16 = xent_loss(model16)
    tx, step = scaled_step(loss16, optax.sgd(0.0), scaler)
    opt_state = tx.init(params)
    step = jax.jit(step)
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, x, y)
    vg = jax.jit(alj.adaptive_value_and_grad(loss16))
    _, scaled, _ = vg(opt_state, params, x, y)
    ref = jax.jit(jax.grad(xent_loss(model32)))(params, x, y)
    return scaled, ref, alj.scale_state(opt_state)


def layer_groups(depth: int, scan: bool) -> list[str]:
    """The scale group of each layer of :func:`layer_kernels`' list (per module)."""
    if not scan:
        return [f"Dense_{i}" for i in range(depth + 1)]
    return (["Dense_0"] + [f"layers/layer/Dense_0[{i}]" for i in range(depth - 1)]
            + ["head"])
