"""Module calls and where they happen: the receivers front ends report to, and the one
trace of a loss that records them.

A front end (linen's method interceptor, the class swap of NNX and Equinox modules,
:func:`scale_group` for pure JAX) only reports each module call through :func:`report`;
every active :class:`Receiver` sees it. Two receivers exist: the recorder of an adaptive
gradient (:func:`record`), which marks the floating inputs and outputs of each call as
a *scale point* in the traced program, and a numerics probe's taps.

:func:`record` traces the loss once, to a jaxpr in which each point is a jitted identity
named ``POINT_PREFIX + n`` (:mod:`adaloss_jax._jaxpr`). Everything after works on that
jaxpr; the loss is never traced again. While it records, a JAX user context is set, so
JAX's own trace caches (of nested ``jax.jit``, ``jax.checkpoint``, scan bodies) cannot
hand back a trace made without the points.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jcore
import jax.numpy as jnp

from adaloss_jax import _jaxpr, _tree

_LOCAL = threading.local()
_HOOKS: list[Callable] = []
_RECORDING = jax.make_user_context(default_value=None)
_RECORDINGS = itertools.count()


def register_hook(hook: Callable) -> None:
    """Registers a front end's hook: ``hook(receiver)`` returns a context manager within
    which the framework reports its module calls (linen's method interceptor). The core
    imports no framework; a front end registers itself when it is imported."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


@contextlib.contextmanager
def hooks(receiver=None, extra=()):
    """Every registered hook (and ``extra`` ones) active within the context."""
    with contextlib.ExitStack() as stack:
        for hook in (*_HOOKS, *extra):
            stack.enter_context(hook(receiver))
        yield


class Receiver:
    """What the module calls a front end reports run through, while it is active (a
    context manager). Receivers nest; every active one sees every call, the outermost
    first.

    ``leaf_paths`` (``{id(leaf): path}``) names the parameter leaves the loss was given,
    so that a front end can tell where a sub-tree of them sits (:func:`subtree_prefix`).
    """

    leaf_paths: dict = {}

    def given(self, leaves, paths) -> None:
        """Names the parameter leaves the loss is given (``paths``: their paths)."""
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


def active() -> Receiver | None:
    """The innermost active receiver, or None (front ends then change nothing)."""
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


def subtree_prefix(tree) -> tuple[str, ...] | None:
    """Where ``tree``, parameters a model was applied to, sits in the parameters the
    loss was given (``params["student"]`` -> ``("student",)``, the whole tree -> ``()``),
    found by the identity of its leaves. None where no leaf is one of them (parameters
    transformed before the call) or the paths disagree."""
    stack = getattr(_LOCAL, "stack", None) or ()
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for r in reversed(stack):
        for keys, x in flat:
            full = r.leaf_paths.get(id(x))
            if full is None:
                continue
            rel = tuple(_tree.key_name(k) for k in keys)
            n = len(full) - len(rel)
            return full[:n] if n >= 0 and full[n:] == rel else None
    return None


def report(path: tuple[str, ...], module, fn: Callable, args, kwargs):
    """Runs ``fn(*args, **kwargs)`` as a call of the module or scale group at ``path``
    (``()`` is the root): the one entry point of every front end. A method calling
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


MARKED: set[tuple[str, ...]] = set()  # the paths scale_group was given, in this process


def scale_group(name: str) -> Callable:
    """Marks a function as a scale group for adaptive per-layer scaling (pure JAX).

    ``scale_group("layer0")(fn)(*args)`` calls ``fn(*args)``; inside
    :func:`adaloss_jax.adaptive_value_and_grad` the call gets scale points, and the
    parameters under ``params["layer0"]`` (``"a/b"`` for ``params["a"]["b"]``), however
    deeply nested, are that group's (those under a name marked deeper inside it are that
    one's). Outside it, the wrapper is ``fn`` itself. Mark functions before ``tx.init``
    builds the optimizer state: the state's groups are formed from the names marked by
    then.

    Args:
      name: the group's path, ``/``-separated; not empty.

    Returns:
      A decorator.

    Raises:
      ValueError: for an empty name.

    >>> dense = scale_group("layer0")(lambda p, x: x @ p["w"])
    >>> dense({"w": jnp.eye(2)}, jnp.ones((1, 2))).shape
    (1, 2)
    """
    path = tuple(name.split("/")) if name else ()
    if not path:
        raise ValueError("scale_group needs a non-empty name, such as 'layer0'")
    MARKED.add(path)

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return report(path, None, fn, args, kwargs)

        return wrapper

    return deco


class Call(NamedTuple):
    """A recorded module call: its path and whether it is a scale group of its own."""

    path: tuple[str, ...]
    group: bool


def _identity(label: str):
    def ident(*xs):
        return xs

    ident.__name__ = label
    return jax.jit(ident)


class _Recorder(Receiver):
    """Marks scale points around the calls a front end reports.

    ``selects(path, module)`` says what a call is: ``"group"`` (a module owning
    parameters), ``"measure"`` (any other module: measured and cut) or None (no point).
    """

    def __init__(self, selects: Callable):
        self.selects = selects
        self.count = 0
        self.reported = 0  # module calls reported, selected or not
        self.calls: list[Call] = []
        self.stack: list[tuple[str, ...]] = []
        self.sizes: list[int] = []  # floating leaves of each point
        self.rounding: set[int] = set()  # points on a group's outputs
        self.dtypes: set = set()  # dtypes of the floating values crossing points

    def wrap(self, path, module, next_fun, args, kwargs):
        self.reported += 1
        kind = self.selects(path, module)
        if kind is None:
            return next_fun(*args, **kwargs)
        self.calls.append(Call(path, kind == "group"))
        args, kwargs = self._point((args, kwargs), rounds=False)
        self.stack.append(path)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            self.stack.pop()
        return self._point(out, rounds=kind == "group")

    def _point(self, tree, rounds: bool):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        # Parameter values pass points unmarked (the parameter point handles them).
        idx = [i for i, x in enumerate(leaves)
               if _tree.is_float(x) and isinstance(x, jax.Array)
               and id(x) not in self.leaf_paths]
        if not idx:
            return tree
        n = self.count
        self.count += 1
        self.sizes.append(len(idx))
        if rounds:
            self.rounding.add(n)
        for i in idx:
            self.dtypes.add(jnp.dtype(leaves[i].dtype))
        marked = _identity(f"{_jaxpr.POINT_PREFIX}{n}")(*(leaves[i] for i in idx))
        leaves = list(leaves)
        for i, y in zip(idx, marked):
            leaves[i] = y
        return jax.tree_util.tree_unflatten(treedef, leaves)


class Recording(NamedTuple):
    """A loss traced once with its scale points marked.

    ``closed`` takes the dynamic leaves of ``(params, args, kwargs)`` (parameters first)
    and returns the array leaves of ``fun``'s output; :meth:`output` puts them back
    beside the output's other leaves (a Python ``int`` or ``str`` in ``aux``).
    """

    closed: Any  # jax.extend.core.ClosedJaxpr
    out_tree: Any
    out_static: tuple  # the output's leaves, None where closed returns the value
    dynamic: list  # the input values, in the order of closed's inputs
    n_params: int  # of which the first n_params are the parameter leaves
    param_paths: list  # the parameter leaves' paths
    sizes: list[int]
    rounding: frozenset
    calls: list[Call]
    reported: int
    dtypes: frozenset
    casts: dict = {}  # point n -> the narrow dtype its input was cast from (mark_casts)

    def output(self, values: list) -> Any:
        """``fun``'s output, from the values ``closed`` returns."""
        values = iter(values)
        leaves = [next(values) if s is None else s[0] for s in self.out_static]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


def _is_dynamic(x) -> bool:
    return isinstance(x, jax.Array) or (hasattr(x, "shape") and hasattr(x, "dtype")
                                        and not isinstance(x, type))


def record(fun: Callable, params: Any, args: tuple, kwargs: dict, selects: Callable,
           extra_hooks=()) -> Recording:
    """Traces ``fun(params, *args, **kwargs)`` once, with every reported call's floating
    inputs and outputs marked as scale points and the parameter leaves as the parameter
    point."""
    leaves, treedef = jax.tree_util.tree_flatten((params, args, kwargs))
    n_param_leaves = len(jax.tree_util.tree_leaves(params))
    dyn = [i for i, x in enumerate(leaves) if _is_dynamic(x)]
    param_dyn = [i for i in dyn if i < n_param_leaves]
    paths = _tree.leaf_paths(params)
    recorder = _Recorder(selects)
    out = {}

    def traced(*values):
        full = list(leaves)
        for i, v in zip(dyn, values):
            full[i] = v
        floats = [i for i in param_dyn if _tree.is_float(full[i])]
        marked = _identity(_jaxpr.PARAM_POINT)(*(full[i] for i in floats))
        for i, v in zip(floats, marked):
            full[i] = v
        recorder.given([full[i] for i in range(n_param_leaves)], paths)
        p, a, k = jax.tree_util.tree_unflatten(treedef, full)
        with recorder, hooks(recorder, extra_hooks):
            result = fun(p, *a, **k)
        flat, out["tree"] = jax.tree_util.tree_flatten(result)
        # Non-array outputs (a count, a name in aux) stay Python values, as in
        # jax.value_and_grad; boxed so that a None leaf is told from "traced".
        out["static"] = tuple(None if _is_dynamic(x) else (x,) for x in flat)
        return [x for x in flat if _is_dynamic(x)]

    with _RECORDING(next(_RECORDINGS)):
        closed = jax.make_jaxpr(traced)(*(leaves[i] for i in dyn))
    return Recording(
        closed=closed, out_tree=out["tree"], out_static=out["static"],
        dynamic=[leaves[i] for i in dyn], n_params=len(param_dyn),
        param_paths=[paths[i] for i in param_dyn], sizes=recorder.sizes,
        rounding=frozenset(recorder.rounding), calls=recorder.calls,
        reported=recorder.reported, dtypes=frozenset(recorder.dtypes))


def mark_casts(rec: Recording, at: Sequence[tuple[int, ...]]) -> Recording:
    """``rec`` with a scale point of its own after each of the cast equations ``at``
    (their paths, :func:`adaloss_jax._jaxpr.widening_casts`: at the top level or inside
    nested ``jit``, ``checkpoint``, ``scan``, ``shard_map`` or ``cond`` equations, whose
    jaxprs are rebuilt with the point inside), numbered after the recorded ones in
    program order: a point on the wide side of a cast measures the cotangent before it
    is cast down. Nothing else in the program changes."""
    if not at:
        return rec
    casts = dict(rec.casts)
    sizes = list(rec.sizes)

    def insert(jaxpr, paths):
        here = {p[0] for p in paths if len(p) == 1}
        deeper: dict = {}  # (equation, its sub-jaxpr) -> the paths inside
        for p in paths:
            if len(p) > 1:
                deeper.setdefault(p[:2], []).append(p[2:])
        eqns, sub = [], {}
        for i, eqn in enumerate(jaxpr.eqns):
            eqn = eqn.replace(invars=[sub.get(v, v) if isinstance(v, jcore.Var) else v
                                      for v in eqn.invars])
            for (at, b), rest in deeper.items():  # a sub-jaxpr with the points inside
                if at == i:
                    body = _jaxpr.open_jaxpr(_jaxpr.cast_bodies(eqn)[b])
                    eqn = _jaxpr.with_cast_body(eqn, b, insert(body, rest))
            eqns.append(eqn)
            if i in here:
                y = eqn.outvars[0]
                n = len(sizes)
                sizes.append(1)
                casts[n] = jnp.dtype(eqn.invars[0].aval.dtype)
                aval = jax.ShapeDtypeStruct(y.aval.shape, y.aval.dtype)
                template = jax.make_jaxpr(_identity(f"{_jaxpr.POINT_PREFIX}{n}"))(aval).jaxpr
                out = jcore.Var(y.aval)
                eqns.append(template.eqns[0].replace(invars=[y], outvars=[out]))
                sub[y] = out
        outvars = [sub.get(v, v) if isinstance(v, jcore.Var) else v for v in jaxpr.outvars]
        return jaxpr.replace(eqns=eqns, outvars=outvars)

    closed = jcore.ClosedJaxpr(insert(rec.closed.jaxpr, list(at)), rec.closed.consts)
    return rec._replace(closed=closed, sizes=sizes, casts=casts)
