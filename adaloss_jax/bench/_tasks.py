"""Bench tasks: a model, its data, its loss, its optimizer and its quality measure.

=================  ==========================================================  ===========
task               model and data                                              quality
=================  ==========================================================  ===========
``code-gpt``       byte GPT (2 pre-LN blocks, d=64, tied embedding) on the      bits/byte
                   Python standard library's source (always present)            (held out)
``code-gpt-deep``  the same GPT with 8 blocks, same data; tiny regime only      bits/byte
``text-gpt``       the same GPT on the Python docs' reStructuredText sources    bits/byte
                   (Debian ``python3-doc``)
``fmnist-resnet``  small ResNet with BatchNorm (stride-2 stem, 8-16-32 ch.)    test
                   on Fashion-MNIST (Debian ``dataset-fashion-mnist``)          accuracy
``fmnist-deep``    plain 16 x 256 ReLU MLP, no normalisation, on Fashion-MNIST  test
                   (per-layer gradient magnitudes spread widely)                accuracy
``fmnist-sigmoid`` plain 8 x 128 sigmoid MLP, no normalisation, on              test
                   Fashion-MNIST: the layers' gradient ranges spread ~2         accuracy
                   binades a layer, wider than fp8's range; tiny regime only
``*-scan``         ``code-gpt-deep-scan``, ``fmnist-sigmoid-scan``: the same
                   models with their stack in one ``nn.scan`` (one compiled
                   block, parameters stacked), as large models are written
=================  ==========================================================  ===========

The two deep tasks (``code-gpt-deep``, ``fmnist-sigmoid``) are where per-layer scales
matter; by default they run the configurations of ``_configs.DEPTH`` (fp32, bf16, fp16
dynamic, adaptive global and per-layer, e4m3 and e5m2 cotangents global and per-layer,
and the fp8 peers) with more probe steps, for the underflow heat maps; their
scanned variants run ``_configs.SCANNED``.

Splits are fixed (split seed 0); the training seed sets the initialisation and the order
of the batches, the same for every configuration.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adaloss_jax.bench import _data, _models
from adaloss_jax.bench._configs import DEPTH as DEPTH_CONFIGS
from adaloss_jax.bench._configs import SCANNED as SCANNED_CONFIGS


@dataclasses.dataclass
class Task:
    """One bench task (see the module docstring). Data is loaded on first use."""

    name: str
    description: str
    metric: str  # "bits/byte" or "accuracy"
    higher_is_better: bool
    steps: int  # training steps of a full run
    quick_steps: int  # training steps under --quick
    make_model: Callable[[Any, Any], Any]  # (compute dtype, dot_general_cls) -> model
    make_optimizer: Callable[[int], optax.GradientTransformation]  # of the run's steps
    loader: Callable[[], dict]
    settings: str  # what identifies a result (model, batch, optimizer): part of a row's key
    probes: int = 6  # probed steps per run (underflow per module)
    regimes: tuple[str, ...] | None = None  # the suite's regimes for it (None: all)
    configs: tuple[str, ...] | None = None  # the suite's configs (None: the regime's set)
    _data: dict | None = dataclasses.field(default=None, repr=False)

    @property
    def data(self) -> dict:
        if self._data is None:
            self._data = self.loader()
        return self._data

    def available(self) -> str | None:
        """``None`` when the data is there, else the message saying how to install it."""
        try:
            self.data  # noqa: B018
        except _data.DataUnavailable as e:
            return str(e)
        return None

    def model(self, dtype, dot_general_cls=None):
        return self.make_model(dtype, dot_general_cls)

    def init(self, model, seed: int):
        """``(params, model_state)``: model_state holds BatchNorm statistics, if any."""
        variables = model.init(jax.random.key(seed), *self.data["example"])
        params = variables.pop("params")
        return params, dict(variables)

    def loss(self, model, params, model_state, batch):
        """Mean cross-entropy in nats (fp32) and the updated model state."""
        return self.data["loss"](model, params, model_state, batch)

    def batches(self, seed: int, steps: int):
        """``batch(i)`` for ``i < steps``: numpy arrays, the same for every config."""
        return self.data["batches"](seed, steps)

    def evaluator(self, model):
        """A function ``(params, model_state) -> {"quality": ..., "eval_loss": ...}``."""
        return self.data["evaluator"](model)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()


# ------------------------------------------------------------------------ byte GPTs

GPT_SHAPE = {"layers": 2, "d_model": 64, "heads": 4, "context": 64}
DEEP_GPT_SHAPE = {**GPT_SHAPE, "layers": 8}
GPT_BATCH = 16
GPT_VAL_BATCHES = 16


def _gpt_loader(files_fn: Callable[[], list[str]]):
    def load():
        train, val = _data.split_by_file(files_fn(), seed=0)
        ctx = GPT_SHAPE["context"]
        val_batches = jnp.asarray(_data.byte_batches(val, GPT_BATCH, ctx, GPT_VAL_BATCHES,
                                                     seed=12345))

        # model_state: variables other than params (flax's fp8 scaling state, if any).
        def loss(model, params, model_state, batch):
            logits = model.apply({"params": params, **model_state}, batch[:, :-1])
            return _xent(logits, batch[:, 1:]), model_state

        def batches(seed, steps):
            arr = _data.byte_batches(train, GPT_BATCH, ctx, steps, seed=seed + 2)
            return lambda i: arr[i]

        def evaluator(model):
            @jax.jit
            def ev(params, model_state):
                def one(b):
                    logits = model.apply({"params": params, **model_state}, b[:, :-1])
                    return _xent(logits, b[:, 1:])
                nats = jnp.mean(jax.lax.map(one, val_batches))
                bpb = nats / math.log(2)
                return {"quality": bpb, "eval_loss": bpb}
            return ev

        return {
            "example": (jnp.zeros((1, ctx), jnp.int32),),
            "loss": loss, "batches": batches, "evaluator": evaluator,
            "sizes": f"{len(train)} train / {len(val)} val bytes",
        }

    return load


def _gpt_task(name, description, files_fn, steps, quick_steps, shape=GPT_SHAPE,
              scan: bool = False, **kwargs) -> Task:
    return Task(
        name=name, description=description, metric="bits/byte", higher_is_better=False,
        steps=steps, quick_steps=quick_steps,
        make_model=lambda dtype, dg: _models.GPT(**shape, dtype=dtype, dot_general_cls=dg,
                                                 scan=scan),
        make_optimizer=lambda steps: optax.adamw(2e-3, weight_decay=0.01),
        loader=_gpt_loader(files_fn),
        settings=f"gpt{shape}{'-scan' if scan else ''}-b{GPT_BATCH}-adamw2e-3", **kwargs,
    )


def _sigmoid_task(scan: bool) -> Task:
    return Task(
        name="fmnist-sigmoid-scan" if scan else "fmnist-sigmoid",
        description="plain 8 x 128 sigmoid MLP (no normalisation) on Fashion-MNIST"
        + (", layers 1-7 in one nn.scan" if scan else ""),
        metric="accuracy", higher_is_better=True, steps=3000, quick_steps=1000,
        make_model=lambda dtype, dg: _models.sigmoid_mlp(dtype, dg, scan=scan),
        # 3000 steps: sigmoid stacks sit on a plateau first, and fp32 must leave it
        # on every seed (docs/results.md section 8).
        make_optimizer=lambda steps: optax.adam(1e-3),
        loader=_fmnist_loader((784,), train_flag=False),
        settings=f"sigmoid8x128{'-scan' if scan else ''}-b{FMNIST_BATCH}-adam1e-3",
        probes=12, regimes=("tiny",), configs=SCANNED_CONFIGS if scan else DEPTH_CONFIGS,
    )


# ---------------------------------------------------------------------- Fashion-MNIST

FMNIST_BATCH = 128


def _fmnist_loader(image_shape: tuple[int, ...], train_flag: bool):
    """``train_flag``: the model takes ``train=`` (BatchNorm) and has batch statistics."""

    def load():
        tx, ty, vx, vy = _data.load_fashion_mnist()
        tx = tx.reshape((len(tx), *image_shape))
        vx = vx.reshape((len(vx), *image_shape))
        pixels = lambda x: jnp.asarray(x, jnp.float32) / 255.0  # noqa: E731
        test_x, test_y = jnp.asarray(vx), jnp.asarray(vy, jnp.int32)

        def apply(model, params, model_state, x, train):
            variables = {"params": params, **model_state}
            if not train_flag:
                return model.apply(variables, pixels(x)), model_state
            if not train:
                return model.apply(variables, pixels(x), train=False), model_state
            logits, new = model.apply(variables, pixels(x), train=True,
                                      mutable=["batch_stats"])
            return logits, dict(new)

        def loss(model, params, model_state, batch):
            x, y = batch
            logits, new = apply(model, params, model_state, x, True)
            return _xent(logits, y), new

        def batches(seed, steps):
            idx = _data.epoch_indices(len(tx), FMNIST_BATCH, steps, seed)
            return lambda i: (tx[idx[i]], ty[idx[i]].astype(np.int32))

        def evaluator(model):
            @jax.jit
            def ev(params, model_state):
                xs = test_x.reshape(10, -1, *image_shape)
                ys = test_y.reshape(10, -1)

                def one(xy):
                    logits = apply(model, params, model_state, xy[0], False)[0]
                    logits = logits.astype(jnp.float32)
                    return (_xent(logits, xy[1]), jnp.mean(jnp.argmax(logits, -1) == xy[1]))

                ce, acc = jax.lax.map(one, (xs, ys))
                return {"quality": jnp.mean(acc), "eval_loss": jnp.mean(ce)}
            return ev

        example = jnp.zeros((1, *image_shape), jnp.uint8)
        return {
            "example": (pixels(example),) + ((False,) if train_flag else ()),
            "loss": loss, "batches": batches, "evaluator": evaluator,
            "sizes": f"{len(tx)} train / {len(vx)} test images",
        }

    return load


# ---------------------------------------------------------------------------- registry

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        _gpt_task("code-gpt", "byte GPT on the Python standard library's source",
                  _data.stdlib_files, steps=300, quick_steps=150),
        _gpt_task("text-gpt", "byte GPT on English text (python3-doc reST sources)",
                  _data.python_doc_files, steps=300, quick_steps=150),
        Task(
            name="fmnist-resnet",
            description="small ResNet with BatchNorm on Fashion-MNIST",
            metric="accuracy", higher_is_better=True, steps=300, quick_steps=100,
            make_model=lambda dtype, dg: _models.ResNet(dtype=dtype),
            make_optimizer=lambda steps: optax.adamw(2e-3, weight_decay=1e-4),
            loader=_fmnist_loader((28, 28, 1), train_flag=True),
            settings=f"resnet-s2-8-16-32-b{FMNIST_BATCH}-adamw2e-3",
        ),
        Task(
            name="fmnist-deep",
            description="plain 16 x 256 ReLU MLP (no normalisation) on Fashion-MNIST",
            metric="accuracy", higher_is_better=True, steps=400, quick_steps=200,
            make_model=lambda dtype, dg: _models.DeepMLP(dtype=dtype, dot_general_cls=dg),
            # Cosine decay to zero: the last steps settle, so the final accuracy is steady
            # enough to compare (with a constant rate, seeds' paired spread was 0.02-0.04).
            make_optimizer=lambda steps: optax.sgd(optax.cosine_decay_schedule(0.01, steps),
                                                   momentum=0.9),
            loader=_fmnist_loader((784,), train_flag=False),
            settings=f"mlp16x256he-b{FMNIST_BATCH}-sgd0.01cos-m0.9",
        ),
        _gpt_task("code-gpt-deep", "byte GPT with 8 blocks on the Python standard "
                  "library's source", _data.stdlib_files, steps=300, quick_steps=150,
                  shape=DEEP_GPT_SHAPE, probes=10, regimes=("tiny",), configs=DEPTH_CONFIGS),
        _sigmoid_task(scan=False),
        _gpt_task("code-gpt-deep-scan", "byte GPT with 8 blocks in one nn.scan on the "
                  "Python standard library's source", _data.stdlib_files, steps=300,
                  quick_steps=150, shape=DEEP_GPT_SHAPE, scan=True, probes=10,
                  regimes=("tiny",), configs=SCANNED_CONFIGS),
        _sigmoid_task(scan=True),
    )
}
