"""The fp8 recipes fp8 users pick today, as dense-layer dot products for ``nn.Dense``'s
``dot_general_cls`` (qwix: as a wrapper of the whole model): the bench's fp8 peers.

* ``delayed``: flax's ``Fp8DirectDotGeneralOp`` (what flax recommends; its
  ``Fp8DotGeneralOp`` is deprecated): e4m3 inputs and kernels, e5m2 output gradients,
  each tensor scaled by a scale set from a 1024-step history of its past amaxes.
* ``current``: per-tensor *current* scaling, as TransformerEngine's current-scaling
  recipe and torchao's tensorwise recipe do: each tensor is scaled from its own amax in
  the same step (``scale = fp8_max / amax``), e4m3 for the inputs and kernels, e5m2 for
  the output gradient, the product computed in fp32 from the rounded values.
* ``mxfp8``: MXFP8 as ``jax.nn.scaled_dot_general`` computes it with its default
  (``get_scaled_dot_general_config("mxfp8")``) configs, *simulated*: blocks of 32
  elements along the contraction, one power-of-two (e8m0) scale per block, rounded up so
  that the block's amax fits e4m3; e4m3 for the inputs, the kernels and the output
  gradients alike (:func:`mx_round`, :func:`mxfp8_dot`).
* ``qwix``: Google's qwix quantized training with MaxText's ``fp8_full`` rule, applied to
  the whole model by ``qwix.quantize_model``, not as a ``dot_general_cls``
  (:func:`qwix_model`): e4m3 inputs (one absmax scale per row) and kernels (one per
  output channel), e5m2 output gradients (per row for the input gradient, per output
  channel for the kernel gradient, after taking on the other operand's forward scales),
  the scales from this step's values (qwix sets a scale below ``sqrt(finfo.tiny)``,
  about 1e-19, to 1: gradients that small flush); the backward products reuse the
  forward pass's e4m3 operands.

All run with the model in bfloat16 and no loss scaling. On a CPU the fp8 values are
simulated by casts (:func:`adaloss_jax._formats.round_to`); the numbers are fp8's, the
speed is not.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from adaloss_jax import _formats

# flax keeps Fp8DirectDotGeneralOp's scales and amax histories in this collection; their
# "gradients" are their next values.
FP8_STATE = fp8_ops.OVERWRITE_WITH_GRADIENT
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def current_round(x: jax.Array, fmt) -> jax.Array:
    """``x`` (as fp32) scaled by ``fp8_max / amax(x)``, rounded to ``fmt`` and unscaled:
    a tensor stored in fp8 with a per-tensor scale from its own amax."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x))
    scale = jnp.where(amax > 0, float(jnp.finfo(fmt).max) / amax, 1.0)
    return _formats.round_to(x * scale, fmt) / scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def current_fp8_dot(x, kernel, dimension_numbers):
    """``lax.dot_general`` of e4m3 ``x`` and ``kernel``, its output gradient rounded to
    e5m2, all three scaled from their own amax in this step."""
    return _fwd(x, kernel, dimension_numbers)[0]


def _fwd(x, kernel, dimension_numbers):
    qx, qk = current_round(x, E4M3), current_round(kernel, E4M3)
    out = jax.lax.dot_general(qx, qk, dimension_numbers)
    like = (jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype))  # the operands' dtypes
    return out.astype(x.dtype), (qx, qk, like)


def _bwd(dimension_numbers, res, g):
    qx, qk, (x_like, k_like) = res
    _, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), qx, qk)
    dx, dk = vjp(current_round(g, E5M2))
    return dx.astype(x_like.dtype), dk.astype(k_like.dtype)


current_fp8_dot.defvjp(_fwd, _bwd)


class CurrentFp8Dot(nn.Module):
    """Per-tensor current fp8 scaling as an ``nn.Dense`` ``dot_general_cls``."""

    @nn.compact
    def __call__(self, x, kernel, dimension_numbers, precision=None,
                 preferred_element_type=None):
        del precision, preferred_element_type
        return current_fp8_dot(x, kernel, dimension_numbers)


# -------------------------------------------------------------------------------- MXFP8

MX_BLOCK = 32
"""Elements per MXFP8 block, along the contraction (OCP MX; the ``block_size`` of
``jax.nn.get_scaled_dot_general_config("mxfp8")``)."""
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448


