"""The bench's Flax linen models: a byte-level GPT, a small ResNet, deep plain MLPs.

Each takes ``dtype``, the compute dtype; parameters stay float32 (master weights), so the
same definition serves every configuration with only the compute dtype switched. The GPT
and the MLPs also take ``dot_general_cls``, handed to every ``nn.Dense`` (``None``: plain
``lax.dot_general``); the fp8 peer configurations pass their fp8 dot products there
(:mod:`adaloss_jax.bench._fp8_peers`; qwix instead wraps the whole model).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# ------------------------------------------------------------------------------ GPT


class Scores(nn.Module):
    """Attention scores ``q k^T / sqrt(d_head)``: a module so that its cotangent is seen."""

    @nn.compact
    def __call__(self, q, k):
        return jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)


class Probs(nn.Module):
    """Causal softmax, computed in fp32 and returned in the compute dtype."""

    @nn.compact
    def __call__(self, scores):
        t = scores.shape[-1]
        mask = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
        return jax.nn.softmax(s, axis=-1).astype(scores.dtype)


def _dense(features: int, dtype, dot_general_cls, **kwargs) -> nn.Dense:
    return nn.Dense(features, dtype=dtype, dot_general_cls=dot_general_cls, **kwargs)


class Attention(nn.Module):
    d_model: int
    heads: int
    dtype: jnp.dtype
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        b, t, _ = x.shape
        qkv = _dense(3 * self.d_model, self.dtype, self.dot_general_cls, name="qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, -1), 3, axis=2)
        p = Probs(name="probs")(Scores(name="scores")(q, k))
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, self.d_model)
        return _dense(self.d_model, self.dtype, self.dot_general_cls, name="proj")(o)


class MLP(nn.Module):
    d_model: int
    dtype: jnp.dtype
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        h = _dense(4 * self.d_model, self.dtype, self.dot_general_cls, name="fc1")(x)
        return _dense(self.d_model, self.dtype, self.dot_general_cls, name="fc2")(nn.gelu(h))


class Block(nn.Module):
    d_model: int
    heads: int
    dtype: jnp.dtype
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.d_model, self.heads, self.dtype, self.dot_general_cls,
                          name="attn")(nn.LayerNorm(dtype=self.dtype, name="ln1")(x))
        return x + MLP(self.d_model, self.dtype, self.dot_general_cls, name="mlp")(
            nn.LayerNorm(dtype=self.dtype, name="ln2")(x))


class _Carried(nn.Module):
    """A layer ``cls(**dict(kwargs))`` as a scan body: ``(x, _) -> (layer(x), None)``."""

    cls: Any
    kwargs: tuple

    @nn.compact
    def __call__(self, x, _):
        return self.cls(**dict(self.kwargs), name="layer")(x), None


def scanned(cls, kwargs: dict, length: int, name: str):
    """``length`` layers ``cls(**kwargs)`` (parameters stacked along a leading axis) run
    by ``nn.scan``, one compiled body whatever the depth: a function ``x -> y``, called
    inside a compact method (its parameters: ``name/layer/...``)."""
    # flax's fp8 layers keep their scales in a collection of their own: one per layer too.
    axes = {"params": 0, "_overwrite_with_gradient": 0}
    stack = nn.scan(_Carried, variable_axes=axes, split_rngs={"params": True},
                    length=length)(cls, tuple(kwargs.items()), name=name)
    return lambda x: stack(x, None)[0]


class GPT(nn.Module):
    """Byte-level pre-LN GPT with a tied embedding (the output head is ``embed.attend``);
    with ``scan=True`` the blocks are one ``nn.scan`` (``blocks/layer``, parameters
    stacked), else ``block_0``, ``block_1``, ..."""

    layers: int = 2
    d_model: int = 64
    heads: int = 4
    context: int = 64
    dtype: jnp.dtype = jnp.float16
    dot_general_cls: Any = None
    scan: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(256, self.d_model, dtype=self.dtype, name="embed")
        pos = self.param("pos", nn.initializers.normal(0.02), (self.context, self.d_model))
        x = embed(tokens) + pos[: tokens.shape[1]].astype(self.dtype)
        kw = dict(d_model=self.d_model, heads=self.heads, dtype=self.dtype,
                  dot_general_cls=self.dot_general_cls)
        if self.scan:
            x = scanned(Block, kw, self.layers, "blocks")(x)
        for i in range(0 if self.scan else self.layers):
            x = Block(**kw, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        return embed.attend(x)  # logits in the compute dtype


# --------------------------------------------------------------------------- ResNet


class ResBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and an identity (or 1x1 projection) skip."""

    features: int
    strides: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda name: nn.BatchNorm(  # noqa: E731
            use_running_average=not train, momentum=0.9, dtype=self.dtype, name=name)
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False, dtype=self.dtype,
                    name="conv1")(x)
        y = nn.relu(norm("bn1")(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False, dtype=self.dtype, name="conv2")(y)
        y = norm("bn2")(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False, dtype=self.dtype,
                        name="proj")(x)
            x = norm("bn_proj")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A small ResNet for 28x28 images: a stride-2 stem, one residual block per stage."""

    widths: tuple[int, ...] = (8, 16, 32)
    classes: int = 10
    dtype: jnp.dtype = jnp.float16

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = x.astype(self.dtype)
        # A stride-2 stem (14 x 14 after it) keeps a step cheap enough for 2 CPU cores.
        x = nn.Conv(self.widths[0], (3, 3), 2, use_bias=False, dtype=self.dtype,
                    name="stem")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype,
                                 name="bn_stem")(x))
        for i, w in enumerate(self.widths):
            x = ResBlock(w, 1 if i == 0 else 2, self.dtype, name=f"stage_{i}")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.classes, dtype=self.dtype, name="head")(x)


# ------------------------------------------------------------------------ deep MLP


class DeepMLP(nn.Module):
    """``depth`` x (Dense(width) + ``activation``), no normalisation, then Dense(classes).

    ``init_scheme="he"`` (He-normal hidden kernels) trains steadily with ReLU; ``"lecun"``
    (flax's default) shrinks the signal ~2^-8 over 16 ReLU layers, and some fp32 seeds do
    not learn at all. With ``activation="sigmoid"`` (derivative at most 1/4) the cotangent
    shrinks about 2 binades a layer, so the layers' gradient ranges spread wider than
    fp8's (and, deep enough, fp16's) range: :func:`sigmoid_mlp`.
    """

    depth: int = 16
    width: int = 256
    classes: int = 10
    dtype: jnp.dtype = jnp.float16
    init_scheme: str = "he"
    dot_general_cls: Any = None
    activation: str = "relu"
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        x = x.astype(self.dtype)
        inits = {"he": nn.initializers.he_normal, "lecun": nn.initializers.lecun_normal}
        kinit = inits[self.init_scheme]()
        act = {"relu": nn.relu, "sigmoid": nn.sigmoid}[self.activation]
        first = 1 if self.scan else self.depth  # layers 1.. as one nn.scan ("layers")
        for _ in range(first):
            x = act(_dense(self.width, self.dtype, self.dot_general_cls, kernel_init=kinit)(x))
        if self.scan and self.depth > 1:
            kw = dict(width=self.width, dtype=self.dtype, dot_general_cls=self.dot_general_cls,
                      kernel_init=kinit, activation=self.activation)
            x = scanned(Activated, kw, self.depth - 1, "layers")(x)
        return _dense(self.classes, self.dtype, self.dot_general_cls,
                      name="head" if self.scan else None)(x)


class Activated(nn.Module):
    """``activation(Dense(width)(x))``: a layer of :class:`DeepMLP`'s scanned stack."""

    width: int
    dtype: jnp.dtype
    dot_general_cls: Any
    kernel_init: Any
    activation: str

    @nn.compact
    def __call__(self, x):
        act = {"relu": nn.relu, "sigmoid": nn.sigmoid}[self.activation]
        return act(_dense(self.width, self.dtype, self.dot_general_cls,
                          kernel_init=self.kernel_init)(x))


def sigmoid_mlp(dtype=jnp.float16, dot_general_cls=None, depth: int = 8,
                scan: bool = False) -> DeepMLP:
    """The ``fmnist-sigmoid`` model: ``depth`` x (Dense(128) + sigmoid), flax's default
    (LeCun-normal) initialisation, no normalisation; ``scan=True``: layers 1.. as one
    ``nn.scan``."""
    return DeepMLP(depth=depth, width=128, dtype=dtype, init_scheme="lecun",
                   dot_general_cls=dot_general_cls, activation="sigmoid", scan=scan)


def layer_kernels(params) -> list:
    """The hidden layers' and the head's kernels of a :class:`DeepMLP`, in order, whether
    its layers are unrolled (``Dense_i``) or scanned (``layers``: one slice per layer)."""
    if "layers" not in params:
        return [params[f"Dense_{i}"]["kernel"] for i in range(len(params))]
    stacked = params["layers"]["layer"]["Dense_0"]["kernel"]
    return ([params["Dense_0"]["kernel"]] + [stacked[i] for i in range(stacked.shape[0])]
            + [params["head"]["kernel"]])


def stack_layers(params) -> dict:
    """An unrolled :class:`DeepMLP`'s parameters laid out for the same model with
    ``scan=True``: the same weights, layers 1.. stacked (its twin)."""
    n = len(params) - 1  # Dense_0 .. Dense_{n-1}, then the head Dense_n
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a),
                                     *[params[f"Dense_{i}"] for i in range(1, n)])
    return {"Dense_0": params["Dense_0"], "layers": {"layer": {"Dense_0": stacked}},
            "head": params[f"Dense_{n}"]}
