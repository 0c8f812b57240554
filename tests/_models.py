"""Small Flax linen models covering the graph shapes loss scaling must survive."""

import jax.numpy as jnp
import optax
from flax import linen as nn


class MLP(nn.Module):
    depth: int = 3
    width: int = 16
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width, dtype=self.dtype)(x))
        return nn.Dense(4, dtype=self.dtype)(x)


class CNNBatchNorm(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
        x = nn.relu(x)
        x = nn.Conv(8, (3, 3), strides=2, dtype=self.dtype)(x)
        return nn.Dense(4, dtype=self.dtype)(x.reshape(x.shape[0], -1))


class ResBlock(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(x.shape[-1], (3, 3), dtype=self.dtype)(x))
        return x + nn.Conv(x.shape[-1], (3, 3), dtype=self.dtype)(h)


class ResNet(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        for _ in range(2):
            x = ResBlock(self.dtype)(x)
        return nn.Dense(4, dtype=self.dtype)(x.mean(axis=(1, 2)))


class UNet(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, train=True):
        d1 = nn.relu(nn.Conv(8, (3, 3), dtype=self.dtype)(x))
        d2 = nn.relu(nn.Conv(16, (3, 3), strides=2, dtype=self.dtype)(d1))
        u = nn.ConvTranspose(8, (2, 2), strides=(2, 2), dtype=self.dtype)(d2)
        x = jnp.concatenate([u, d1], axis=-1)  # concatenation skip
        x = nn.relu(nn.Conv(8, (3, 3), dtype=self.dtype)(x))
        return nn.Dense(4, dtype=self.dtype)(x.mean(axis=(1, 2)))


class GPTBlock(nn.Module):
    heads: int = 2
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(self.heads, dtype=self.dtype)(h, h, mask=mask)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(4 * x.shape[-1], dtype=self.dtype)(h)
        return x + nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(h))


class TinyGPT(nn.Module):
    """Byte-level GPT: tied embedding/output head, one block applied twice."""

    d: int = 16
    dtype: object = jnp.float16

    def setup(self):
        self.embed = nn.Embed(256, self.d, dtype=self.dtype)
        self.block = GPTBlock(dtype=self.dtype)
        self.norm = nn.LayerNorm(dtype=self.dtype)

    def __call__(self, tokens, train=True):
        mask = nn.make_causal_mask(tokens)
        x = self.embed(tokens)
        x = self.block(x, mask)
        x = self.block(x, mask)  # the same block again: a reused module
        return self.embed.attend(self.norm(x))


class RecurrentCell(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, x, train=True):
        cell = nn.Dense(x.shape[-1], dtype=self.dtype)
        h = jnp.zeros_like(x)
        for _ in range(3):
            h = jnp.tanh(cell(h) + x)
        return nn.Dense(4, dtype=self.dtype)(h)


def classification_loss(model, variables, x, y, train=True):
    """Mean cross-entropy in fp32; returns (loss, new batch_stats or {})."""
    has_bn = "batch_stats" in variables
    if has_bn:
        logits, new = model.apply(variables, x, train=train, mutable=["batch_stats"])
    else:
        logits, new = model.apply(variables, x, train=train), {}
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return loss.mean(), new


class _ScannedLayer(nn.Module):
    dtype: object = jnp.float16

    @nn.compact
    def __call__(self, h, _):
        shared = nn.Dense(h.shape[-1], dtype=self.dtype)  # called twice per layer
        h = h + shared(nn.gelu(shared(h)))
        return nn.LayerNorm(dtype=self.dtype)(h), None


class ScannedStack(MLP):
    """The MLP's layers stacked with ``nn.scan`` (one compiled body), each with a reused
    submodule."""

    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dense(self.width, dtype=self.dtype)(x)
        stack = nn.scan(_ScannedLayer, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.depth)
        h, _ = stack(dtype=self.dtype)(h, None)
        return nn.Dense(4, dtype=self.dtype)(h)
