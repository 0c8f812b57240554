"""JAX's transformations around the model and inside it, in every front end: a
transformed loss measures what its untransformed twin measures and gets its gradients.

A random composition is drawn: one transformation around the model (a per-example
``vmap``, ``jax.checkpoint``, ``jax.jit``, ``lax.cond``, ``shard_map`` over 2 devices with
and without ``check_vma``) and one inside it, around each
layer's call (the same, in each framework's own spelling: ``nn.remat``, ``nnx.jit``,
...). The untransformed twin is the same model with neither: for a per-example ``vmap``,
the batched model. At the same per-group scales:

* the decoded statistics are equal (amax to fp16 rounding of the cotangents, overflow
  flags exactly);
* the scaled gradients are equal (to fp16 rounding, since XLA may order the sums of a
  batched and a per-example program differently);
* in fp32, under arbitrary per-group scales, the unscaled gradients equal ``jax.grad``
  of the fp32 loss (exactness: every conversion is at the right place).

Stacked layers run by ``lax.scan`` are compared with their unrolled twin in
:func:`test_scanned_stack_equals_its_unrolled_twin`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import assert_fp32_trees_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adaloss_jax as alj

D, B, L = 8, 6, 3
AROUND = ("none", "vmap", "remat", "jit", "cond", "shard_map", "shard_map_untyped")
INSIDE = ("none", "remat", "jit", "cond", "vmap")
FRONT_ENDS = ("jax", "equinox", "linen", "nnx")


def _always(x):
    """A predicate ``cond`` cannot fold away, true for any finite input (summed in fp32:
    ``-1e9`` does not fit an fp16 value)."""
    return jnp.sum(jnp.asarray(x, jnp.float32)) > -1e9


def _x(dtype):
    return jnp.asarray(np.random.default_rng(0).normal(size=(B, D)), dtype)


def _mesh():
    return jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _around(kind, model_fn):
    """``model_fn(x) -> out`` on a batch, transformed around the whole model."""
    if kind == "none":
        return model_fn
    if kind == "vmap":  # per example: the model sees one row at a time
        return lambda x: jax.vmap(lambda xi: model_fn(xi[None])[0])(x)
    if kind == "remat":
        return jax.checkpoint(model_fn)
    if kind == "jit":
        return jax.jit(model_fn)
    if kind.startswith("shard_map"):  # the batch split over 2 devices, parameters replicated
        from jax.sharding import PartitionSpec as P

        return jax.shard_map(model_fn, mesh=_mesh(), in_specs=P("data"), out_specs=P("data"),
                             check_vma=kind == "shard_map")
    assert kind == "cond"
    return lambda x: jax.lax.cond(_always(x), model_fn, lambda x: model_fn(x * 0.5), x)


def _inside(kind, call):
    """``call(h) -> h`` (one layer), transformed with plain JAX."""
    if kind == "none":
        return call
    if kind == "vmap":
        return lambda h: jax.vmap(lambda hi: call(hi[None])[0])(h)
    if kind == "remat":
        return jax.checkpoint(call)
    if kind == "jit":
        return jax.jit(call)
    return lambda h: jax.lax.cond(_always(h), call, lambda h: call(h * 0.5), h)


def _nnx_around(kind, model, x):
    """The same transformations around an NNX model, in NNX's spelling (a stateful model
    crosses a transformation through NNX's own)."""
    from flax import nnx

    call = lambda m, x: m(x)
    if kind == "none":
        return model(x)
    if kind == "vmap":
        return nnx.vmap(lambda m, xi: m(xi[None])[0], in_axes=(None, 0))(model, x)
    if kind == "remat":
        return nnx.remat(call)(model, x)
    if kind == "jit":
        return nnx.jit(call)(model, x)
    if kind.startswith("shard_map"):
        from jax.sharding import PartitionSpec as P

        return nnx.shard_map(call, mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P("data"),
                             check_vma=kind == "shard_map")(model, x)
    return nnx.cond(_always(x), call, lambda m, x: m(x * 0.5), model, x)


# --------------------------------------------------------------------------- front ends


def _jax_model(inside, dtype):
    layers = [alj.scale_group(f"layer{i}")(
        lambda p, h: jnp.tanh(h @ p["w"].astype(h.dtype) + p["b"].astype(h.dtype)))
        for i in range(L)]
    keys = jax.random.split(jax.random.key(0), L)
    params = {f"layer{i}": {"w": jax.random.normal(keys[i], (D, D)) / D**0.5,
                            "b": jnp.full((D,), 0.1)} for i in range(L)}

    def apply(p, x):
        h = x.astype(dtype)
        for i, layer in enumerate(layers):
            h = _inside(inside, functools.partial(layer, p[f"layer{i}"]))(h)
        return h

    return params, apply


