"""Scale points: the ``custom_vjp`` identities that convert and measure cotangents.

Front ends (linen, NNX, pure JAX via :func:`scale_group`) only say where a call of a
scale group starts and ends by calling :meth:`Points.wrap`; this module puts a point on
the call's floating inputs and one on its outputs. While recording, a point is a named
identity that :mod:`adaloss_jax._stream` finds in the traced program; when applying, it
is a ``custom_vjp`` identity whose backward pass multiplies each cotangent by the ratio
of the scales of its two sides and returns the cotangent's statistics as the cotangent
of a zero "dummy" input, one dummy per point, so that ``jax.grad`` hands them out with
no side effects.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from adaloss_jax import _formats, _stream

ROOT = _stream.ROOT

# Statistics row of one scale point (all measured where the cotangent arrives, at the
# scale of the region on its consumer side): the magnitude maximum and whether the
# cotangent, or its conversion, exceeded the format. A point inside a loop or a vmap
# writes its dummy once per pass and autodiff sums the writes, so there AMAX is a sum of
# maxima (conservative: at most log2(passes) binades above the max) and a flag counts
# the passes that exceeded. statistic="gaussian" appends the sum of squares and the
# element count (summed over passes alike).
_AMAX, _BAD_Y, _BAD_X, _SUMSQ, _COUNT = range(5)
# statistic="quantile" appends a histogram of the cotangents' binades (counts of non-zero
# elements by floor(log2|x|)): _NBINS bins starting _HIST_BELOW binades below the
# format's smallest subnormal (the lowest bin also counts everything below it, the
# highest everything above).
_NBINS = 56
_HIST_BELOW = 16


def pow2(n) -> jax.Array:
    """``2.0 ** n`` in fp32, exactly, for integer-valued ``n`` (``jnp.exp2`` is not exact on
    CPU); inf above 2**127 and 0 below 2**-126 (as jitted ``jnp.ldexp`` on CPU, which
    flushes fp32 subnormals).

    Written as the exponent bits (4 scalar ops, against ~50 for ``jnp.ldexp``): every
    converting scale point calls it.
    """
    n = jax.lax.clamp(-127.0, jnp.asarray(n, jnp.float32), 128.0).astype(jnp.int32)
    # Biased exponent n + 127 and a zero mantissa; n = -127 gives 0.0 and n = 128 inf.
    return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def hist_start(sumsq: bool) -> int:
    """Column of a statistics row where the histogram starts."""
    return _COUNT + 1 if sumsq else _BAD_X + 1


def width(sumsq: bool, quantile: bool) -> int:
    """Columns of a statistics row."""
    return hist_start(sumsq) + (_NBINS if quantile else 0)


class PointConfig(NamedTuple):
    """Static configuration of a scale point (hashable: a custom_vjp nondiff argument)."""

    convert: bool  # False when both sides have the same scale by construction
    measure: bool  # False for parameter conversions (the optimizer measures gradients)
    sumsq: bool  # whether the statistic needs the sum of squares (the gaussian rule)
    y_max: float  # largest finite value where the cotangent arrives (its storage format)
    x_max: float  # the same after the conversion (the simulated format where it rounds)
    simulate: Any = None  # a dtype to round converted cotangents to (fp8 simulation)
    hist_lo: int | None = None  # binade of the histogram's lowest bin; None: no histogram


def _binade_hist(cts: tuple[jax.Array, ...], lo: int) -> jax.Array:
    """Counts of the non-zero elements of the cotangents by ``floor(log2|x|)``, in
    ``_NBINS`` bins from binade ``lo`` (clipped at both ends), as fp32.

    The binade is read from the fp32 exponent bits (exact for every fp16/fp8 value,
    subnormals included), so nothing is multiplied; a scatter-add into the bins is far
    cheaper than comparing every element with every bin.
    """
    hist = jnp.zeros((_NBINS,), jnp.int32)
    for ct in cts:
        bits = jax.lax.bitcast_convert_type(ct.astype(jnp.float32), jnp.int32)
        binade = ((bits >> 23) & 0xFF) - 127
        idx = jnp.clip(binade - lo, 0, _NBINS - 1).reshape(-1)
        hist = hist.at[idx].add((ct != 0).reshape(-1).astype(jnp.int32))
    return hist.astype(jnp.float32)


def _stats(cts: tuple[jax.Array, ...], ratio, cfg: PointConfig) -> jax.Array:
    """The statistics row of the arriving cotangents ``cts``.

    The magnitude maximum is ``max(max(ct), -min(ct))``: two reductions straight over
    the cotangent, with no elementwise op in front of them. XLA's CPU backend does not
    fuse an elementwise producer into a reduction, so ``max(|ct|)`` (or a mask of the
    non-finite elements) materialised a temporary the size of the cotangent at every
    point: extra memory and an extra write and read. Infinities always reach the two
    reductions. A NaN may reach ``amax`` as it is (:func:`adaloss_jax._adaptive._combine`
    reads it as inf, once for all rows) or be dropped by XLA's CPU reductions (its large
    fp32 max does): such a NaN came from an inf earlier in the backward pass, which a
    point upstream saw, and it reaches the parameter gradients, whose finiteness
    :func:`adaloss_jax.adaptive_unscale` checks element by element (the skip decision
    never rests on these rows alone). ``bad_y``/``bad_x`` say whether the value, or its
    conversion by ``ratio``, exceeded the format (NaN included: the comparisons are
    negated; the power-of-two product is exact in fp32).

    Each op here is repeated at every point of the program, so nothing is computed that
    is the same for every point (the row's constants) or known at trace time (``bad_x``
    is ``bad_y`` where nothing converts or rounds).
    """
    amax = None
    sumsq = jnp.zeros((), jnp.float32)
    for ct in cts:
        if ct.size == 0:
            continue
        a = jnp.maximum(jnp.max(ct).astype(jnp.float32), -jnp.min(ct).astype(jnp.float32))
        amax = a if amax is None else jnp.maximum(amax, a)
        if cfg.sumsq:
            c = ct.astype(jnp.float32)
            sumsq = sumsq + jnp.sum(c * c)
    if amax is None:
        amax = jnp.zeros((), jnp.float32)
    bad_y = jnp.logical_not(amax <= cfg.y_max)
    if cfg.convert or cfg.x_max != cfg.y_max:
        bad_x = jnp.logical_not(amax * ratio <= cfg.x_max)
    else:
        bad_x = bad_y
    cols = [amax, bad_y.astype(jnp.float32), bad_x.astype(jnp.float32)]
    if cfg.sumsq:
        cols += [sumsq, jnp.float32(sum(ct.size for ct in cts))]
    parts = [jnp.stack(cols)]
    if cfg.hist_lo is not None:
        parts.append(_binade_hist(cts, cfg.hist_lo))
    return jnp.concatenate(parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scale_point(cfg: PointConfig, xs: tuple, ratio: jax.Array, dummy: jax.Array):
    """Identity on ``xs``; backward multiplies the cotangents by ``ratio`` and returns
    their statistics as ``dummy``'s cotangent."""
    del ratio, dummy
    return xs


