"""Property: per-layer scales are exact, stable and never worse than one global scale, on
randomly built Flax linen graphs (nesting, reuse with keyword arguments, tied embedding +
attend, concatenation, residuals, cross-attention to a shared memory, nn.scan (with a
module's own parameter added before it), nn.remat, dict and tuple outputs, BatchNorm
state, Flax's ``nn.RNN`` over the tokens, a ``fori_loop`` over one kernel, an
``nn.cond`` whose branches call the same modules, either branch taken, a Dense
layer whose output's cotangent is stopped)."""

from __future__ import annotations

from unittest import mock

import _graph
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import adaloss_jax as alj
from adaloss_jax import _grad, _stream
from adaloss_jax._layout import Layer

pytestmark = pytest.mark.slow  # the full suite only (CI)

W, V, T, B = 8, 16, 6, 4
OPS = ("dense", "reuse", "residual", "concat", "cross", "scan", "remat", "dict", "bn", "nest",
       "shifted", "rnn", "olstm", "fori", "cond", "cond-else", "stopped")


class Shared(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x, *, gate=1.0):
        return nn.tanh(nn.Dense(W, dtype=self.dtype)(x)) * gate


class Residual(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(W, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


class Cross(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x, memory):
        q = nn.Dense(W, dtype=self.dtype)(x)
        k = nn.Dense(W, dtype=self.dtype)(memory)
        v = nn.Dense(W, dtype=self.dtype)(memory)
        a = jax.nn.softmax((q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32) / W ** 0.5)
        return x + a.astype(self.dtype) @ v


class Concat(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.Dense(W, dtype=self.dtype)(x))
        return nn.Dense(W, dtype=self.dtype)(jnp.concatenate([x, y], axis=-1))


class DictOut(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x):
        dense = lambda: nn.Dense(W, dtype=self.dtype)
        return {"a": dense()(x), "b": (x * 0.5, dense()(x))}


class Cell(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, c, _):
        return nn.tanh(nn.Dense(W, dtype=self.dtype)(c)) + c, None


class Nest(nn.Module):
    dtype: object

    @nn.compact
    def __call__(self, x):
        return Residual(self.dtype)(Shared(self.dtype)(x))


class Shifted(nn.Module):
    """A module whose own parameter is added to its input before a scanned stack of
    cells: the sum is its region, entered only at the first layer's way in inside the
    scan's body."""

    dtype: object

    @nn.compact
    def __call__(self, x):
        x = x + self.param("shift", nn.initializers.normal(1.0), (W,)).astype(self.dtype)
        return nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)(self.dtype)(x, None)[0]


class Recurrent(nn.Module):
    """Flax's ``nn.RNN`` of a GRU cell (under ``nn.remat``) over the tokens, added to its
    input: a scan over time, its parameters broadcast to every step (one scale for all
    of them, their gradients summed over the steps), a checkpoint in its body."""

    dtype: object

    @nn.compact
    def __call__(self, x):
        return x + nn.RNN(nn.remat(nn.GRUCell)(W, dtype=self.dtype))(x).astype(x.dtype)


class FastRecurrent(nn.Module):
    """Flax's ``nn.RNN`` of an ``OptimizedLSTMCell``: its gates are ``DenseParams``,
    modules that return their raw parameters (reading their input's shape only), which
    the cell reads in one fan-in region."""

    dtype: object

    @nn.compact
    def __call__(self, x):
        return x + nn.RNN(nn.OptimizedLSTMCell(W, dtype=self.dtype))(x).astype(x.dtype)


class Looped(nn.Module):
    """A module's own kernel applied twice by ``jax.lax.fori_loop`` (a loop of fixed
    length, differentiated as a scan): no scale point inside the loop."""

    dtype: object

    @nn.compact
    def __call__(self, x):
        k = self.param("kernel", nn.initializers.lecun_normal(), (W, W)).astype(self.dtype)
        return jax.lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ k) + h, x)


class Branches(nn.Module):
    """``nn.cond`` between two orders of the same two Dense layers, each called in both
    branches: ``taken`` says which runs (``True``: the true branch, the last in the
    jaxpr), through a predicate that depends on the data for the tracer."""

    dtype: object
    taken: bool

    def setup(self):
        self.a = nn.Dense(W, dtype=self.dtype)
        self.b = nn.Dense(W, dtype=self.dtype)

    def __call__(self, x):
        s = jnp.sum(x.astype(jnp.float32))
        pred = (s == s) if self.taken else (s != s)
        return x + nn.cond(pred, lambda m, x: nn.tanh(m.a(m.b(x))),
                           lambda m, x: m.b(nn.tanh(m.a(x))) * 0.5, self, x)


