"""Two ways to hook NNX module calls for adaptive scaling, compared (issue 11).

NNX has no method interceptor (linen has ``nn.intercept_methods``). The two candidate
hooks, both reporting calls to the same core (:func:`adaloss_jax._points.report`):

* ``swap`` (what :mod:`adaloss_jax.flax` uses): inside the traced loss, each module of a
  private copy of the model gets a subclass of its class whose methods report the call;
  the module's path is a class attribute, so it survives NNX's own split/merge
  (``nnx.scan``, ``nnx.remat`` rebuild the modules they run). Nothing the user holds
  changes, neither objects nor classes.
* ``patch``: the user's module *classes* get reporting methods for the duration of the
  trace (restored afterwards); a call is named by looking its instance up among the
  copy's modules. Classes are process-wide, so while a trace runs every instance of
  them, anywhere, reports.

Per model (8 Linear layers plain, under ``nnx.scan`` and under ``nnx.remat``), fp16,
loss x 2^-16, ``groups="module"``, 3 steps: the groups whose scale moved off 2^0 (a group
that never saw a call keeps 2^0) against the groups the model has, and the time to trace
and compile the step.

Usage::

    python benchmarks/nnx_hooks.py
"""

from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import adaloss_jax as alj
from adaloss_jax import _points, _swap
from adaloss_jax.flax import _nnx_adaptive

D, DEPTH, TINY = 32, 8, 2.0**-16


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(D, D, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class Plain(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(DEPTH)])
        self.head = nnx.Linear(D, 4, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Scanned(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.split_rngs(splits=DEPTH)(nnx.vmap(lambda r: Block(r)))(rngs)
        self.head = nnx.Linear(D, 4, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        x = nnx.scan(lambda c, b: b(c), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return self.head(x)


class Remat(Plain):
    def __call__(self, x):
        for b in self.blocks:
            x = nnx.remat(lambda m, x: m(x))(b, x)
        return self.head(x)


@contextlib.contextmanager
def swap_hook(copy):
    swapped = _swap.install(_nnx_adaptive._modules(copy), _nnx_adaptive._BASE_NAMES)
    try:
        yield
    finally:
        _swap.uninstall(swapped)


@contextlib.contextmanager
def patch_hook(copy):
    names = {id(m): p for p, m in _nnx_adaptive._modules(copy)}
    saved = []
    for cls in {type(m) for _, m in _nnx_adaptive._modules(copy)}:
        original = cls.__call__

        def call(self, *args, _original=original, **kwargs):
            path = names.get(id(self))
            if path is None:  # an instance the copy does not hold (rebuilt by a transform)
                return _original(self, *args, **kwargs)
            return _points.report(path, self, lambda *a, **k: _original(self, *a, **k),
                                  args, kwargs)

        saved.append((cls, original))
        cls.__call__ = call
    try:
        yield
    finally:
        for cls, original in saved:
            cls.__call__ = original


def measure(make, hook):
    model = make(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.as_pure(params)
    scaler = alj.adaptive(groups="module")
    tx = alj.adaptive_scaled(optax.sgd(0.0), scaler)

    def pure(p, x, y):
        copy = nnx.merge(graphdef, p, rest, copy=True)
        ctx = hook(copy) if _points.active() is not None else contextlib.nullcontext()
        with ctx:
            logits = copy(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * TINY

    vg = alj.adaptive_value_and_grad(pure, scaler, hooks=[], cache_token=(make, hook))

    @jax.jit
    def step(state, p, x, y):
        loss, g, stats = vg(state, p, x, y)
        return tx.update(g, state, p, loss=loss, scale_stats=stats)[1]

    x = jax.random.normal(jax.random.key(1), (16, D))
    y = jnp.arange(16) % 4
    state = tx.init(params)
    t0 = time.perf_counter()
    step.lower(state, params, x, y).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        state = step(state, params, x, y)
    scales = alj.adaptive_state(state).log2_scales
    moved = sum(1 for g, v in scales.items() if g and float(v) != 0)
    return moved, len(scales) - 1, compile_s


def main() -> None:
    print(f"{'model':<8} {'hook':<6} {'groups scaled':>14} {'trace+compile s':>16}")
    for make in (Plain, Scanned, Remat):
        for name, hook in (("swap", swap_hook), ("patch", patch_hook)):
            moved, total, secs = measure(make, hook)
            print(f"{make.__name__:<8} {name:<6} {f'{moved}/{total}':>14} {secs:>16.2f}")


if __name__ == "__main__":
    main()
