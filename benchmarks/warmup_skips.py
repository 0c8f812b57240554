"""Skipped steps and retries while the adaptive scales settle, with nothing else moving.

Models whose weights stay fixed (SGD with learning rate 0), so every step has the same
statistics and any skipped step is the scale rule's doing:

- ``attn5``: five blocks of LayerNorm -> qkv Dense -> softmax attention -> Dense with a
  residual, fp16 compute, width 32, batch 1024 x 8 tokens, a Dense head;
- ``gpt6`` / ``gpt6-scan``: the bench's byte GPT with 6 blocks (``--gpt-layers``;
  unrolled, or one ``nn.scan``), batch 16 x 63 bytes;
- models no issue named, for a sweep (``--tasks cnn,deepsig,tied,residual``): ``cnn``
  (two convolutions, a LayerNorm, two Dense), ``deepsig`` (ten sigmoid Dense layers),
  ``tied`` (3 pre-norm MLP blocks on token embeddings, the embedding also the output
  layer through ``Embed.attend``), ``residual`` (six Dense layers on a residual stream),
  ``growing`` (four Dense layers on a residual stream, each branch x 4, so the stream's
  cotangent grows several binades a layer), ``remat`` (three residual blocks of two
  Dense layers, each block under ``nn.remat``), ``remat-scan`` (six tanh Dense layers,
  one ``nn.scan`` of an ``nn.remat`` layer), ``highway-scan`` (five highway layers in
  one ``nn.scan``), ``residual-scan`` (six pre-norm residual MLP blocks in one
  ``nn.scan``), ``gru`` (an image read row by row by Flax's ``nn.RNN`` of a GRU cell:
  a scan over time), all fp16 compute.

For each: fp16 and e4m3 cotangents (``simulate=True``; ``--formats`` adds e5m2), per
module and one global scale,
``steps`` steps from the default initial scale; printed: skipped steps (which), passes
retried inside steps (``AdaptiveScaleState.total_retries``), the root's final log2 scale,
and ``moved``: the most any group's log2 scale moved from after step 0 to the end (how
far the first pass's scales were from where they settle).

    python benchmarks/warmup_skips.py                 # the default: retries=0 (the rule
                                                      # alone: a refused step is skipped)
    python benchmarks/warmup_skips.py --retries 4     # computed again inside the step
    python benchmarks/warmup_skips.py --delayed       # per module: the rule's scales alone
    python benchmarks/warmup_skips.py --loss-log2 -20 # the loss x 2^-20 (the bench's tiny
                                                      # regime: the loss's cast flushes)
    python benchmarks/warmup_skips.py --loss-in scan-ce  # the cast in a nested equation
    python benchmarks/warmup_skips.py --tasks cnn,deepsig,tied,residual,growing --steps 8 \
        --formats float16,float8_e4m3fn,float8_e5m2 --reduce sum   # a summed loss
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import adaloss_jax as alj
from adaloss_jax.bench._models import GPT
from adaloss_jax.flax import TrainState, linen_train_step


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=jnp.float16)(x)
        q, k, v = jnp.split(nn.Dense(3 * x.shape[-1], dtype=jnp.float16)(h), 3, -1)
        s = (q @ k.swapaxes(-1, -2)).astype(jnp.float32) / jnp.sqrt(x.shape[-1])
        a = jax.nn.softmax(s).astype(jnp.float16)
        return x + nn.Dense(x.shape[-1], dtype=jnp.float16)(a @ v)


class Attn5(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x)
        for _ in range(5):
            x = _Block()(x)
        return nn.Dense(10, dtype=jnp.float16)(x)


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3), dtype=jnp.float16)(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2, dtype=jnp.float16)(x))
        x = nn.LayerNorm(dtype=jnp.float16)(x).reshape(x.shape[0], -1)
        return nn.Dense(10, dtype=jnp.float16)(nn.gelu(nn.Dense(64, dtype=jnp.float16)(x)))


class _DeepSigmoid(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for _ in range(10):
            x = nn.sigmoid(nn.Dense(64, dtype=jnp.float16)(x))
        return nn.Dense(10, dtype=jnp.float16)(x)


class _Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(64, 32, dtype=jnp.float16)
        h = embed(tokens)
        for _ in range(3):
            mlp = nn.Dense(64, dtype=jnp.float16)(nn.LayerNorm(dtype=jnp.float16)(h))
            h = h + nn.Dense(32, dtype=jnp.float16)(nn.gelu(mlp))
        return embed.attend(nn.LayerNorm(dtype=jnp.float16)(h))


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x.reshape(x.shape[0], -1))
        for _ in range(6):
            x = x + nn.Dense(32, dtype=jnp.float16)(nn.relu(x)) * 0.5
        return nn.Dense(10, dtype=jnp.float16)(x)


class _Growing(nn.Module):
    """A residual stream whose cotangent grows several binades a layer below its last
    reader (each branch x 4): more than a module's first choice keeps room for."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dtype=jnp.float16)(x.reshape(x.shape[0], -1))
        for _ in range(4):
            x = x + nn.Dense(16, dtype=jnp.float16)(x) * 4.0
        return nn.Dense(10, dtype=jnp.float16)(x)