def _equinox_model(inside, dtype):
    import equinox as eqx

    class Layer(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, h):  # h: (batch, D)
            return jnp.tanh(jax.vmap(self.lin)(h))

    class Net(eqx.Module):
        layers: list

        def __call__(self, x):
            h = x
            for layer in self.layers:
                h = _inside(inside, lambda h, layer=layer: layer(h))(h)
            return h

    keys = jax.random.split(jax.random.key(0), L)
    net = Net([Layer(eqx.nn.Linear(D, D, key=k, dtype=dtype)) for k in keys])
    return net


def _linen_model(inside, dtype):
    from flax import linen as nn

    lift = {"none": lambda c: c, "remat": nn.remat, "jit": nn.jit,
            "vmap": lambda c: nn.vmap(c, in_axes=0, out_axes=0,
                                      variable_axes={"params": None},
                                      split_rngs={"params": False}),
            "cond": None}[inside]

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, h):
            return jnp.tanh(nn.Dense(D, dtype=dtype)(h))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = x
            for i in range(L):
                if inside == "cond":
                    layer = Layer(name=f"Layer_{i}")
                    h = nn.cond(_always(h), lambda m, h: m(h),
                                lambda m, h: m(h * 0.5), layer, h)
                elif inside == "vmap":
                    h = lift(Layer)(name=f"Layer_{i}")(h[:, None])[:, 0]
                else:
                    h = lift(Layer)(name=f"Layer_{i}")(h)
            return h

    return Net()


def _nnx_model(inside, dtype):
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, dtype=dtype, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.lin(h))

    lift = {"none": lambda f: f, "remat": nnx.remat, "jit": nnx.jit,
            "vmap": lambda f: nnx.vmap(f, in_axes=(None, 0)), "cond": None}[inside]

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([Layer(rngs) for _ in range(L)])

        def __call__(self, x):
            h = x
            for layer in self.layers:
                if inside == "cond":
                    h = nnx.cond(_always(h), lambda m, h: m(h),
                                 lambda m, h: m(h * 0.5), layer, h)
                else:
                    h = lift(lambda m, h: m(h))(layer, h)
            return h

    return Net(nnx.Rngs(0))


@dataclasses.dataclass
class Case:
    """One front end's model with transformations: ``grads(state) -> (loss, scaled
    grads, stats)`` (jitted), the scaler's initial state, and the fp32 reference."""

    grads: callable
    state: object
    params: object  # what the optimizer state is built for (plain arrays)
    reference: callable  # () -> fp32 gradients (None where not comparable)


def _mean_square(out, tiny=1.0, chunks=None):
    """``mean(out.astype(float32) ** 2) * tiny``; with ``chunks``, computed chunk by chunk
    of the batch in a ``lax.scan`` (each chunk cast to float32 inside the body)."""
    square = lambda o: jnp.mean(o.astype(jnp.float32) ** 2) * tiny  # noqa: E731
    if chunks is None:
        return square(out)
    split = out.reshape(chunks, -1, *out.shape[1:])
    return jax.lax.scan(lambda t, c: (t + square(c), None), 0.0, split)[0] / chunks


def build(front_end, around, inside, dtype, scaler, tiny=1.0, chunks=None) -> Case:
    x = _x(jnp.float32)
    square = functools.partial(_mean_square, tiny=tiny, chunks=chunks)
    if front_end == "jax":
        params, apply = _jax_model(inside, dtype)
        loss = lambda p, x: square(_around(around, functools.partial(apply, p))(x))
        vg = alj.adaptive_value_and_grad(loss)
        state = alj.adaptive_unscale(scaler).init(params)
        grads = jax.jit(lambda s: vg(s, params, x))
        return Case(grads, state, params, lambda: jax.jit(jax.grad(loss))(params, x))
    if front_end == "equinox":
        import equinox as eqx

        from adaloss_jax.equinox import eqx_adaptive_value_and_grad

        net = _equinox_model(inside, dtype)
        loss = lambda m, x: square(_around(around, lambda h: m(h))(x.astype(dtype)))
        params = eqx.filter(net, eqx.is_inexact_array)
        state = alj.adaptive_unscale(scaler).init(params)
        vg = eqx_adaptive_value_and_grad(loss)
        grads = eqx.filter_jit(lambda s: vg(s, net, x))
        return Case(grads, state, params, lambda: eqx.filter_jit(eqx.filter_grad(loss))(net, x))
    if front_end == "linen":
        net = _linen_model(inside, dtype)
        # The untransformed model's parameters (a lifted transform may initialise in
        # another order): the same tree for every variant.
        params = _linen_model("none", dtype).init(jax.random.key(0), x.astype(dtype))["params"]
        loss = lambda p, x: square(_around(around, lambda x: net.apply({"params": p}, x))(
            x.astype(dtype)))
        state = alj.adaptive_unscale(scaler).init(params)
        vg = alj.adaptive_value_and_grad(loss)
        grads = jax.jit(lambda s: vg(s, params, x))
        return Case(grads, state, params, lambda: jax.jit(jax.grad(loss))(params, x))
    from flax import nnx

    from adaloss_jax.flax import nnx_adaptive_value_and_grad

    net = _nnx_model(inside, dtype)
    loss = lambda m, x: square(_nnx_around(around, m, x.astype(dtype)))
    params = nnx.as_pure(nnx.state(net, nnx.Param))
    state = alj.adaptive_unscale(scaler).init(params)
    vg = nnx_adaptive_value_and_grad(loss)

    @nnx.jit
    def grads(s):
        lv, g, stats = vg(s, net, x)
        return lv, nnx.as_pure(g), stats

    return Case(grads, state, params, lambda: nnx.as_pure(nnx.grad(loss)(net, x)))


