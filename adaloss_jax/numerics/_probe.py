"""Probes: one step run in fp32 and as trained, compared tensor by tensor.

A probe differentiates the same loss, with the same weights and batch, twice: once
with the model computing in fp32 (the reference) and once as trained (low precision,
loss multiplied by the scale in use). It compares every parameter gradient and every
module output's cotangent with :func:`tensor_stats` and returns plain rows.

The cotangent of a module's output is reached without changing the model: each
selected module's output gets a zero "perturbation" input added (keyed by module path,
shapes found by a first ``jax.eval_shape`` pass), and the gradient with respect to the
zeros is the output's cotangent, in the dtype the model computes in.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from adaloss_jax import _formats, _lookup, _tree, _validation
from adaloss_jax._state import AdaptiveScaleState
from adaloss_jax.numerics import _taps
from adaloss_jax.numerics._stats import tensor_stats
from adaloss_jax.numerics._table import ProbeRow

if TYPE_CHECKING:  # flax is needed only by the linen and NNX probes, imported there
    import flax.linen as nn
    from flax import nnx


class ProbeGrads(NamedTuple):
    """Gradients of one step as a probe compares them.

    Attributes:
      params: parameter gradients as stored (multiplied by their scales), a pytree.
      cotangents: module-output cotangents as stored, ``{key: array}``.
      param_scales: the scale each parameter gradient carries: a scalar for one global
        scale, or a pytree like ``params`` (per-layer scaling).
      cotangent_scales: a scalar, or a dict like ``cotangents``.

    >>> ProbeGrads({"w": jnp.ones(2)}, {}, 4.0).param_scales
    4.0
    """

    params: Any
    cotangents: dict[str, jax.Array]
    param_scales: Any = 1.0
    cotangent_scales: Any = 1.0


# Produces ProbeGrads from the probe's call arguments (see make_probe).
GradsFn = Callable[..., ProbeGrads]


def loss_scale_of(scale: Any) -> jax.Array:
    """The global loss scale as an fp32 scalar, from any of the ways it is held.

    Args:
      scale: ``None`` (no scaling: 1), a positive Python number, a scalar array, a
        :class:`~adaloss_jax.LossScaleState`, or an optimizer state holding exactly
        one (``alj.loss_scaled(...)``'s state, a ``TrainState.opt_state``, the state
        of a one-group adaptive scaler, ``alj.adaptive()``).

    Returns:
      An fp32 scalar.

    Raises:
      TypeError: for anything else than a scale, a scaler state or an optimizer state
        holding one, and for the state of an adaptive scaler with several groups (each
        has a scale of its own), naming what it got.
      ValueError: for an array that is not a scalar number.

    >>> float(loss_scale_of(2.0**10))
    1024.0
    """
    if scale is None:
        return jnp.asarray(1.0, jnp.float32)
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return jnp.asarray(_validation.check_positive_finite("scale", scale), jnp.float32)
    if isinstance(scale, jax.Array | np.ndarray | np.generic):
        if np.ndim(scale) != 0 or not jnp.issubdtype(scale.dtype, jnp.number):
            raise ValueError(
                f"scale must be a scalar number, got an array of shape {np.shape(scale)} and "
                f"dtype {scale.dtype}; pass the global loss scale, e.g. scale=2.0**15"
            )
        return jnp.asarray(scale, jnp.float32)
    try:
        state = _lookup.scale_state(scale)
    except ValueError as e:
        raise TypeError(
            f"scale must be a number, a scalar array, a LossScaleState or an optimizer "
            f"state holding one, got {type(scale).__name__}; ({e})"
        ) from e
    if isinstance(state, AdaptiveScaleState) and len(state.groups) > 1:
        raise TypeError(
            "scale is the state of an adaptive scaler whose groups each have their own "
            "scale; measure them with adaloss_jax.diagnostics.scale_table(opt_state), or pass one "
            "number, e.g. scale=state.loss_scale for the root's")
    return state.loss_scale


def _scales_like(scales: Any, names: list[str], treedef, what: str) -> list[Any]:
    if not isinstance(scales, dict | list | tuple) and np.ndim(scales) == 0:
        return [scales] * len(names)
    leaves, tdef = jax.tree_util.tree_flatten(scales)
    if tdef != treedef:
        raise ValueError(
            f"{what} must be a scalar or a pytree like the gradients it scales; got "
            f"structure {tdef}, expected {treedef}"
        )
    return leaves


def _named_leaves(tree: Any) -> tuple[list[str], list[jax.Array], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [_tree.name(_tree.path_of(kp)) for kp, _ in flat]
    return names, [x for _, x in flat], treedef


def compare(ref: ProbeGrads, low: ProbeGrads, fmt: Any = "float16") -> dict[str, Any]:
    """Statistics of every tensor of ``low`` against ``ref`` (jit-able).

    Args:
      ref: the fp32 reference run (scale 1).
      low: the low-precision run, with the scales it used.
      fmt: the format the statistics refer to.

    Returns:
      ``{"param": {name: stats}, "cotangent": {key: stats}}`` with ``stats`` as from
      :func:`tensor_stats`.

    Raises:
      ValueError: when the two runs differ in structure or in the modules they tapped.

    >>> ref = ProbeGrads({"w": jnp.array([1e-9, 1.0])}, {})
    >>> low = ProbeGrads({"w": jnp.array([0.0, 4.0], jnp.float16)}, {}, 4.0)
    >>> float(compare(ref, low)["param"]["w"]["underflow_rate"])
    0.5
    """
    fmt = _formats.float_format(fmt, argname="fmt")
    out: dict[str, Any] = {"param": {}, "cotangent": {}}
    r_names, r_leaves, r_def = _named_leaves(ref.params)
    l_names, l_leaves, l_def = _named_leaves(low.params)
    if r_def != l_def:
        raise ValueError(
            f"the reference and low-precision parameter gradients differ in structure: "
            f"{r_def} vs {l_def}"
        )
    r_scales = _scales_like(ref.param_scales, r_names, r_def, "param_scales")
    l_scales = _scales_like(low.param_scales, l_names, l_def, "param_scales")
    for name, r, lo, rs, ls in zip(l_names, r_leaves, l_leaves, r_scales, l_scales,
                                   strict=True):
        out["param"][name] = tensor_stats(r.astype(jnp.float32) / rs, lo, ls, fmt)
    if set(ref.cotangents) != set(low.cotangents):
        raise ValueError(
            f"the reference and low-precision runs tapped different module outputs: "
            f"only in the reference {sorted(set(ref.cotangents) - set(low.cotangents))}, "
            f"only in the low-precision run {sorted(set(low.cotangents) - set(ref.cotangents))}"
        )
    keys = sorted(low.cotangents)
    c_def = jax.tree_util.tree_structure({k: 0 for k in keys})
    rc = _scales_like(ref.cotangent_scales, keys, c_def, "cotangent_scales")
    lc = _scales_like(low.cotangent_scales, keys, c_def, "cotangent_scales")
    for k, rs, ls in zip(keys, rc, lc, strict=True):
        out["cotangent"][k] = tensor_stats(
            ref.cotangents[k].astype(jnp.float32) / rs, low.cotangents[k], ls, fmt
        )
    return out


def _signature(args: tuple) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves)


class Probe:
    """A compiled probe: ``probe(*args)`` returns a list of :class:`ProbeRow`.

    The comparison runs as one ``jax.jit`` (compiled on the first call for each input
    signature); nothing is donated and no argument is changed. ``probe.stats(*args)``
    returns the same numbers as device arrays (for use inside your own ``jit``).

    Attributes:
      fmt: the :class:`~adaloss_jax.formats.FloatFormat` the statistics refer to.

    >>> probe = make_probe(lambda x: ProbeGrads({"w": x}, {}),
    ...                    lambda x: ProbeGrads({"w": x.astype(jnp.float16)}, {}))
    >>> isinstance(probe, Probe), probe.fmt.name
    (True, 'float16')
    """

    def __init__(self, ref_fn: GradsFn, low_fn: GradsFn, fmt: Any,
                 prepare: Callable[..., tuple] | None = None):
        self.fmt = _formats.float_format(fmt, argname="fmt")
        self._ref_fn = ref_fn
        self._low_fn = low_fn
        self._prepare = prepare or (lambda *a: (None, a))
        self._meta: dict[Any, dict] = {}
        self._pending: Any = None
        self._jitted = jax.jit(self._stats, static_argnums=0)

    def _stats(self, static, *args):
        ref = self._ref_fn(static, *args)
        low = self._low_fn(static, *args)
        meta = {
            "param": dict(zip(_named_leaves(low.params)[0],
                              [(x.shape, str(x.dtype))
                               for x in jax.tree_util.tree_leaves(low.params)], strict=True)),
            "cotangent": {k: (v.shape, str(v.dtype)) for k, v in low.cotangents.items()},
        }
        self._meta[self._pending] = meta
        return compare(ref, low, self.fmt)

    def stats(self, *args) -> dict[str, Any]:
        """The statistics as device arrays (see :func:`compare`)."""
        static, dyn = self._prepare(*args)
        self._pending = (static, _signature(dyn))
        return self._jitted(static, *dyn)

    def __call__(self, *args) -> list[ProbeRow]:
        stats = jax.device_get(self.stats(*args))
        meta = self._meta[self._pending]
        rows = []
        for kind in ("param", "cotangent"):
            for name, s in stats[kind].items():
                shape, dtype = meta[kind][name]
                rows.append(ProbeRow(
                    kind=kind, name=name, shape=tuple(shape), dtype=dtype, fmt=self.fmt.name,
                    size=int(s["size"]), ref_nonzero=int(s["ref_nonzero"]),
                    flushed=int(s["flushed"]), underflow_rate=float(s["underflow_rate"]),
                    subnormal_share=float(s["subnormal_share"]),
                    overflow_count=int(s["overflow_count"]), rel_error=float(s["rel_error"]),
                    amax=float(s["amax"]), headroom=float(s["headroom"]),
                    scale=float(s["scale"]),
                ))
        return rows


def make_probe(ref_fn: GradsFn, low_fn: GradsFn, *, fmt: Any = "float16") -> Probe:
    """A probe from two gradient functions: the plug-in point for any scaling scheme.

    ``ref_fn(*args)`` and ``low_fn(*args)`` each return a :class:`ProbeGrads` for the
    same step: the fp32 reference (scale 1) and the low-precision run with the scales it
    used (scalars, or per-tensor pytrees for per-layer scaling). Both run under one
    ``jax.jit``.

    Args:
      ref_fn: the reference, ``(*args) -> ProbeGrads``.
      low_fn: the low-precision run, ``(*args) -> ProbeGrads``.
      fmt: the format the low-precision gradients are stored in.

    Returns:
      A :class:`Probe`: ``probe(*args) -> list[ProbeRow]``.

    >>> ref = lambda x: ProbeGrads({"w": x}, {})
    >>> low = lambda x: ProbeGrads({"w": (x * 4).astype(jnp.float16)}, {}, 4.0)
    >>> rows = make_probe(ref, low)(jnp.array([1e-9, 1.0]))
    >>> rows[0].underflow_rate, rows[0].scale, round(rows[0].headroom, 3)
    (0.5, 4.0, 13.999)
    """
    return Probe(lambda _, *a: ref_fn(*a), lambda _, *a: low_fn(*a), fmt)


def _check_params(params: Any, what: str) -> None:
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves:
        raise ValueError(
            f"{what} has no parameters (an empty pytree); a probe compares parameter "
            f"gradients: pass the model's parameters (e.g. variables['params'])"
        )
    for x in leaves:
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(
                f"{what} holds a leaf of dtype {jnp.result_type(x)}; every parameter must be "
                f"a floating-point array"
            )


def _fp32(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def _tapped_grads(run: Callable, params: Any, batch: Any, scale: Any,
                  expect_dtype: Any = None) -> ProbeGrads:
    """``run(params, leaf_tap) -> loss``; differentiates it w.r.t. params and output taps."""
    outs: dict[str, jax.Array] = {}

    def record(key, leaf):
        outs[key] = leaf
        return leaf

    def shape_pass(p):
        outs.clear()
        loss = run(p, record)
        return loss, dict(outs)

    try:
        loss_shape, shapes = jax.eval_shape(shape_pass, params)
    except Exception as e:  # noqa: BLE001 - re-raised with the batch's shapes
        batch_shapes = jax.tree_util.tree_map(lambda x: tuple(np.shape(x)), batch)
        raise ValueError(
            f"batch does not fit the model: running the loss on a batch of shapes "
            f"{batch_shapes} failed with {type(e).__name__}: {e}"
        ) from e
    if not hasattr(loss_shape, "shape") or loss_shape.shape != ():
        raise ValueError(
            f"loss_fn must return a scalar loss, got {loss_shape}; reduce it (e.g. mean) "
            f"inside loss_fn"
        )
    if expect_dtype is not None:
        wrong = {k: str(v.dtype) for k, v in shapes.items() if v.dtype != expect_dtype}
        if wrong:
            raise ValueError(
                f"the fp32 reference still computes these module outputs in other dtypes: "
                f"{wrong}; pass ref_model=... (the same model built with dtype=float32)"
            )
    perts = {k: jnp.zeros(v.shape, v.dtype) for k, v in shapes.items()}

    def scaled(p, z):
        loss = run(p, lambda key, leaf: leaf + z[key])
        return jnp.asarray(loss).astype(jnp.float32) * scale

    gp, gc = jax.grad(scaled, argnums=(0, 1))(params, perts)
    return ProbeGrads(gp, gc, scale, scale)


def linen_grads(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any, Any], jax.Array],
    *,
    filter: _taps.ModuleFilter | None = None,
    fp32_params: bool = False,
    expect_dtype: Any = None,
) -> Callable[[Any, Any, Any], ProbeGrads]:
    """``grads(params, batch, scale) -> ProbeGrads`` for a linen model under one loss scale.

    Differentiates ``loss_fn(model, params, batch) * scale`` (the loss in fp32) with
    respect to the parameters and to the output of every module ``__call__`` that
    ``filter(module_path, module)`` selects (all when None). Usable inside ``jit``; a
    building block for :func:`make_probe`.

    Args:
      model: the linen module ``loss_fn`` applies.
      loss_fn: ``(model, params, batch) -> scalar loss``; calls ``model.apply``.
      filter: which modules' outputs to tap.
      fp32_params: cast the parameters to fp32 first (for a reference run).
      expect_dtype: if set, every tapped output must have this dtype.

    Returns:
      ``grads(params, batch, scale=1.0) -> ProbeGrads``.

    >>> import flax.linen as nn
    >>> model = nn.Dense(2)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
    >>> g = linen_grads(model, lambda m, p, b: jnp.sum(m.apply({"params": p}, b)))(
    ...     params, jnp.ones((1, 3)))
    >>> sorted(g.cotangents)
    ['']
    """

    def grads(params, batch, scale=1.0):
        def run(p, leaf_tap):
            with _taps.taps(leaf_tap, filter):
                return loss_fn(model, p, batch)

        p = _fp32(params) if fp32_params else params
        return _tapped_grads(run, p, batch, jnp.asarray(scale, jnp.float32), expect_dtype)

    return grads


def _infer_fmt(dtypes: set, fmt: Any, what: str) -> _formats.FloatFormat:
    if fmt is not None:
        return _formats.float_format(fmt, argname="fmt")
    dtypes = {d for d in dtypes if d is not None}
    if len(dtypes) != 1:
        raise ValueError(
            f"fmt=None but {what} has compute dtypes {sorted(map(str, dtypes))}; pass the "
            f"format the gradients are computed in, e.g. fmt='float16'"
        )
    return _formats.float_format(dtypes.pop(), argname=f"{what}.dtype")


def linen_probe(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any, Any], jax.Array],
    *,
    fmt: Any = None,
    ref_model: nn.Module | None = None,
    filter: _taps.ModuleFilter | None = None,
) -> Probe:
    """A probe of a linen model: ``probe(params, batch, scale) -> list[ProbeRow]``.

    Per call::

        ref = grad of loss_fn(ref_model, fp32(params), batch)              # fp32, scale 1
        low = grad of fp32(loss_fn(model, params, batch)) * loss_scale_of(scale)
        rows = stats of low vs ref, per parameter leaf and per tapped module output

    ``scale`` is what the trained run used: a number, a scalar array, a
    ``LossScaleState`` or the optimizer state (``alj.scale_state`` finds it); omit it
    for no scaling. Parameters, optimizer and scaler states are only read.

    Args:
      model: the model as trained (e.g. ``dtype=jnp.float16``).
      loss_fn: ``(model, params, batch) -> scalar loss``, calling ``model.apply``;
        the same function serves the reference.
      fmt: format of the low-precision gradients; default ``model.dtype``.
      ref_model: the fp32 model; default ``model.clone(dtype=jnp.float32)``, which
        suffices when the model passes its ``dtype`` on to its submodules. Every tapped
        output of the reference must be fp32 (checked).
      filter: ``(module_path, module) -> bool`` selecting the modules whose output
        cotangents are reported; all modules when None.

    Returns:
      A :class:`Probe`: ``probe(params, batch, scale=None) -> list[ProbeRow]``.

    Raises:
      ValueError: no ``fmt`` and no usable ``model.dtype``; no ``ref_model`` and no
        ``dtype`` field to override; (on call) empty ``params``, a batch that does not
        fit, a non-scalar loss.
      TypeError: ``fmt`` is not a dtype.
      ValueError: ``fmt`` is not a supported format.

    >>> import flax.linen as nn
    >>> model = nn.Dense(3, dtype=jnp.float16)
    >>> params = model.init(jax.random.key(0), jnp.ones((2, 4)))["params"]
    >>> loss = lambda m, p, b: jnp.mean(m.apply({"params": p}, b) ** 2)
    >>> rows = linen_probe(model, loss)(params, jnp.ones((2, 4)), 2.0**8)
    >>> [(r.kind, r.name) for r in rows]
    [('param', 'bias'), ('param', 'kernel'), ('cotangent', '')]
    """
    fmt = _infer_fmt({getattr(model, "dtype", None)}, fmt, "model")
    if ref_model is None:
        if "dtype" not in {f.name for f in getattr(model, "__dataclass_fields__", {}).values()}:
            raise ValueError(
                f"{type(model).__name__} has no dtype field to override for the fp32 "
                f"reference; pass ref_model=... (the same model computing in float32)"
            )
        ref_model = model.clone(dtype=jnp.float32)
    ref_grads = linen_grads(ref_model, loss_fn, filter=filter, fp32_params=True,
                            expect_dtype=jnp.float32)
    low_grads = linen_grads(model, loss_fn, filter=filter)

    def prepare(params, batch, scale=None):
        _check_params(params, "params")
        return None, (params, batch, loss_scale_of(scale))

    return Probe(
        lambda _, p, b, s: ref_grads(p, b, 1.0),
        lambda _, p, b, s: low_grads(p, b, s),
        fmt,
        prepare,
    )


def _nnx_fp32_graphdef(model: nnx.Module):
    from flax import nnx

    copy = nnx.clone(model)
    changed = False
    for _, sub in nnx.iter_graph(copy):
        if isinstance(sub, nnx.Module) and getattr(sub, "dtype", None) is not None:
            sub.dtype = jnp.float32
            changed = True
    if not changed:
        raise ValueError(
            f"{type(model).__name__} has no submodule with a dtype attribute to override for "
            f"the fp32 reference; pass ref_model=... (the same model computing in float32)"
        )
    return nnx.split(copy, nnx.Param, ...)[0]


def nnx_probe(
    model: nnx.Module,
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    *,
    fmt: Any = None,
    ref_model: nnx.Module | None = None,
    filter: _taps.ModuleFilter | None = None,
) -> Probe:
    """A probe of an NNX model: ``probe(model, batch, scale) -> list[ProbeRow]``.

    As :func:`linen_probe`, with ``loss_fn(model, batch) -> scalar loss``. The
    gradients are taken w.r.t. the model's ``nnx.Param`` state, on copies merged inside
    the jitted function: the live model (and any state ``loss_fn`` would update, such as
    batch statistics or RNG counts) is left as it was.

    Args:
      model: the model as trained; its structure fixes the probe (call with it or a
        model of the same structure).
      loss_fn: ``(model, batch) -> scalar loss``.
      fmt: format of the low-precision gradients; default: the one ``dtype`` its
        submodules share.
      ref_model: a model of the same structure computing in fp32 (only its structure
        and dtypes are used, the weights come from the probed model); default: a clone
        with every submodule's ``dtype`` attribute set to float32.
      filter: ``(module_path, module) -> bool`` selecting the tapped modules.

    Returns:
      A :class:`Probe`: ``probe(model, batch, scale=None) -> list[ProbeRow]``.

    >>> from flax import nnx
    >>> model = nnx.Linear(4, 3, dtype=jnp.float16, rngs=nnx.Rngs(0))
    >>> rows = nnx_probe(model, lambda m, b: jnp.mean(m(b) ** 2))(model, jnp.ones((2, 4)))
    >>> sorted({r.kind for r in rows})
    ['cotangent', 'param']
    """
    from flax import nnx

    dtypes = {getattr(sub, "dtype", None) for _, sub in nnx.iter_graph(model)
              if isinstance(sub, nnx.Module)}
    fmt = _infer_fmt(dtypes, fmt, "model")
    if ref_model is None:
        ref_def = _nnx_fp32_graphdef(model)
    else:
        ref_def = nnx.split(ref_model, nnx.Param, ...)[0]

    def grads_fn(which, expect_dtype=None, fp32_params=False):
        def grads(static, params, rest, batch, scale):
            graphdef = static[which]

            def run(p, leaf_tap):
                m = nnx.merge(graphdef, p, rest)
                with _taps.nnx_taps(m, leaf_tap, filter):
                    return loss_fn(m, batch)

            p = _fp32(params) if fp32_params else params
            return _tapped_grads(run, p, batch, scale, expect_dtype)
        return grads

    ref_grads = grads_fn(1, jnp.float32, True)
    low_grads = grads_fn(0)

    def prepare(m, batch, scale=None):
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)
        _check_params(params, "model")
        return (graphdef, ref_def), (params, rest, batch, loss_scale_of(scale))

    return Probe(
        lambda st, p, r, b, s: ref_grads(st, p, r, b, jnp.float32(1.0)),
        low_grads,
        fmt,
        prepare,
    )
