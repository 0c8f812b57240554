"""A small model with a stack of layers in one ``nn.scan`` (a scale per layer) and a
head, shared by the per-module tests of the state, its checkpoint and its diagnostics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn


class _Body(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(4, dtype=jnp.float16)(x), None


class Stacked(nn.Module):
    @nn.compact
    def __call__(self, x):
        x, _ = nn.scan(_Body, variable_broadcast=False, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=3)()(x, None)
        return nn.Dense(2, dtype=jnp.float16)(x)


STACK = "Scan_Body_0/Dense_0"  # (flax names the scanned class Scan + _Body)


@functools.cache
def params():
    return Stacked().init(jax.random.key(0), jnp.ones((2, 4), jnp.float16))["params"]


def loss(p, x):
    return jnp.mean(Stacked().apply({"params": p}, x).astype(jnp.float32) ** 2)