class Stopped(nn.Module):
    """A Dense layer whose output's cotangent is stopped (``stop_gradient``: a frozen
    branch, its gradients zero) gating another's, both reading the block's input."""

    dtype: object

    @nn.compact
    def __call__(self, x):
        frozen = jax.lax.stop_gradient(nn.Dense(W, dtype=self.dtype)(x))
        return x + frozen * nn.Dense(W, dtype=self.dtype)(x)


class Gated(nn.Module):
    """A group whose own parameter is read on the way in and whose output is its child's
    (its output point neither converts nor measures anything new, but rounds when
    simulating)."""

    dtype: object

    @nn.compact
    def __call__(self, x):
        g = self.param("g", nn.initializers.ones, (W,))
        return nn.Dense(W, dtype=self.dtype)(x * g.astype(self.dtype))


class RandomNet(nn.Module):
    ops: tuple
    tied: bool
    dtype: object

    @nn.compact
    def __call__(self, tokens):
        dt = self.dtype
        embed = nn.Embed(V, W, dtype=dt)
        x = embed(tokens)
        memory = nn.Dense(W, dtype=dt)(x) if "cross" in self.ops else None
        shared = Shared(dt)
        for op in self.ops:
            if op == "dense":
                x = nn.gelu(nn.Dense(W, dtype=dt)(x))
            elif op == "reuse":
                x = shared(x, gate=0.5) + shared(x * 0.25, gate=2.0)
            elif op == "residual":
                x = Residual(dt)(x)
            elif op == "concat":
                x = Concat(dt)(x)
            elif op == "cross":
                x = Cross(dt)(x, memory)
            elif op == "scan":
                x, _ = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True},
                               length=2)(dt)(x, None)
            elif op == "remat":
                x = nn.remat(Residual)(dt)(x)
            elif op == "dict":
                d = DictOut(dt)(x)
                x = d["a"] + d["b"][0] + d["b"][1]
            elif op == "bn":
                x = nn.BatchNorm(use_running_average=False, dtype=dt)(x)
            elif op == "nest":
                x = Nest(dt)(x)
            elif op == "gated":
                x = Gated(dt)(x)
            elif op == "shifted":
                x = Shifted(dt)(x)
            elif op == "rnn":
                x = Recurrent(dt)(x)
            elif op == "olstm":
                x = FastRecurrent(dt)(x)
            elif op == "fori":
                x = Looped(dt)(x)
            elif op in ("cond", "cond-else"):
                x = Branches(dt, op == "cond")(x)
            elif op == "stopped":
                x = Stopped(dt)(x)
        if self.tied:
            return embed.attend(x)
        return nn.Dense(V, dtype=dt)(x)


def _loss(model, others, tiny):
    def loss_fn(p, tokens):
        out, _ = model.apply({"params": p, **others}, tokens[:, :-1], mutable=["batch_stats"])
        logits = out.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean() * tiny

    return loss_fn


def _run(scaler, loss_fn, params, tokens, steps):
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))

    @jax.jit
    def step(state, params, tokens):
        loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(state, params, tokens)
        updates, state = tx.update(grads, state, params, loss=loss, scale_stats=stats)
        return updates, state, grads

    state = tx.init(params)
    out = []
    for _ in range(steps):
        updates, state, scaled = step(state, params, tokens)
        out.append((updates, alj.scale_state(state), scaled))
    return out


def _applied_points(loss_fn, scaler, params, *batch) -> set[int]:
    """The scale points the plan applies (their numbers)."""

    _, program, _ = _grad.trace(loss_fn, scaler, params, batch, {})
    return {n for n, p in enumerate(program.plan.points) if p.x is not None}


def _rel_err(a, r) -> float:
    r = np.asarray(r, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - r) / max(np.linalg.norm(r), 1e-30))


def _assert_within_rounding(grads, global_grads, ref, ops) -> None:
    """Each leaf's relative error against fp32 is at most 0.1, or at most twice that of
    one global scale (a leaf whose exact gradient is zero, such as an attention key bias,
    is rounding noise at any scale)."""
    for (path, g), gg, r in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                jax.tree_util.tree_leaves(global_grads),
                                jax.tree_util.tree_leaves(ref)):
        err = _rel_err(g, r)
        assert err <= max(0.1, 2.0 * _rel_err(gg, r)), (ops, jax.tree_util.keystr(path), err)