# ------------------------------------------------------------------------------ checks


def _scales(case, seed):
    rng = np.random.default_rng(seed)
    return {g: int(rng.integers(2, 14)) for g in case.state.groups}


def assert_same_measurements(a, b, what):
    """Decoded statistics equal to the statistic's resolution; gradients to rounding."""
    (la, ga, sa), (lb, gb, sb) = a, b
    assert list(sa.amax) == list(sb.amax), what
    for g in sa.amax:
        x, y = float(sa.amax[g]), float(sb.amax[g])
        assert (x == y == 0) or abs(np.log2(x) - np.log2(y)) < 2**-6, (what, g, x, y)
        assert bool(sa.bad[g]) == bool(sb.bad[g]), (what, g)
    assert bool(sa.nonfinite) == bool(sb.nonfinite)
    np.testing.assert_allclose(la, lb, rtol=1e-3)
    for u, v in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
        u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
        np.testing.assert_allclose(u, v, rtol=2e-2, atol=2e-2 * float(np.max(np.abs(v)) + 1e-30),
                                   err_msg=str(what))


def unscaled_through_optimizer(case, scaler, log2):
    """The gradients at the scales ``log2``, unscaled by ``adaptive_unscale`` (sgd(-1)
    hands them out as the updates), and the scales each group ran at."""
    loss, scaled, stats = _run(case, log2)
    tx = optax.chain(alj.adaptive_unscale(scaler), alj.skip_nonfinite(optax.sgd(-1.0)))
    state = (case.state.with_log2_scales(log2), tx.init(case.params)[1])
    unscaled, new = jax.jit(lambda g, s, st: tx.update(g, s, case.params, loss=loss,
                                                       scale_stats=st))(scaled, state, stats)
    assert bool(new[0].last_applied)
    return unscaled, {g: float(v) for g, v in stats.log2_scales.items()}


def _run(case, log2):
    state = case.state.with_log2_scales(log2)
    return jax.device_get(case.grads(state))


PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(front_end=st.sampled_from(FRONT_ENDS), around=st.sampled_from(AROUND),
       inside=st.sampled_from(INSIDE), groups=st.sampled_from(["module", "global"]),
       seed=st.integers(0, 2**16))