def _scale_point_fwd(cfg, xs, ratio, dummy):
    del dummy
    return xs, ratio


def _scale_point_bwd(cfg, ratio, cts):
    if cfg.convert:
        out = tuple((c.astype(jnp.float32) * ratio).astype(c.dtype) for c in cts)
    else:
        out = cts
    if cfg.simulate is not None:
        out = tuple(_formats.round_to(c, cfg.simulate) for c in out)
    if not cfg.measure:
        return out, jnp.zeros_like(ratio), None
    stats = _reduce_over_mapped_axes(_stats(cts, ratio, cfg), cts)
    return out, jnp.zeros_like(ratio), stats


_scale_point.defvjp(_scale_point_fwd, _scale_point_bwd)


def _varying_axes(x) -> set:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return set(mat.varying)
    return set(getattr(aval, "vma", ()) or ())  # earlier releases


def _reduce_over_mapped_axes(stats: jax.Array, cts: tuple) -> jax.Array:
    """Under ``shard_map`` the cotangents may vary over mapped axes while the dummy does
    not; a custom_vjp cotangent must have its input's type, so reduce the statistics over
    those axes here (amax by max, the rest by sum): they become global, as under SPMD
    jit."""
    axes = set()
    for c in cts:
        axes |= _varying_axes(c)
    if not axes:
        return stats
    axes = tuple(sorted(axes))
    amax = jax.lax.pmax(stats[_AMAX], axes)
    rest = jax.lax.psum(stats[_AMAX + 1:], axes)
    return jnp.concatenate([amax[None], rest])


def is_float(x) -> bool:
    return isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)


def _record_point(n: int):
    def ident(*xs):
        return xs

    ident.__name__ = f"{_stream.POINT_PREFIX}{n}"
    return jax.jit(ident)


def record_params(leaves: list) -> list:
    """The parameter point of a recording trace: one named identity over every
    floating parameter leaf (non-floating leaves pass as they are)."""
    idx = [i for i, x in enumerate(leaves) if is_float(x)]

    def ident(*xs):
        return xs

    ident.__name__ = _stream.PARAM_POINT
    out = list(leaves)
    for i, y in zip(idx, jax.jit(ident)(*(leaves[i] for i in idx))):
        out[i] = y
    return out