def _random_net(ops, tied, tiny):
    """Tokens, fp32 parameters, the fp32 reference gradient and the fp16 loss of one
    random linen graph."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(B, T + 1)))
    m32 = RandomNet(tuple(ops), tied, jnp.float32)
    variables = m32.init(jax.random.key(0), tokens[:, :-1])
    params = variables["params"]
    others = {k: v for k, v in variables.items() if k != "params"}
    ref = jax.jit(jax.grad(_loss(m32, others, tiny)))(params, tokens)
    return tokens, params, ref, _loss(RandomNet(tuple(ops), tied, jnp.float16), others, tiny)


def conformance_step(scaler, loss_fn, params, *batch):
    """The jitted ``step(state) -> (updates, state, scaled gradients)`` that
    ``assert_conformance`` drives (updates are the unscaled gradients: sgd(-1)), its
    initial state and the ``adaptive_value_and_grad`` function."""
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))
    vg = alj.adaptive_value_and_grad(loss_fn)

    @jax.jit
    def step(state):
        loss, g, stats = vg(state, params, *batch)
        updates, state = tx.update(g, state, params, loss=loss, scale_stats=stats)
        return updates, state, g

    return step, tx.init(params), vg


def assert_conformance(step, state, results, groups, ref, ops, reached) -> None:
    """The front-end conformance checks: ``step(state) -> (updates, state, scaled)``
    (jitted, one front end, one ``groups`` mode) applies every step after 3 warm-up steps
    of 23; once both modes are in ``results`` (``{groups: (updates, scaled, adaptive
    state)}``), per-module gradients
    are within rounding of fp32, flush no more than global leaf by leaf, and every group
    in ``reached`` has moved off its initial scale."""
    for t in range(3 + 20):
        updates, state, scaled = step(state)
        if t >= 3:
            assert bool(alj.scale_state(state).base.last_applied), (ops, groups, t)
    results[groups] = (updates, scaled, alj.scale_state(state))
    if set(results) != {"module", "global"}:
        return
    updates, scaled, ad = results["module"]
    _assert_within_rounding(updates, results["global"][0], ref, ops)
    for a, b in zip(_underflow(scaled, ref), _underflow(results["global"][1], ref)):
        assert a <= b + 1e-3, ops
    moved = {g for g, v in ad.log2_scales.items() if v != 0}
    moved |= {s.group for s in moved if isinstance(s, Layer)}  # a stack, by its layers' slots
    assert reached <= moved, ad.log2_scales


def _underflow(scaled, ref) -> list[float]:
    return [float(np.sum((np.asarray(r) != 0) & (np.asarray(a) == 0)) / max(np.asarray(r).size, 1))
            for a, r in zip(jax.tree_util.tree_leaves(scaled), jax.tree_util.tree_leaves(ref))]


@settings(max_examples=2, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.sampled_from(OPS), min_size=2, max_size=4), tied=st.booleans(),
       tiny=st.sampled_from([1.0, 2.0**-12, 2.0**-20]))
@example(ops=["scan", "remat", "dict", "cross"], tied=True, tiny=2.0**-20)
@example(ops=["dense", "shifted", "residual"], tied=False, tiny=2.0**-20)
@example(ops=["rnn", "fori", "residual"], tied=True, tiny=2.0**-12)
@example(ops=["cond-else", "residual", "cond"], tied=False, tiny=2.0**-20)
def test_random_graphs_exact_stable_and_no_worse_than_global(ops, tied, tiny):
    tokens, params, ref, loss16 = _random_net(ops, tied, tiny)
    warm, checked = 3, 20
    module = _run(alj.adaptive(groups="module"), loss16, params, tokens, warm + checked)
    glob = _run(alj.adaptive(groups="global"), loss16, params, tokens, warm + 1)
    for _, ad, _ in module[warm:]:
        assert bool(ad.base.last_applied), (ops, "skipped", ad.overflowed)
    updates, ad, scaled = module[-1]
    # Every leaf within fp16 rounding of the fp32 reference (updates are the unscaled
    # gradients: sgd(-1)).
    _assert_within_rounding(updates, glob[-1][0], ref, ops)
    # Per-module underflow never above global's, leaf by leaf.
    u_mod = _underflow(scaled, ref)
    u_glob = _underflow(glob[-1][2], ref)
    for a, b in zip(u_mod, u_glob):
        assert a <= b + 1e-3, (ops, u_mod, u_glob)


# ------------------------------------------------------------------------------ NNX


def _nnx_model(ops, tied, dtype):
    from flax import nnx

    class Dense(nnx.Module):
        def __init__(self, din, dout, rngs):
            self.lin = nnx.Linear(din, dout, rngs=rngs, dtype=dtype)

        def __call__(self, x, *, gate=1.0):
            return jnp.tanh(self.lin(x)) * gate

    class DictOut(nnx.Module):
        def __init__(self, din, dout, rngs):
            self.a = nnx.Linear(din, dout, rngs=rngs, dtype=dtype)
            self.b = nnx.Linear(din, dout, rngs=rngs, dtype=dtype)

        def __call__(self, x):
            return {"a": jnp.tanh(self.a(x)), "b": (x * 0.5, jnp.tanh(self.b(x)))}

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, W, rngs=rngs, dtype=dtype)
            self.shared = Dense(W, W, rngs)
            self.memory = nnx.Linear(W, W, rngs=rngs, dtype=dtype)
            self.layers = nnx.List([self._layer(op, rngs) for op in ops])
            self.head = nnx.Linear(W, V, rngs=rngs, dtype=dtype)

        def _layer(self, op, rngs):
            if op in ("dense", "residual"):
                return Dense(W, W, rngs)
            if op == "concat":
                return Dense(2 * W, W, rngs)
            if op == "cross":
                return nnx.List([nnx.Linear(W, W, rngs=rngs, dtype=dtype) for _ in range(3)])
            if op == "bn":
                return nnx.BatchNorm(W, rngs=rngs, dtype=dtype)
            if op == "dict":
                return DictOut(W, W, rngs)
            if op == "scan":  # two stacked layers, run by nnx.scan
                return nnx.split_rngs(splits=2)(nnx.vmap(lambda r: Dense(W, W, r)))(rngs)
            return Dense(W, W, rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            memory = self.memory(x)

            def other(op, i, x):
                layer = self.layers[i]
                if op == "cross":
                    q, k, v = layer[0](x), layer[1](memory), layer[2](memory)
                    a = jax.nn.softmax((q @ jnp.swapaxes(k, -1, -2)).astype(jnp.float32))
                    x = x + a.astype(dtype) @ v
                elif op == "bn":
                    x = layer(x.reshape(-1, W)).reshape(x.shape)
                elif op == "remat":
                    x = nnx.remat(lambda m, x: x + m(x, gate=0.5))(layer, x)
                elif op == "dict":  # a module returning a dict holding a tuple
                    out = layer(x)
                    x = out["a"] + out["b"][0] * out["b"][1]
                else:
                    x = layer(x)
                return x

            def scan(i, x):
                return nnx.scan(lambda c, m: c + m(c), in_axes=(nnx.Carry, 0),
                                out_axes=nnx.Carry)(x, self.layers[i])

            x = _graph.run(ops, x, layer=lambda i, x, gate=1.0: self.layers[i](x, gate=gate),
                           shared=self.shared, scan=scan, other=other)
            return self.embed.attend(x) if tied else self.head(x)

    return Net(nnx.Rngs(0))


NNX_OPS = ("dense", "residual", "reuse", "concat", "cross", "bn", "scan", "remat", "dict")


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.sampled_from(NNX_OPS), min_size=2, max_size=4), tied=st.booleans())
@example(ops=["scan", "reuse", "remat", "dict"], tied=True)  # every op in two examples
@example(ops=["cross", "bn", "concat", "residual"], tied=False)
def test_random_nnx_graphs_exact_and_no_worse_than_global(ops, tied):
    from flax import nnx

    from adaloss_jax.flax import nnx_adaptive_value_and_grad

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(B, T + 1)))
    tiny = 2.0**-16

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens[:, 1:]).mean() * tiny

    ref = nnx.as_pure(nnx.grad(loss_fn)(_nnx_model(ops, tied, jnp.float32), tokens))
    results = {}
    for groups in ("module", "global"):
        scaler = alj.adaptive(groups=groups)
        model = _nnx_model(ops, tied, jnp.float16)
        tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))
        state = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))

        @nnx.jit
        def step(model, state, scaler=scaler, tx=tx):
            loss, g, stats = nnx_adaptive_value_and_grad(loss_fn)(state, model, tokens)
            params = nnx.as_pure(nnx.state(model, nnx.Param))
            updates, state = tx.update(nnx.as_pure(g), state, params, loss=loss,
                                       scale_stats=stats)
            return updates, state, nnx.as_pure(g)

        warm, checked = 3, (20 if groups == "module" else 1)
        for t in range(warm + checked):
            updates, state, scaled = step(model, state)
            if t >= warm:
                assert bool(alj.scale_state(state).base.last_applied), (ops, groups, t)
        if groups == "module":  # every module the loss reaches got a scale of its own
            moved = {g for g, v in alj.scale_state(state).log2_scales.items() if v != 0}
            moved |= {s.group for s in moved if isinstance(s, Layer)}  # a stack's slots
            reached = {"/".join(str(k.key) for k in path[:-1])
                       for path, r in jax.tree_util.tree_flatten_with_path(ref)[0]
                       if np.any(np.asarray(r) != 0)}
            assert reached <= moved, (ops, reached - moved)
        results[groups] = (updates, scaled)
    updates, scaled = results["module"]
    _assert_within_rounding(updates, results["global"][0], ref, ops)
    for a, b in zip(_underflow(scaled, ref), _underflow(results["global"][1], ref)):
        assert a <= b + 1e-3, ops


# ------------------------------------------------------- points left out of the plan


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.sampled_from(OPS + ("gated",)), min_size=2, max_size=4),
       tied=st.booleans(), statistic=st.sampled_from(["amax", "gaussian", "quantile"]),
       simulate=st.booleans(), seed=st.integers(0, 3))
@example(ops=["nest", "gated", "scan", "dict", "reuse"], tied=True, statistic="quantile",
         simulate=True, seed=0)
def test_points_left_out_of_the_plan_change_nothing(ops, tied, statistic, simulate, seed):
    """A point the plan leaves out (no conversion, every input straight from another
    point) would have measured a cotangent that the point feeding it measures: the
    gradients, each group's amax and the overflow flags are bitwise those of the plan
    that applies every point, on scales that differ per group (conversions everywhere)
    and that overflow some groups; sums over values (count, sum of squares, histogram)
    lose only the repeats."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(B, T + 1)))
    model = RandomNet(tuple(ops), tied, jnp.float16)
    variables = model.init(jax.random.key(0), tokens[:, :-1])
    params = variables["params"]
    others = {k: v for k, v in variables.items() if k != "params"}
    scaler = alj.adaptive(groups="module", statistic=statistic, simulate=simulate,
                          grad_dtype="float8_e4m3fn" if simulate else "float16")
    state = alj.adaptive_unscale(scaler).init(params)
    rng = np.random.default_rng(seed)
    state = state.with_log2_scales({g: int(rng.integers(-4, 44)) for g in state.log2_scales})
    analyse = _stream.analyse

    def every_point(jaxpr, sizes, owners, **kw):
        return analyse(jaxpr, sizes, owners, **{**kw, "keep": frozenset(range(len(sizes)))})

    def run(keep_all):
        loss_fn = _loss(model, others, 1.0)
        with mock.patch.object(_stream, "analyse", every_point if keep_all else analyse):
            out = jax.jit(alj.adaptive_value_and_grad(loss_fn))(state, params, tokens)
            n = len(_applied_points(loss_fn, scaler, params, tokens))
        return out, n

    (loss_a, grads_a, stats_a), n_all = run(keep_all=True)
    (loss_d, grads_d, stats_d), n_left = run(keep_all=False)
    if "nest" in ops:  # a parent's boundary around its child's
        assert n_left < n_all
    assert n_left <= n_all
    assert np.array_equal(loss_a, loss_d)
    for a, d in zip(jax.tree_util.tree_leaves(grads_a), jax.tree_util.tree_leaves(grads_d)):
        assert np.array_equal(a, d, equal_nan=True), ops
    assert bool(stats_a.nonfinite) == bool(stats_d.nonfinite)
    for g in stats_a.amax:
        assert np.array_equal(stats_a.amax[g], stats_d.amax[g]), (ops, g)
        assert bool(stats_a.bad[g]) == bool(stats_d.bad[g]), (ops, g)
        if statistic == "gaussian":
            assert float(stats_d.count[g]) <= float(stats_a.count[g])
            assert not float(stats_d.sumsq[g]) > float(stats_a.sumsq[g]) * (1 + 1e-6), (ops, g)
        if statistic == "quantile":
            assert np.all(np.asarray(stats_d.hist[g]) <= np.asarray(stats_a.hist[g]))