def mx_exponent(amax: jax.Array) -> jax.Array:
    """The exponent ``k`` of the e8m0 scale ``2**k`` of a block of largest magnitude
    ``amax``: the smallest with ``amax / 2**k <= 448`` (e4m3's max), i.e. ``ceil(log2(amax
    / 448))``, the amax's scale rounded *up* to a power of two as jax's
    ``cast_to_e8m0_with_rounding_up`` does it, so the block's largest value is never
    clipped (it lands in [224, 448]). Within [-126, 127]: e8m0 reaches 2**-127, but the
    CPU flushes fp32 subnormals; a block of zeros gets -126 (it stays zero at any scale).
    """
    amax = jnp.asarray(amax, jnp.float32)
    k = jnp.ceil(jnp.log2(amax / E4M3_MAX))
    k = jnp.clip(jnp.where(jnp.isfinite(k), k, -126.0), -126.0, 127.0)
    # log2 may be off by an ulp: one step either way, decided by exact comparisons.
    k = jnp.where(amax > E4M3_MAX * _formats.pow2(k), k + 1, k)
    k = jnp.where((k > -126) & (amax <= E4M3_MAX * _formats.pow2(k - 1)), k - 1, k)
    return jnp.clip(k, -126.0, 127.0)


def mx_round(x: jax.Array, axes, fmt=E4M3, block: int = MX_BLOCK) -> jax.Array:
    """``x`` (as fp32) stored in MXFP8 and read back: its ``axes`` flattened, in order,
    into one contraction axis (as ``scaled_dot_general`` normalises an operand to
    ``(batch, rows, K)``), cut into blocks of ``block`` consecutive elements along it,
    each block scaled by its own ``2**-mx_exponent(amax of the block)``, rounded to
    ``fmt`` and unscaled. A length that is not a multiple of ``block`` ends in a shorter
    block (as zero padding would; jax's ``scaled_dot_general`` refuses such a length, a
    kernel pads it)."""
    x = _exact(x, x.dtype)
    axes = sorted(a % x.ndim for a in axes)
    rest = [a for a in range(x.ndim) if a not in axes]
    t = jnp.transpose(x, rest + axes)
    lead, n = t.shape[:len(rest)], math.prod(t.shape[len(rest):])
    pad = -n % block
    b = jnp.pad(t.reshape(*lead, n), [(0, 0)] * len(lead) + [(0, pad)])
    b = b.reshape(*lead, (n + pad) // block, block)
    scale = _formats.pow2(mx_exponent(jnp.max(jnp.abs(b), axis=-1, keepdims=True)))
    fmax = float(jnp.finfo(fmt).max)
    q = _formats.round_to(jnp.clip(b / scale, -fmax, fmax), fmt) * scale
    q = q.reshape(*lead, n + pad)[..., :n].reshape(t.shape)
    return jnp.transpose(q, [rest.index(a) if a in rest else len(rest) + axes.index(a)
                             for a in range(x.ndim)])


def _exact(x: jax.Array, dtype) -> jax.Array:
    """``x`` in fp32, rounded to ``dtype`` (bf16: the model's) even where XLA computes
    the ``dtype`` ops around it in fp32 and drops the rounding (its "excess
    precision"): so a tensor is quantized from its stored value, and a compiled step
    gives the same numbers whatever the fusions (a stack in ``nn.scan`` as unrolled)."""
    x = x.astype(jnp.float32)
    fi = jnp.finfo(dtype)
    if fi.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def _kept(ndim: int, contract, batch) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a not in contract and a not in batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mxfp8_dot(x, kernel, dimension_numbers):
    """``lax.dot_general`` as ``jax.nn.scaled_dot_general`` computes it with its default
    MXFP8 configs (``[get_scaled_dot_general_config("mxfp8")] * 3``), **simulated** by
    fake quantisation: each operand rounded to e4m3 in blocks of 32 along its
    contraction axes at a power-of-two scale per block (:func:`mx_round`), then an fp32
    ``dot_general`` of the rounded values (on the GPU jax runs cuDNN's block-scaled
    matmul, which has no CPU lowering). The backward pass does as jax's: the operands
    kept unquantised from the forward pass and each gradient product re-quantised along
    *its* contraction: ``dx = g . kernel`` with ``g`` and the kernel in blocks along the
    output features, ``dkernel = x . g`` with ``x`` and ``g`` in blocks along the rows
    (batch and sequence flattened); the output gradient ``g`` in e4m3 too (the third
    config, the gradients', is the same MXFP8 e4m3 config). The result in ``x``'s dtype,
    the gradients in the operands'."""
    return _mx_fwd(x, kernel, dimension_numbers)[0]


def _mx_fwd(x, kernel, dimension_numbers):
    (xc, kc), _ = dimension_numbers
    out = jax.lax.dot_general(mx_round(x, xc), mx_round(kernel, kc), dimension_numbers)
    return _exact(out, x.dtype).astype(x.dtype), (x, kernel)


def _mx_bwd(dimension_numbers, res, g):
    x, kernel = res
    (xc, kc), (xb, kb) = dimension_numbers
    x_kept, k_kept = _kept(x.ndim, xc, xb), _kept(kernel.ndim, kc, kb)
    # g's axes: the batch axes, then x's kept axes, then the kernel's.
    g_rows = tuple(range(len(xb), len(xb) + len(x_kept)))
    g_cols = tuple(range(len(xb) + len(x_kept), g.ndim))
    qk = mx_round(kernel, k_kept)  # blocks along dx's contraction (the output features)
    _, dx_of = jax.vjp(lambda a: jax.lax.dot_general(a, qk, dimension_numbers),
                       x.astype(jnp.float32))
    qx = mx_round(x, x_kept)  # blocks along dkernel's contraction (the rows)
    _, dk_of = jax.vjp(lambda b: jax.lax.dot_general(qx, b, dimension_numbers),
                       kernel.astype(jnp.float32))
    (dx,), (dk,) = dx_of(mx_round(g, g_cols)), dk_of(mx_round(g, g_rows))
    return (_exact(dx, x.dtype).astype(x.dtype),
            _exact(dk, kernel.dtype).astype(kernel.dtype))


mxfp8_dot.defvjp(_mx_fwd, _mx_bwd)


class Mxfp8Dot(nn.Module):
    """Simulated MXFP8 (:func:`mxfp8_dot`) as an ``nn.Dense`` ``dot_general_cls``."""

    @nn.compact
    def __call__(self, x, kernel, dimension_numbers, precision=None,
                 preferred_element_type=None):
        del precision, preferred_element_type
        return mxfp8_dot(x, kernel, dimension_numbers)


DOT_CLASSES = {"delayed": fp8_ops.Fp8DirectDotGeneralOp, "current": CurrentFp8Dot,
               "mxfp8": Mxfp8Dot}

# --------------------------------------------------------------------------------- qwix

QWIX_MISSING = ("the fp8-qwix configuration needs Google's qwix, which is not installed: "
                "pip install qwix (or pip install 'adaloss_jax[bench]')")


def _qwix():
    """The qwix module, imported on first use (only fp8-qwix needs it)."""
    try:
        import qwix
    except ImportError as e:
        raise ImportError(QWIX_MISSING) from e
    return qwix


def qwix_missing() -> str | None:
    """``None`` when qwix imports, else the message saying how to install it."""
    try:
        _qwix()
    except ImportError as e:
        return str(e)
    return None


def qwix_rules() -> list:
    """MaxText's ``fp8_full`` rule (``get_quantization_rule``): e4m3 weights and
    activations, e5m2 gradients, absmax calibration, every ``dot_general``; ahead of it a
    rule that leaves the embedding alone (its ``attend``, the GPT's tied output head, is
    no ``nn.Dense``: the other fp8 rows keep it in bf16, and MaxText's rule, on
    ``decoder/.*layers.*``, leaves its embedding and logits out too)."""
    qwix = _qwix()
    return [
        qwix.QtRule(module_path=r"(.*/)?embed"),  # no qtype: a plain dot_general
        qwix.QtRule(module_path=".*", weight_qtype=E4M3, act_qtype=E4M3, bwd_qtype=E5M2,
                    op_names=("dot_general",)),
    ]


def _dense_provider(qwix):
    """``qwix.QtProvider(qwix_rules())``, told that the left operand of a dense layer's
    ``dot_general`` (its input) is no weight. qwix 0.1.8 tells a weight from an
    activation by tracing the operand back to a parameter of the module, and failing
    that by its shape: a batch of 128 entering a 128-wide layer (fmnist-sigmoid's
    layers 1-7) has its kernel's shape (128, 128), so qwix takes it for a second weight
    and stops ("lhs and rhs cannot be both weights"). Under fp8_full's rule a weight and
    an activation are quantized alike (e4m3, absmax, the same channelwise axes, no
    static scale, no tiling), so the numbers are qwix's either way."""

    class DenseQtProvider(qwix.QtProvider):
        def _create_dot_general_qt_config(self, rule, op_id, lhs, rhs):
            # qwix reads lhs only to ask whether it is a parameter: a shape no parameter
            # has says no.
            return super()._create_dot_general_qt_config(
                rule, op_id, jax.ShapeDtypeStruct((0,), lhs.dtype), rhs)

    return DenseQtProvider(qwix_rules())


def qwix_model(model: nn.Module) -> nn.Module:
    """``model`` under qwix's quantised training, as a user applies it:
    ``qwix.quantize_model(model, provider)`` with a ``QtProvider`` of
    :func:`qwix_rules` (:func:`_dense_provider`: one that does not take an input for a
    weight). qwix intercepts every ``jax.lax.dot_general`` the model's ``__call__``
    makes (an ``nn.Dense`` without ``dot_general_cls`` makes one), also inside
    ``nn.scan``."""
    qwix = _qwix()
    return qwix.quantize_model(model, _dense_provider(qwix))


def peer_model(make, dtype, recipe: str | None):
    """``make(dtype, dot_general_cls)`` (a task's model) under the fp8 ``recipe``
    (``None``: as it is): the recipe's ``dot_general_cls`` in every ``nn.Dense``, or,
    for ``"qwix"``, the plain model quantised by qwix."""
    if recipe == "qwix":
        return qwix_model(make(dtype, None))
    return make(dtype, DOT_CLASSES[recipe] if recipe is not None else None)