def param_owners_for(leaves: list, owners: list) -> list:
    """Owners of the floating leaves only (the order of the parameter point)."""
    return [o for x, o in zip(leaves, owners) if is_float(x)]


class Call(NamedTuple):
    """A recorded module call: its path and whether it is a scale group of its own."""

    path: tuple[str, ...]
    group: bool


_LOCAL = threading.local()


def key_name(k) -> str:
    """A pytree key as a path component (a dict key, an attribute or an index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


class Receiver:
    """What the module calls a front end reports run through, while it is active (a
    context manager): the scale points of an adaptive gradient, or a numerics probe's
    taps. Receivers nest; every active one sees every call, the outermost first.

    ``leaf_paths`` (``{id(leaf): path}``) names the parameter leaves the loss was given,
    so that a front end can tell where a sub-tree of them sits (:func:`subtree_prefix`).
    """

    leaf_paths: dict = {}

    def given(self, leaves, paths) -> None:
        """Names the parameter leaves the loss is given (``paths``: their key paths)."""
        self.leaf_paths = {id(x): p for x, p in zip(leaves, paths)}

    def __enter__(self):
        stack = getattr(_LOCAL, "stack", None)
        if stack is None:
            stack = _LOCAL.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _LOCAL.stack.remove(self)

    def wrap(self, path: tuple[str, ...], module, next_fun, args, kwargs):
        """Runs ``next_fun(*args, **kwargs)`` as a call of the module at ``path``."""
        raise NotImplementedError


def subtree_prefix(tree) -> tuple[str, ...] | None:
    """Where ``tree``, parameters a model was applied to, sits in the parameters the
    loss was given (``params["student"]`` -> ``("student",)``, the whole tree -> ``()``),
    found by the identity of its leaves (:attr:`Receiver.leaf_paths`). None where no
    leaf is one of them (parameters transformed before the call) or the paths disagree.
    """
    stack = getattr(_LOCAL, "stack", None) or ()
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for r in reversed(stack):
        for keys, x in flat:
            full = r.leaf_paths.get(id(x))
            if full is None:
                continue
            rel = tuple(key_name(k) for k in keys)
            n = len(full) - len(rel)
            return full[:n] if n >= 0 and full[n:] == rel else None
    return None


def active() -> Receiver | None:
    """The innermost active receiver, or None (front ends then change nothing)."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def report(path: tuple[str, ...], module, fn: Callable, args, kwargs):
    """Runs ``fn(*args, **kwargs)`` as a call of the scale group or module at ``path``
    (``()`` is the root): the one entry point of every front end (linen's method
    interceptor, the object-style class swap, :func:`scale_group`). A method calling
    another method of the same module is one call."""
    stack = list(getattr(_LOCAL, "stack", None) or ())
    inside = getattr(_LOCAL, "paths", None)
    if inside is None:
        inside = _LOCAL.paths = []
    if not stack or (inside and inside[-1] == path):
        return fn(*args, **kwargs)

    def run(i, a, k):
        if i == len(stack):
            return fn(*a, **k)
        return stack[i].wrap(path, module, lambda *a2, **k2: run(i + 1, a2, k2), a, k)

    inside.append(path)
    try:
        return run(0, args, kwargs)
    finally:
        inside.pop()