# --------------------------------------------------------- groups cut at max_depth


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.sampled_from(OPS), min_size=2, max_size=4), tied=st.booleans())
@example(ops=["nest", "scan", "remat", "cross"], tied=True)
def test_groups_cut_at_max_depth_are_exact_stable_and_no_worse_than_global(ops, tied):
    """``max_depth=1``: one group per top-level module (its children's parameters are
    its own), points only at top-level boundaries (fewer than per-module wherever a
    module has children), and the conformance checks of per-module scaling."""
    tokens, params, ref, loss16 = _random_net(ops, tied, 2.0**-20)
    top = {path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    reached = {path[0].key for path, r in jax.tree_util.tree_flatten_with_path(ref)[0]
               if np.any(np.asarray(r) != 0)}
    results, applied = {}, {}
    for groups, scaler in (("module", alj.adaptive(groups="module", max_depth=1)),
                           ("global", alj.adaptive(groups="global"))):
        step, state, vg = conformance_step(scaler, loss16, params, tokens)
        own = {g for g in alj.scale_state(state).log2_scales if not isinstance(g, Layer)}
        assert own == ({""} | top if groups == "module" else {""})  # (and stacks' slots)
        assert_conformance(step, state, results, groups, ref, ops, reached)
        applied[groups] = len(_applied_points(loss16, scaler, params, tokens))
    per_module = alj.adaptive(groups="module")
    nested = set(ops) - {"dense", "bn", "fori"}  # every other op is a module with children
    n_module = len(_applied_points(loss16, per_module, params, tokens))
    assert applied["module"] < n_module if nested else applied["module"] == n_module, ops


# ---------------------------------------------------- what only aux reads


@settings(max_examples=1, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=st.lists(st.sampled_from(OPS), min_size=2, max_size=4), tied=st.booleans(),
       seed=st.integers(0, 3))
@example(ops=["scan", "residual", "reuse"], tied=True, seed=0)
def test_what_only_aux_reads_changes_no_plan_and_no_gradient(ops, tied, seed):
    """On any graph, a loss that also returns in ``aux`` the parameters' global norm and
    a value of every module's output (sown) has the plan of the loss without them (the
    same points, anchors, parameter conversions and deciders), and at the same random
    scales bitwise the same gradients and statistics: their cotangent is zero."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(B, T + 1)))
    model = RandomNet(tuple(ops), tied, jnp.float16)
    variables = model.init(jax.random.key(0), tokens[:, :-1])
    params = variables["params"]
    others = {k: v for k, v in variables.items() if k != "params"}
    plain = _loss(model, others, 1.0)

    def with_aux(p, tokens):
        out, sown = model.apply({"params": p, **others}, tokens[:, :-1],
                                mutable=["batch_stats", "intermediates"],
                                capture_intermediates=True)
        logits = out.astype(jnp.float32)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        taps = [jnp.mean(jnp.square(x.astype(jnp.float32)))
                for x in jax.tree_util.tree_leaves(sown["intermediates"])
                if jnp.issubdtype(x.dtype, jnp.floating)]
        return loss, {"norm": optax.tree.norm(p), "taps": taps}

    scaler = alj.adaptive(groups="module")
    programs = [_grad.trace(f, scaler, params, (tokens,), {})[1] for f in (plain, with_aux)]
    assert programs[0].plan.points == programs[1].plan.points, ops
    assert programs[0].plan.params == programs[1].plan.params, ops
    assert programs[0].live.groups == programs[1].live.groups, ops
    assert programs[0].live.fanins == programs[1].live.fanins, ops
    state = alj.adaptive_unscale(scaler).init(params)
    rng = np.random.default_rng(seed)
    state = state.with_log2_scales({g: int(rng.integers(-4, 44)) for g in state.log2_scales})
    _, grads_p, stats_p = jax.jit(alj.adaptive_value_and_grad(plain))(state, params, tokens)
    _, grads_a, stats_a = jax.jit(alj.adaptive_value_and_grad(with_aux, has_aux=True))(
        state, params, tokens)
    for a, b in zip(jax.tree_util.tree_leaves(grads_p), jax.tree_util.tree_leaves(grads_a)):
        assert np.array_equal(a, b, equal_nan=True), ops
    for g in stats_p.amax:
        assert np.array_equal(stats_p.amax[g], stats_a.amax[g]), (ops, g)