def test_transformed_model_measures_what_its_untransformed_twin_measures(
        front_end, around, inside, groups, seed):
    # At the drawn scales (a transformation that keeps a region from deciding would
    # differ from its twin that decides; test_live: same-step under transformations).
    scaler = alj.adaptive(groups=groups, same_step=False)
    plain = build(front_end, "none", "none", jnp.float16, scaler)
    transformed = build(front_end, around, inside, jnp.float16, scaler)
    log2 = _scales(plain, seed)
    assert_same_measurements(_run(transformed, log2), _run(plain, log2),
                             (front_end, around, inside, groups))


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (drawn
# cases where nothing can decide; test_live.py checks the notice: a scan in a scan)
@PROPERTY
@given(front_end=st.sampled_from(FRONT_ENDS), around=st.sampled_from(AROUND),
       inside=st.sampled_from(INSIDE), same_step=st.booleans(),
       chunks=st.sampled_from([None, 3]), seed=st.integers(0, 2**16))
def test_fp32_gradients_exact_under_arbitrary_per_group_scales(front_end, around, inside,
                                                                 same_step, chunks, seed):
    """Through the whole optimizer: ``adaptive_unscale`` unscales each leaf by the scale
    its group ran at (sgd(-1) hands the unscaled gradients out as the updates), whether
    the scales are the drawn ones (``same_step=False``) or chosen in the pass from them,
    with the loss whole or chunk by chunk in a ``scan`` (its casts measured there)."""
    scaler = alj.adaptive(compute_dtype="float16",  # fp32 models, scaled all the same
                          groups="module", max_rise=1000,  # applied at the drawn scales
                          same_step=same_step)
    case = build(front_end, around, inside, jnp.float32, scaler, chunks=chunks)
    rng = np.random.default_rng(seed)
    log2 = {g: int(rng.integers(-8, 16)) for g in case.state.groups}
    unscaled, used = unscaled_through_optimizer(case, scaler, log2)
    assert len(set(used.values())) > 1  # the groups really run at different scales
    assert_fp32_trees_close(unscaled, case.reference())


@pytest.mark.parametrize("groups", ["module", "global"])
def test_per_example_vmap_at_batch_256_measures_the_batched_amax(groups):
    """The Equinox idiom ``jax.vmap(model)(x)`` with a mean loss: 256 copies of one row
    make every cotangent 256 times (8 binades) smaller than one row alone, and that is
    what each group measures, not the sum of 256 per-example maxima."""
    import equinox as eqx

    from adaloss_jax.equinox import eqx_adaptive_value_and_grad

    mlp = eqx.nn.MLP(D, 4, 16, 2, key=jax.random.key(0), dtype=jnp.float16)
    per_example = lambda m, x: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)
    scaler = alj.adaptive(groups=groups, retries=0)  # one pass at the scales set here
    state = alj.adaptive_unscale(scaler).init(eqx.filter(mlp, eqx.is_inexact_array))
    state = state.with_log2_scales(dict.fromkeys(state.groups, 14))
    grads = eqx.filter_jit(eqx_adaptive_value_and_grad(per_example))
    row = jnp.asarray(np.random.default_rng(1).normal(size=(1, D)), jnp.float16)
    def log2_amax(x):  # at scale 1: a same-step scale follows the cotangent
        stats = grads(state, mlp, x)[2]
        return {g: np.log2(float(stats.amax[g])) - float(stats.log2_scales[g])
                for g in stats.amax}

    one, many = log2_amax(row), log2_amax(jnp.repeat(row, 256, axis=0))
    for g in one:
        drop = one[g] - many[g]
        assert abs(drop - 8) < 0.05, (g, drop)


def scan_twins(dtype):
    """Parameters of 4 stacked layers (one group, ``stack``), and two losses: the layers
    run by ``lax.scan`` and the same layers unrolled."""
    layer = alj.scale_group("stack")(lambda p, h: jnp.tanh(h @ p["w"].astype(h.dtype)))
    params = {"stack": {"w": jax.random.normal(jax.random.key(0), (4, D, D)) / D**0.5}}

    def scanned(p, x):
        h, _ = jax.lax.scan(lambda h, w: (layer({"w": w}, h), None), x.astype(dtype),
                            p["stack"]["w"])
        return jnp.mean(h.astype(jnp.float32) ** 2)

    def unrolled(p, x):
        h = x.astype(dtype)
        for i in range(4):
            h = layer({"w": p["stack"]["w"][i]}, h)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return params, scanned, unrolled


def test_scanned_stack_equals_its_unrolled_twin():
    """Stacked layers run by ``lax.scan`` (a scale per layer) and the same layers
    unrolled (one scale group for the stack's parameters): in global mode the same
    statistics; in fp32 under arbitrary scales, exact gradients both ways."""
    x = _x(jnp.float32)
    params, scanned, unrolled = scan_twins(jnp.float16)
    glob = alj.adaptive(compute_dtype="float16",  # scaled whatever the inputs' dtype
                        groups="global", retries=0)  # one pass at the scales chosen here
    state = alj.adaptive_unscale(glob).init(params).with_log2_scales({"": 12})
    run = lambda f: jax.jit(alj.adaptive_value_and_grad(f))(state, params, x)
    assert_same_measurements(run(scanned), run(unrolled), "scan")
    params, scanned, unrolled = scan_twins(jnp.float32)
    module = alj.adaptive(compute_dtype="float16", groups="module", retries=0,
                          same_step=False)  # at the scales set here (test_live: same-step)
    state = alj.adaptive_unscale(module).init(params)
    # The stack's own scale (unrolled) and its slots, a scale per layer (scanned).
    state = state.with_log2_scales({"": 9, **{g: -5 for g in state.groups if "stack" in g}})
    for f in (scanned, unrolled):
        _, g, _ = jax.jit(alj.adaptive_value_and_grad(f))(state, params, x)
        assert_fp32_trees_close(jax.tree_util.tree_map(lambda a: a * 2.0**5, g),
                                jax.grad(f)(params, x))