class _RematBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32, dtype=jnp.float16)(nn.relu(nn.Dense(32, dtype=jnp.float16)(x)))


class _Remat(nn.Module):
    """Three residual blocks, each under ``nn.remat``: the stream's readers are each in
    a checkpoint body of its own."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x.reshape(x.shape[0], -1))
        for _ in range(3):
            x = nn.remat(_RematBlock)()(x)
        return nn.Dense(10, dtype=jnp.float16)(x)


class _TanhLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.tanh(nn.Dense(32, dtype=jnp.float16)(x)), None


class _RematScan(nn.Module):
    """Six tanh Dense layers as one ``nn.scan`` of an ``nn.remat`` layer (a chain whose
    every layer is a checkpoint body inside the scan's)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x.reshape(x.shape[0], -1))
        stack = nn.scan(nn.remat(_TanhLayer), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=6)
        return nn.Dense(10, dtype=jnp.float16)(stack()(x, None)[0])


class _GatedLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        g = nn.sigmoid(nn.Dense(32, dtype=jnp.float16)(x))
        return g * x + (1 - g) * nn.Dense(32, dtype=jnp.float16)(x), None


class _HighwayScan(nn.Module):
    """Five highway layers in one ``nn.scan``: each reads the stream three times (its
    gate, its transform and the carry), a fan-in per layer inside the body."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x.reshape(x.shape[0], -1))
        stack = nn.scan(_GatedLayer, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=5)
        return nn.Dense(10, dtype=jnp.float16)(stack()(x, None)[0])


class _PreNormLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.gelu(nn.Dense(64, dtype=jnp.float16)(nn.LayerNorm(dtype=jnp.float16)(x)))
        return x + nn.Dense(32, dtype=jnp.float16)(h), None


class _ResidualScan(nn.Module):
    """Six pre-norm residual MLP blocks in one ``nn.scan`` (the stream a fan-in per
    layer; the first layer's way in inside the body, from the Dense before it)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x.reshape(x.shape[0], -1))
        stack = nn.scan(_PreNormLayer, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=6)
        return nn.Dense(10, dtype=jnp.float16)(
            nn.LayerNorm(dtype=jnp.float16)(stack()(x, None)[0]))


class _Gru(nn.Module):
    """An image read row by row: a Dense per row, Flax's ``nn.RNN`` of a GRU cell over
    the 12 rows (a scan over time, its parameters shared by every step), a Dense head on
    the last step."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, dtype=jnp.float16)(x.reshape(x.shape[0], 12, -1))
        h = nn.RNN(nn.GRUCell(32, dtype=jnp.float16))(x)[:, -1]
        return nn.Dense(10, dtype=jnp.float16)(h)


_SWEEP = {"cnn": _CNN, "deepsig": _DeepSigmoid, "residual": _Residual,
          "growing": _Growing, "remat": _Remat, "remat-scan": _RematScan,
          "highway-scan": _HighwayScan, "residual-scan": _ResidualScan, "gru": _Gru}
TASKS = ("attn5", "gpt6", "gpt6-scan", "tied", *_SWEEP)


def _task(name, loss_log2=0, loss_in="top", reduce="mean", gpt_layers=6):
    key = jax.random.key
    if name == "attn5":
        model = Attn5()
        x = jax.random.normal(key(0), (1024, 8, 16))
        y = jax.random.randint(key(1), (1024, 8), 0, 10)
    elif name == "tied":
        model = _Tied()
        x = jax.random.randint(key(0), (32, 16), 0, 64)
        y = jax.random.randint(key(1), (32, 16), 0, 64)
    elif name in _SWEEP:
        model = _SWEEP[name]()
        x = jax.random.normal(key(0), (64, 12, 12, 1))
        y = jax.random.randint(key(1), (64,), 0, 10)
    else:
        model = GPT(layers=gpt_layers, scan=name.endswith("scan"))
        tokens = jax.random.randint(key(0), (16, 64), 0, 256)
        x, y = tokens[:, :-1], tokens[:, 1:]
    params = model.init(key(2), x)["params"]

    def ce(out, labels):
        logits = out.astype(jnp.float32)
        each = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return (each.sum() if reduce == "sum" else each.mean()) * 2.0**loss_log2

    ce = _CE_WRAPS.get(loss_in, lambda f: f)(ce)

    def loss_fn(p, x, y):
        return ce(model.apply({"params": p}, x), y)

    return model, params, _LOSS_WRAPS.get(loss_in, lambda f: f)(loss_fn), x, y


def _chunked(ce, chunks=4):
    """The cross-entropy chunk by chunk along the batch in a ``lax.scan``: each chunk's
    logits cast to float32 inside the body."""
    def chunked(out, labels):
        split = lambda a: a.reshape(chunks, -1, *a.shape[1:])  # noqa: E731
        return jax.lax.scan(lambda t, c: (t + ce(*c), None), 0.0,
                            (split(out), split(labels)))[0] / chunks
    return chunked


def _sharded(ce):
    """The cross-entropy in a ``shard_map`` over the batch on every device (a mean of
    the devices' means): each device's logits cast to float32 inside the body."""
    from jax.sharding import PartitionSpec as P

    def sharded(out, labels):
        mesh = jax.make_mesh((jax.device_count(),), ("batch",),
                             axis_types=(jax.sharding.AxisType.Auto,))
        per_device = jax.shard_map(
            lambda o, y: jax.lax.pmean(ce(o, y), "batch"), mesh=mesh,
            in_specs=(P("batch"), P("batch")), out_specs=P())
        return per_device(out, labels)
    return sharded


# Where the loss's cast of the model's output sits (--loss-in).
_LOSS_WRAPS = {"jit": jax.jit, "remat": jax.checkpoint}
_CE_WRAPS = {
    "jit-ce": jax.jit,
    "scan-ce": _chunked,
    "shard-ce": _sharded,
    "cond-ce": lambda ce: lambda out, labels: jax.lax.cond(
        labels.ravel()[0] >= 0, ce, lambda *a: 2.0 * ce(*a), out, labels),
    # the first branch taken (a cond's false branch is the first of its branches)
    "cond-ce-first": lambda ce: lambda out, labels: jax.lax.cond(
        labels.ravel()[0] < 0, lambda *a: 2.0 * ce(*a), ce, out, labels),
}
LOSS_IN = ("top", *_LOSS_WRAPS, *_CE_WRAPS)


def run(name, groups, dtype, steps, retries, same_step=None, loss_log2=0, loss_in="top",
        reduce="mean", gpt_layers=6):
    model, params, loss_fn, x, y = _task(name, loss_log2, loss_in, reduce, gpt_layers)
    scaler = alj.adaptive(groups=groups, grad_dtype=dtype, simulate=dtype != "float16",
                          retries=retries, same_step=same_step)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    step = jax.jit(lambda s: linen_train_step(s, loss_fn, x, y))
    skipped, first = [], None
    for i in range(steps):
        state, _ = step(state)
        if not bool(alj.scale_state(state).last_applied):
            skipped.append(i)
        if i == 0:
            first = alj.scale_state(state).log2_scales.array
    st = alj.scale_state(state)
    moved = float(jnp.max(jnp.abs(st.log2_scales.array - first)))
    return skipped, int(st.total_retries), math.log2(float(st.loss_scale)), moved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default="attn5,gpt6,gpt6-scan",
                    help=f"comma list of {', '.join(TASKS)}")
    ap.add_argument("--formats", default="float16,float8_e4m3fn",
                    help="comma list of grad_dtype values (fp8 ones simulated)")
    ap.add_argument("--reduce", default="mean", choices=("mean", "sum"),
                    help="the cross-entropy's reduction over tokens")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--retries", type=int, default=alj.adaptive().retries)
    ap.add_argument("--delayed", action="store_true",
                    help="per module: every scale the rule's, from the steps before "
                         "(same_step=False; the default chooses them in the backward pass)")
    ap.add_argument("--groups", default="module,global")
    ap.add_argument("--gpt-layers", type=int, default=6,
                    help="blocks of the gpt6 / gpt6-scan tasks' GPT")
    ap.add_argument("--loss-log2", type=int, default=0,
                    help="multiply the loss by 2**this (-20: the bench's tiny regime)")
    ap.add_argument("--loss-in", default="top", choices=LOSS_IN,
                    help="where the loss casts the model's output to float32: at its top "
                         "level, the whole loss under jit or checkpoint, a jitted "
                         "cross-entropy, one computed chunk by chunk in a scan, in a "
                         "shard_map over the batch, or in a cond's branches (the last taken, or "
                         "the first: cond-ce-first)")
    args = ap.parse_args(argv)
    print(f"{'task':<10} {'format':<14} {'groups':<7} {'skipped':>7}  {'retries':>7}  "
          f"{'root':>5}  {'moved':>5}  which")
    unknown = set(args.tasks.split(",")) - set(TASKS)
    if unknown:
        ap.error(f"unknown --tasks {', '.join(sorted(unknown))}; choose from "
                 f"{', '.join(TASKS)}")
    for name in args.tasks.split(","):
        for dtype in args.formats.split(","):
            for groups in args.groups.split(","):
                skipped, retries, root, moved = run(
                    name, groups, dtype, args.steps, args.retries,
                    False if args.delayed else None, args.loss_log2, args.loss_in,
                    args.reduce, args.gpt_layers)
                which = ",".join(map(str, skipped[:12])) + ("..." if len(skipped) > 12 else "")
                print(f"{name:<10} {dtype:<14} {groups:<7} {len(skipped):>7}  {retries:>7}  "
                      f"{root:>5.0f}  {moved:>5.0f}  {which or '-'}", flush=True)


if __name__ == "__main__":
    main()