class Points(Receiver):
    """Puts scale points around the calls a front end reports (trace time).

    ``plan=None`` records: every point is a named identity, numbered in call order.
    With a plan, point ``n`` converts and measures as the plan says; ``ratios`` maps
    ``(x anchors, y anchors)`` to the ratio of their scales and ``dummies`` is filled
    with one statistics dummy per (point, anchors pair), listed in ``rows``.
    """

    def __init__(self, cfg: PointConfig, selects: Callable, plan=None, ratios=None,
                 simulate=None, dummies=None):
        self.cfg = cfg
        self.selects = selects  # (path, module) -> "group" | "measure" | None
        self.plan = plan
        self.ratios = ratios
        self.simulate = simulate
        self.count = 0
        self.reported = 0  # module calls reported, selected or not
        self.calls: list[Call] = []
        self.stack: list[tuple[str, ...]] = []
        self.dummies = list(dummies or [])  # consumed in order, one per row
        self.limits: list[tuple[float, float]] = []  # (y_max, x_max) of each row
        self.used = 0
        self.sizes: list[int] = []  # recording: floating leaves of each point
        self.rounding: set[int] = set()  # recording: the points that round when simulating
        self.dtypes: set = set()

    def wrap(self, path: tuple[str, ...], module, next_fun, args, kwargs):
        self.reported += 1
        kind = self.selects(path, module)
        if kind is None:
            return next_fun(*args, **kwargs)
        self.calls.append(Call(path, kind == "group"))
        args, kwargs = self._point((args, kwargs), simulate=False)
        self.stack.append(path)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            self.stack.pop()
        for x in jax.tree_util.tree_leaves(out):
            if is_float(x):
                self.dtypes.add(jnp.dtype(x.dtype))
        return self._point(out, simulate=kind == "group")

    def _point(self, tree, simulate: bool):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        # Parameter values pass points unconverted (convert_params handles them).
        idx = [i for i, x in enumerate(leaves) if is_float(x) and id(x) not in self.leaf_paths]
        if not idx:
            return tree
        n = self.count
        self.count += 1
        leaves = list(leaves)
        if self.plan is None:
            self.sizes.append(len(idx))
            if simulate:
                self.rounding.add(n)
            for i, y in zip(idx, _record_point(n)(*(leaves[i] for i in idx))):
                leaves[i] = y
            return jax.tree_util.tree_unflatten(treedef, leaves)
        pp = self.plan.points[n] if n < len(self.plan.points) else None
        if pp is not None and pp.x is None:  # not a cut in the analysed program
            return tree
        if pp is None or len(pp.x) != len(idx):
            where = "/".join(self.stack[-1]) if self.stack else "the model"
            raise ValueError(
                f"adaloss_jax: the call of {where} traced "
                f"differently from the analysed program ({len(idx)} floating values at "
                f"scale point {n}, {'none' if pp is None else len(pp.x)} before); the loss "
                f"function must trace the same way each time for the same input structure"
            )
        pairs: dict = {}
        for i, xa, ya in zip(idx, pp.x, pp.y):
            pairs.setdefault((xa, ya), []).append(i)
        sim = self.simulate if simulate else None
        for (xa, ya), members in pairs.items():
            convert = xa != ya
            ratio = self.ratios[(xa, ya)] if convert else jnp.float32(1.0)
            dummy = self.dummies[self.used]
            self.used += 1
            # Simulating a narrow format, the cotangents are stored in the compute dtype
            # and rounded to the format only where they enter a group.
            y_max = self.cfg.x_max
            if self.simulate is not None:
                y_max = min(float(jnp.finfo(leaves[i].dtype).max) for i in members)
            x_max = self.cfg.x_max if sim is not None else y_max
            self.limits.append((y_max, x_max))
            out = _scale_point(self.cfg._replace(convert=convert, simulate=sim, y_max=y_max,
                                                 x_max=x_max),
                               tuple(leaves[i] for i in members), ratio, dummy)
            for i, y in zip(members, out):
                leaves[i] = y
        return jax.tree_util.tree_unflatten(treedef, leaves)


def convert_params(leaves: list, owners: list, plan_params, ratios) -> list:
    """Applying trace: a conversion point on each parameter read at a scale other than
    its owner's (its gradient then arrives at the owner's scale)."""
    out = list(leaves)
    k = 0
    for i, (x, owner) in enumerate(zip(leaves, owners)):
        if not is_float(x):
            continue
        uses = plan_params[k]
        k += 1
        if uses is None or uses == (owner,):
            continue
        inf = float("inf")
        cfg = PointConfig(convert=True, measure=False, sumsq=False, y_max=inf, x_max=inf)
        (out[i],) = _scale_point(cfg, (x,), ratios[((owner,), uses)], jnp.zeros((), jnp.float32))
    return out


def scale_group(name: str) -> Callable:
    """Marks a function as a scale group for adaptive per-layer scaling (pure JAX).

    ``scale_group("layer0")(fn)(*args)`` calls ``fn(*args)``; inside
    :func:`adaloss_jax.adaptive_value_and_grad` the call gets scale points, and the
    parameters under ``params["layer0"]`` (``"a/b"`` for ``params["a"]["b"]``) are that
    group's. Outside it, the wrapper is ``fn`` itself.

    >>> import jax.numpy as jnp
    >>> dense = scale_group("layer0")(lambda p, x: x @ p["w"])
    >>> dense({"w": jnp.eye(2)}, jnp.ones((1, 2))).shape
    (1, 2)
    """
    path = tuple(name.split("/")) if name else ()
    if not path:
        raise ValueError("scale_group needs a non-empty name, such as 'layer0'")

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return report(path, None, fn, args, kwargs)

        return wrapper

    return deco
