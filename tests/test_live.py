"""Same-step scales (``same_step=True``, ``adaloss_jax._live``): which regions choose
their scale in the backward pass, the choice in closed form, exactness against fp32
under any prior scales, and agreement over devices."""

from __future__ import annotations

import functools
import math
import re

import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _close import assert_fp32_trees_close
from flax import linen as nn
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_adaptive import CASES, _grads_through, _setup
from test_jax_transformations import (
    AROUND,
    FRONT_ENDS,
    INSIDE,
    PROPERTY,
    _around,
    _jax_model,
    _mesh,
    _x,
    build,
    unscaled_through_optimizer,
)
from test_scanned_stacks import _check_twin
from test_scanned_stacks import _losses as _stack_losses
from test_scanned_stacks import _params as _stack_params

import adaloss_jax as alj
from adaloss_jax import _live
from adaloss_jax._layout import Layer, layers
from adaloss_jax._stream import Steps

SLOW = pytest.mark.slow


# ------------------------------------------------------------------ the analysis


def _site(key, x, y):
    return (key, (x, y), x != y)


def _top(*keys, scope=()):
    """``(key, (scope, position))`` of sites in one scope, in forward order."""
    return [(k, (scope, (i,))) for i, k in enumerate(keys)]


def _at(i, scope=()):
    return (scope, (i,))


def test_a_chain_is_live_and_each_decider_needs_the_scale_it_arrives_at():
    # Backward order: head (b) first. a's output point converts from (b,) into (a,).
    every = [_site("a_in", ("a",), ("a",)), _site("a_out", ("a",), ("b",)),
             _site("b_in", ("b",), ("b",)), _site("b_out", ("b",), ("",))]
    live = _live.analyse(every, _top("a_in", "a_out", "b_in", "b_out"), [], _at(0))
    assert live.groups == ("a", "b")
    assert live.deciders == {"a_out": "a", "b_out": "b"}
    assert live.needs == {"a_out": ("b",)}  # its consumer side is b's region


def test_a_fan_in_keeps_the_plan_and_its_exits_get_tokens():
    # q and k read one value (anchors (k, q)); their exits convert into it.
    every = [_site("q_in", ("k", "q"), ("q",)), _site("k_in", ("k", "q"), ("k",)),
             _site("q_out", ("q",), ("",)), _site("k_out", ("k",), ("",))]
    live = _live.analyse(every, _top("q_in", "k_in", "q_out", "k_out"), [], _at(0))
    assert set(live.groups) == {"q", "k"}
    assert live.needs == {"q_in": ("q",), "k_in": ("k",)}


def _scan(keys, top=None, order=(), length=3, reverse=False, at=((), (2,))):
    keys = frozenset(keys)
    return _live.Scan(1, at, length, reverse, keys, keys if top is None else frozenset(top),
                      tuple(order))


_S = Steps([(Layer("s", 0),), (Layer("s", 1),), (Layer("s", 2),)])


@pytest.mark.parametrize("reverse", [False, True])
def test_a_stack_whose_exits_feed_the_next_layer_is_a_chain(reverse):
    # inp -> s[0] -> s[1] -> s[2] -> head, the stack's one converting point its exit.
    nxt = (Steps([(Layer("s", 1),), (Layer("s", 2),), ("head",)]) if not reverse
           else Steps([("head",), (Layer("s", 0),), (Layer("s", 1),)]))
    every = [_site("inp_out", ("inp",), _S[2 if reverse else 0]),
             ("exit", (_S, nxt), True),
             _site("head_out", ("head",), ("",))]
    live = _live.analyse(every, _top("inp_out", "head_out", scope=()), [], None,
                         scans=[_scan({"exit"}, reverse=reverse, at=((), (0, 5)))])
    (chain,) = live.chains.values()
    assert chain.slots == (Layer("s", 0), Layer("s", 1), Layer("s", 2))
    assert chain.first == (2 if reverse else 0) and chain.last == "head"
    assert live.deciders["exit"] == _live.CHAIN_X and live.needs["exit"] == (_live.CHAIN_Y,)
    assert live.needs["inp_out"] == ((_S[2 if reverse else 0])[0],)  # the first layer's
    assert set(live.groups) == {"inp", "head", Layer("s", 0), Layer("s", 1), Layer("s", 2)}


@pytest.mark.parametrize("case", ["two converting points", "exit skips a layer",
                                  "named after the scan", "tied parameter"])
def test_a_stack_that_is_no_chain_keeps_the_plan(case):
    nxt = Steps([(Layer("s", 1),), (Layer("s", 2),), ("head",)])
    every = [_site("inp_out", ("inp",), (Layer("s", 0),)), ("exit", (_S, nxt), True)]
    keys, params = {"exit"}, []
    if case == "two converting points":
        inner = Steps([(s,) for s in layers("t", 3)])
        every.append(("inner", (_S, inner), True))
        keys.add("inner")
    elif case == "exit skips a layer":
        every[1] = ("exit", (_S, Steps([(Layer("s", 2),), (Layer("s", 2),), ("head",)])), True)
    elif case == "named after the scan":
        every.append(_site("after", (Layer("s", 2),), ("",)))
    else:
        params = [((Layer("s", 1),), ("head",))]
    live = _live.analyse(every, _top("inp_out", "after"), params, None,
                         scans=[_scan(keys, at=((), (0, 5)))])
    assert not live.chains and not {Layer("s", 0), Layer("s", 1), Layer("s", 2)} & set(live.groups)


def test_regions_inside_a_layer_decide_as_one_symbol_per_stacked_group():
    # In the body: the residual stream (a fan-in of every layer) -> ln[i] -> fc[i] ->
    # the stream. ln and fc decide per layer; the stream keeps the plan.
    ln, fc = (Steps([(Layer(g, i),) for i in range(3)]) for g in ("ln", "fc"))
    stream = (*layers("fc", 3), *layers("ln", 3))
    every = [("ln_in", (stream, ln), True), ("ln_out", (ln, fc), True),
             ("fc_out", (fc, stream), True)]
    order = [(k, (("scan",), (i,))) for i, k in enumerate(("ln_in", "ln_out", "fc_out"))]
    live = _live.analyse(every, [], [], None, scans=[_scan({k for k, _, _ in every},
                                                          order=order)])
    assert live.layers == {1: {"fc[*]": (Layer("fc", 0), Layer("fc", 1), Layer("fc", 2)),
                               "ln[*]": (Layer("ln", 0), Layer("ln", 1), Layer("ln", 2))}}
    assert live.deciders == {"ln_out": "ln[*]", "fc_out": "fc[*]"}
    assert live.needs == {"ln_in": ("ln[*]",), "ln_out": ("fc[*]",)}
    assert live.names["ln_out"] == ("ln[*]", "fc[*]")
    # A layer's group named outside the body (its parameter converted there) keeps it.
    live = _live.analyse(every, [], [((Layer("fc", 1),), ("",))], None,
                         scans=[_scan({k for k, _, _ in every}, order=order)])
    assert live.layers == {1: {"ln[*]": (Layer("ln", 0), Layer("ln", 1), Layer("ln", 2))}}


@pytest.mark.parametrize("case", ["two entries at once", "border after the decider",
                                  "border nested", "border in another scope", "met twice",
                                  "per layer", "root", "stacked"])
def test_regions_the_backward_pass_cannot_decide_keep_the_plan(case):
    every = [_site("g_in", ("g",), ("g",)), _site("g_out", ("g",), ("",))]
    top = _top("g_in", "g_out")
    stacked = frozenset()
    if case == "two entries at once":  # two outputs of one call, to two regions
        every.append(_site("g_out2", ("g",), ("h",)))
        top.append(("g_out2", _at(1)))
    elif case == "border after the decider":
        every.append(_site("late", ("x", "y"), ("g",)))
        top.append(("late", _at(5)))
    elif case == "border nested":  # a border point inside a scan or shard_map
        every.append(_site("inner", ("x", "y"), ("g",)))
    elif case == "border in another scope":  # inside a checkpoint the decider is not in
        every.append(_site("inner", ("x", "y"), ("g",)))
        top.append(("inner", _at(0, scope=((7, 0),))))
    elif case == "met twice":  # the decider in a jaxpr evaluated twice
        every.append(_site("g_out", ("g",), ("",)))
    elif case == "per layer":
        every.append(_site("scan", Steps([("g",), ("h",)]), ("h",)))
    elif case == "root":
        every = [_site("r_out", ("",), ("h",))]
        top = _top("r_out")
    else:
        stacked = frozenset({"g"})
    assert _live.analyse(every, top, [], _at(0), stacked).groups == ()


def test_a_module_called_twice_is_decided_at_its_second_call():
    every = [_site("c1_out", ("g",), ("h",)), _site("c2_out", ("g",), ("",))]
    live = _live.analyse(every, _top("c1_out", "c2_out"), [], _at(0))
    assert live.deciders == {"c2_out": "g"}
    assert live.needs == {"c1_out": ("g",)}


def test_a_tied_parameter_conversion_is_a_border_point():
    every = [_site("e_out", ("e",), ("",))]
    top = [("e_out", _at(3))]
    live = _live.analyse(every, top, [None, (("e",), ("",))], params_order=_at(0))
    assert live.groups == ("e",)
    assert live.needs == {(_live.PARAMS_KEY, 1): ("e",)}
    # A parameter point evaluated after the decider, or in another scope, cannot get it.
    pairs = [None, (("e",), ("",))]
    assert _live.analyse(every, top, pairs, params_order=_at(9)).groups == ()
    assert _live.analyse(every, top, pairs, params_order=_at(0, ((1, 0),))).groups == ()
    assert _live.analyse(every, top, pairs, params_order=None).groups == ()


# ------------------------------------------------------------ the choice, in closed form


_d1 = alj.scale_group("d1")(lambda p, x: x @ p["w"])
_d2 = alj.scale_group("d2")(lambda p, x: x @ p["w"])
_W1 = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
_W2 = np.random.default_rng(1).normal(size=(6, 3)).astype(np.float32) * 2.0**-9
_C = np.random.default_rng(2).normal(size=(5, 3)).astype(np.float32) * 2.0**-13
_X = np.random.default_rng(3).normal(size=(5, 4)).astype(np.float32)


def _chain_loss(p, x, y=None):
    del y
    return jnp.sum(_d2(p["d2"], _d1(p["d1"], x)) * _C)


_Y = jnp.zeros(())  # (the shared step's label argument, unused here)


def _chain(log2=None, **options):
    params = {"d1": {"w": jnp.asarray(_W1)}, "d2": {"w": jnp.asarray(_W2)}}
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0, **options)
    step, state = _grads_through(scaler, _chain_loss, params, (jnp.asarray(_X),), log2)
    return params, step, state


def _target(a, margin=4):
    return math.floor(math.log2(65504.0) - margin - math.log2(a))


def _first(a, rows=_X.shape[0]):
    """A first choice (nothing measured inside the module yet): the target, less the
    binades of a sum over ``rows`` (``_grads_through`` sets ``max_rise``, which caps
    them, to 1000)."""
    return _target(a) - math.ceil(math.log2(rows))


def test_each_module_takes_the_scale_its_arriving_cotangent_calls_for():
    """d2's output cotangent is ``_C * 2**root``, d1's is ``_C @ W2.T`` at d2's chosen
    scale: each decider puts its own ``margin`` binades below fp16's max, whatever the
    prior scales (here far too low and far too high). Nothing was measured inside the
    modules yet, so each keeps ``ceil(log2 5)`` binades for its kernel gradient's sum
    over the 5 rows."""
    params, step, state = _chain({"": 3, "d1": -20, "d2": 30})
    got, new_state, stats = step(state, params, jnp.asarray(_X), _Y)
    s2 = _first(np.abs(_C).max())
    s1 = _first(np.abs(_C @ _W2.T).max())
    assert float(stats.log2_scales["d2"]) == s2
    assert float(stats.log2_scales["d1"]) == s1
    assert float(stats.log2_scales[""]) == 3.0
    assert bool(new_state[0].last_applied)
    assert_fp32_trees_close(got, jax.grad(_chain_loss)(params, jnp.asarray(_X)))


def test_the_choice_never_rises_above_the_rules_scale_once_measured():
    """A measured group's prior (its scale from the rule) caps the choice: it holds the
    growth inside the module seen so far, and a back-off after an overflow."""
    params, step, state = _chain()
    _, state, _ = step(state, params, jnp.asarray(_X), _Y)  # measured once
    ad = state[0]
    low = ad.with_log2_scales({"d1": 2, "d2": 5})
    _, _, stats = step((low, state[1]), params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == 2.0
    assert float(stats.log2_scales["d2"]) == 5.0
    # And learned headroom lowers it below what the cotangent calls for.
    roomy = ad.replace(headroom=alj.GroupVector(ad.groups, jnp.array([0.0, 0.0, 2.5])))
    _, _, stats = step((roomy, state[1]), params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d2"]) == min(_target(np.abs(_C).max()) - 3,
                                                 float(ad.log2_scales["d2"]))


def test_after_an_overflow_before_any_measurement_the_back_off_caps_the_choice():
    """A group whose first pass overflowed (inside the module: its parameter
    gradients) has no measured peak yet; its back-off still caps the choice, or the
    decider would choose the overflowing scale again on every pass."""
    params, step, state = _chain()
    ad = state[0].with_log2_scales({"d2": 5})
    flags = jnp.array([False, False, True])
    ad = ad.replace(overflowed=alj.GroupVector(ad.groups, flags))
    assert float(ad.log2_amax["d2"]) == -math.inf
    _, _, stats = step((ad, state[1]), params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d2"]) == 5.0


SAME_STEP = alj.adaptive(groups="module", same_step=True, max_rise=1000, retries=0,
                         compute_dtype="float16")


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("residual,remat", [(False, False), (True, False), (False, True)])
def test_a_scanned_stack_chooses_each_layers_scale_as_its_unrolled_twin(
        reverse, residual, remat):
    """A stack scanned as a chain (:class:`~adaloss_jax._live.Chain`: each layer's exit
    converts into the next layer) decides each layer at its exit from the cotangent in
    hand, the next layer's choice reaching it through the scan's carry: its scales,
    statistics and gradients are its unrolled twin's, whatever the prior scales, and
    unscale to fp32's; also where each layer adds its input back (the fan-in is inside
    the layer). A layer under remat (its exit in a scope of its own) keeps the plan, and
    so does its twin's."""
    _check_twin(3, residual, reverse, False, remat, [0, 3, -2, 9, 1, 5], SAME_STEP)


@SLOW
@PROPERTY
@given(depth=st.integers(2, 4), residual=st.booleans(), reverse=st.booleans(),
       remat=st.booleans(), data=st.data())
def test_a_scanned_stack_chooses_as_its_unrolled_twin_under_any_prior(depth, residual,
                                                                     reverse, remat, data):
    """The fixed cases above over depths, directions and priors drawn at random."""
    log2 = data.draw(st.lists(st.integers(-8, 15), min_size=depth + 3, max_size=depth + 3))
    _check_twin(depth, residual, reverse, False, remat, log2, SAME_STEP)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_stack_whose_every_output_is_read_keeps_the_plan_and_stays_exact(reverse):
    """Every layer's output also reaches the loss (stacked along the scan): no chain,
    so the stack keeps the plan, and its gradients are still exactly fp32's."""
    (tx, scanned), _, grad = _stack_losses(3, False, reverse, True, jnp.float32, False,
                                           SAME_STEP)
    p = _stack_params(3)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    state = tx.init(p).with_log2_scales({"stack[0]": 3, "stack[1]": -2, "stack[2]": 9})
    u, stats, _ = scanned(state, p, x)
    for i, want in enumerate((3, -2, 9)):
        assert float(stats.log2_scales[f"stack[{i}]"]) == want
    assert_fp32_trees_close(u, grad(p, x))


def test_a_chain_decides_every_layer_and_the_stacks_consumer():
    """From the default initial scales, every layer of the chain and the head after it
    move to the scale their cotangents call for in the first step."""
    (tx, scanned), _, _ = _stack_losses(3, False, False, False, jnp.float32, False,
                                        SAME_STEP)
    p = _stack_params(3)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    state = tx.init(p)
    _, stats, _ = scanned(state, p, x)
    moved = {g for g in stats.log2_scales
             if float(stats.log2_scales[g]) != float(state.log2_scales[g])}
    assert moved >= {"stack[0]", "stack[1]", "stack[2]", "head"}, moved


_STACK_AROUND = {
    "none": lambda f: f,
    "jit": jax.jit,
    "remat": jax.checkpoint,
    "cond": lambda f: lambda p, x, y=None: jax.lax.cond(
        jnp.sum(x.astype(jnp.float32)) > -1e9, f, lambda p, x: 0.0 * f(p, x), p, x),
    "vmap": lambda f: lambda p, x, y=None: jnp.mean(jax.vmap(
        lambda xi: f(p, xi[None]))(x)),
}


@pytest.mark.parametrize("around", list(_STACK_AROUND))
def test_a_scanned_chain_decides_under_transformations_of_the_loss(around):
    """A chain under a transformation of the whole loss (its scan then inside a
    ``jit``, a ``checkpoint`` body, a ``cond`` branch or a ``vmap``): exact fp32
    gradients under any prior, and every layer decides. Inside a ``cond`` branch a stack
    gets no scale per layer yet (one scale for the stack, as before same-step)."""
    from test_scanned_stacks import _layer_fn

    dense = alj.scale_group("inp")(lambda w, x: x @ w["kernel"])
    head = alj.scale_group("head")(lambda w, x: x @ w["kernel"])
    stacked = alj.scale_group("stack")(_layer_fn(False))

    def loss(p, x):
        h = dense(p["inp"], x)
        h, _ = jax.lax.scan(lambda c, w: (stacked(w, c), None), h, p["stack"])
        return jnp.sum(head(p["head"], h) ** 2) * 2.0**-12

    wrapped = _STACK_AROUND[around](loss)
    p = _stack_params(3)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    step, state = _grads_through(SAME_STEP, lambda p, x, y=None: wrapped(p, x), p, (x,))
    prior = {"stack[0]": 5, "stack[1]": -3, "stack[2]": 9}
    state = (state[0].with_log2_scales(prior), state[1])
    got, _, stats = step(state, p, x, _Y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(wrapped))(p, x))
    if around == "cond":  # a stack inside a cond branch gets no slots (one scale)
        assert "stack[0]" not in stats.log2_scales
        return
    for g, s in prior.items():
        assert float(stats.log2_scales[g]) != s, (g, around)


@functools.cache
def _gpt_twins():
    """The bench's byte GPT (3 pre-LN blocks, fp32) with its blocks unrolled and in one
    ``nn.scan``, with the same weights."""
    from adaloss_jax.bench._models import GPT

    kw = dict(layers=3, d_model=16, heads=2, context=8, dtype=jnp.float32)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, 256)
    unrolled, scanned = GPT(**kw), GPT(**kw, scan=True)
    pu = unrolled.init(jax.random.key(0), tokens[:, :-1])["params"]
    ps = {k: v for k, v in pu.items() if not k.startswith("block_")}
    ps["blocks"] = {"layer": jax.tree_util.tree_map(
        lambda *a: jnp.stack(a), *[pu[f"block_{i}"] for i in range(3)])}

    def loss(model):
        def fn(p, t, y=None):
            del y
            logits = model.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()
        return fn

    return (loss(unrolled), pu), (loss(scanned), ps), tokens


def test_a_scanned_transformer_decides_inside_each_block_as_its_unrolled_twin():
    """Regions inside one layer of a scanned stack (a block's attention and MLP
    sub-modules and norms, between the residual stream's fan-ins) decide in the scan's
    body, a scale per layer: the same scales as the unrolled blocks', whatever the
    prior scales, and exact fp32 gradients."""
    (lu, pu), (ls, ps), tokens = _gpt_twins()
    rng = np.random.default_rng(7)
    runs = {}
    for name, loss, p in (("unrolled", lu, pu), ("scanned", ls, ps)):
        step, state = _grads_through(SAME_STEP, loss, p, (tokens,))
        ad = state[0]
        prior = {g: int(rng.integers(-6, 7)) for g in ad.log2_scales}
        state = (ad.with_log2_scales(prior), state[1])
        got, _, stats = step(state, p, tokens, _Y)
        assert_fp32_trees_close(got, jax.jit(jax.grad(loss))(p, tokens))
        runs[name] = (stats, prior)
    (su, _), (ss, prior_s) = runs["unrolled"], runs["scanned"]
    inside = ("attn/qkv", "attn/proj", "mlp/fc1", "mlp/fc2", "ln1", "ln2")
    for i in range(3):
        for m in inside:
            a = float(ss.log2_scales[f"blocks/layer/{m}[{i}]"])
            b = float(su.log2_scales[f"block_{i}/{m}"])
            assert a == b, (m, i, a, b)
    moved = [g for g in prior_s if g.startswith("blocks/") and g.endswith("]")
             and float(ss.log2_scales[g]) != prior_s[g]]
    assert len(moved) == 3 * len(inside), moved  # every layer's every region decided


@functools.cache
def _compiled_text(depth: int, same_step: bool) -> str:
    """The optimized HLO of one jitted same-step (or delayed) step of a chain of
    ``depth`` fp16 modules, each a live region."""
    layers = [alj.scale_group(f"l{i}")(lambda p, x: jnp.tanh(x @ p["w"]))
              for i in range(depth)]

    def loss(p, x):
        for i, layer in enumerate(layers):
            x = layer(p[f"l{i}"], x)
        return jnp.sum(x.astype(jnp.float32))

    params = {f"l{i}": {"w": jnp.eye(4, dtype=jnp.float16)} for i in range(depth)}
    scaler = alj.adaptive(groups="module", same_step=same_step, retries=0)
    tx = optax.chain(alj.adaptive_unscale(scaler), optax.sgd(0.1))

    def step(state, p, x):
        value, grads, stats = alj.adaptive_value_and_grad(loss)(state, p, x)
        return tx.update(grads, state, p, loss=value, scale_stats=stats)

    x = jnp.ones((2, 4), jnp.float16)
    return jax.jit(step).lower(tx.init(params), params, x).compile().as_text()


def _hlo_size(depth: int, same_step: bool) -> int:
    return sum(" = " in line for line in _compiled_text(depth, same_step).splitlines())


def _distinct_kernels(depth: int, same_step: bool) -> int:
    """The distinct bodies among the fused kernels of :func:`_compiled_text` (names
    and metadata aside): what XLA's CPU backend compiles, each once."""
    blocks = {}
    for block in _compiled_text(depth, same_step).split("\n\n"):
        head, _, body = block.strip().partition("\n")
        blocks[head.split(" ")[0].lstrip("%")] = body
    called = re.findall(r"kind=\w+, calls=%?([\w.\-]+)", _compiled_text(depth, same_step))

    def canonical(body: str) -> str:
        body = re.sub(r", metadata=\{[^}]*\}", "", body)
        names: dict = {}
        return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%{len(names)}"),
                      body)

    return len({canonical(blocks[c]) for c in called})


def test_a_chosen_scale_is_computed_once_not_copied_into_every_kernel_that_reads_it():
    """Each decider's choice depends on the choice of the region downstream (the scale
    its cotangent arrives at): were that scalar chain fused into every kernel that
    converts or unscales by it, the compiled program (and XLA's compile time) would grow
    with depth squared. Each choice is materialized once (a conditional: measured or
    planned), so a same-step step grows linearly with depth, by a bounded multiple of
    what each layer adds under the delayed rule."""
    same = [_hlo_size(d, True) for d in (6, 12, 18)]
    delayed = _hlo_size(12, False) - _hlo_size(6, False)
    assert same[2] - same[1] <= 1.1 * (same[1] - same[0]), same  # linear in depth
    assert same[1] - same[0] <= 2 * delayed, (same, delayed)


def test_each_live_region_adds_at_most_one_distinct_kernel_to_the_delayed_rules():
    """XLA's CPU backend compiles each distinct fused kernel body once, and a slice's
    index makes its body distinct: a group's value read out of a vector is a kernel of
    its own per group. Each decider reads its bounds (headroom, prior, plan) as one slice
    of one table, and the difference from the plan is its conditional's output, so no
    kernel downstream reads a group's slice: a live region adds at most one distinct
    kernel to what a module adds under the delayed rule."""
    same = _distinct_kernels(12, True) - _distinct_kernels(6, True)
    delayed = _distinct_kernels(12, False) - _distinct_kernels(6, False)
    assert same <= delayed + 6, (same, delayed)


def test_same_step_off_keeps_the_prior_scales():
    params = {"d1": {"w": jnp.asarray(_W1)}, "d2": {"w": jnp.asarray(_W2)}}
    scaler = alj.adaptive(groups="module", compute_dtype="float16", retries=0,
                          same_step=False)
    step, state = _grads_through(scaler, _chain_loss, params, (jnp.asarray(_X),),
                                 {"": 3, "d1": -20, "d2": 30})
    _, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == -20.0


# ------------------------------------------------------------- exact against fp32


@pytest.mark.parametrize("name", [n if n in ("mlp", "resnet") else pytest.param(n, marks=SLOW)
                                  for n in CASES])
def test_fp32_model_exact_under_same_step_scales(name):
    """Whatever the prior scales, the live regions' choices and the tokens that carry
    them leave the fp32 gradient unchanged (residuals, concat skips, tied embedding,
    reused block, q/k/v fan-in, recurrent cell, scanned stack)."""
    _, params, loss_fn, batch = _setup(name, jnp.float32)
    scaler = alj.adaptive(compute_dtype="float16", groups="module", same_step=True)
    groups = alj.param_groups(params, scaler)
    rng = np.random.default_rng(3)
    log2 = {g: int(rng.integers(-8, 16)) for g in groups}
    step, state = _grads_through(scaler, loss_fn, params, batch, log2)
    got, new_state, stats = step(state, params, *batch)
    _, program, _ = alj._grad.trace(loss_fn, scaler, params, batch, {})
    assert program.live.groups  # some regions chose their own scales
    assert any(float(stats.log2_scales[g]) != log2[g] for g in program.live.groups)
    assert bool(new_state[0].base.last_applied)
    assert_fp32_trees_close(got, jax.grad(loss_fn)(params, *batch))


@pytest.mark.parametrize("wrap", ["checkpoint", "jit"])
def test_a_checkpoint_or_jit_of_the_loss_decides_inside_and_stays_exact(wrap):
    """A checkpointed loss is one scope (its points and their tokens inside it); a
    nested jit is inlined: either way each module decides, in closed form."""
    params, _, _ = _chain()
    inner = lambda p, x: _chain_loss(p, x)  # noqa: E731
    fn = jax.checkpoint(inner) if wrap == "checkpoint" else jax.jit(inner)
    loss = lambda p, x, y=None: fn(p, x)  # noqa: E731
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (jnp.asarray(_X),), {})
    assert program.live.groups == ("d1", "d2")
    step, state = _grads_through(scaler, loss, params, (jnp.asarray(_X),),
                                 {"": 3, "d1": 5, "d2": 12})
    got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == _first(np.abs(_C @ _W2.T).max())
    assert_fp32_trees_close(got, jax.grad(_chain_loss)(params, jnp.asarray(_X)))


class _Lender(nn.Module):
    """Owns two parameters and reads one: the other is read by a sibling."""

    def setup(self):
        self.own = self.param("own", nn.initializers.normal(0.5), (6, 6))
        self.lent = self.param("lent", nn.initializers.normal(0.5), (6, 6))

    def __call__(self, x):
        return jnp.tanh(x @ self.own.astype(x.dtype))


class _Borrower(nn.Module):
    @nn.compact
    def __call__(self, x, w):
        b = self.param("b", nn.initializers.normal(0.1), (6,))
        return jnp.tanh(x @ w.astype(x.dtype) + b.astype(x.dtype))


class _Lending(nn.Module):
    @nn.compact
    def __call__(self, x):
        lender = _Lender()
        h = lender(x)
        return nn.Dense(3)(_Borrower()(h, lender.lent))


def test_a_parameter_read_by_another_module_is_converted_at_its_owners_choice():
    """A module's parameter read only by a sibling module (not by its owner) reaches the
    sibling's region at its owner's scale: when the owner's region chooses its scale in
    the backward pass, that parameter's conversion takes the choice by token, and the
    gradient stays exact in fp32 whatever the prior scales."""
    model = _Lending()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 6)), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def loss(p, x, y=None):
        return jnp.sum(model.apply({"params": p}, x) * jnp.arange(3.0))

    scaler = alj.adaptive(groups="module", compute_dtype="float16", retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (x,), {})
    lent = [i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(params))
            if "lent" in jax.tree_util.keystr(path)]
    assert program.live.needs.get((_live.PARAMS_KEY, *lent)) == ("_Lender_0",)
    prior = {"": 2, "_Lender_0": -6, "_Borrower_0": 9, "Dense_0": 4}
    step, state = _grads_through(scaler, loss, params, (x,), {
        g: prior.get(g, 0) for g in alj.param_groups(params, scaler)})
    got, new_state, stats = step(state, params, x, jnp.zeros(()))
    assert bool(new_state[0].base.last_applied)
    assert float(stats.log2_scales["_Lender_0"]) != prior["_Lender_0"]  # chosen here
    assert_fp32_trees_close(got, jax.grad(loss)(params, x))


def test_a_scan_of_the_loss_keeps_the_plan_and_stays_exact():
    """Inside a scan a point's backward pass runs once per iteration, and a module's
    parameters are shared by them all: it keeps the rule's scale."""
    params, _, _ = _chain()

    def loss(p, x, y=None):
        def body(c, xi):
            return c + _chain_loss(p, xi[None].repeat(5, 0)) / 5, None
        return jax.lax.scan(body, 0.0, x)[0]

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (jnp.asarray(_X),), {})
    assert program.live.groups == ()
    step, state = _grads_through(scaler, loss, params, (jnp.asarray(_X),),
                                 {"": 3, "d1": 5, "d2": 12})
    alj._common._NOTICED.discard("same-step-none")
    with pytest.warns(UserWarning, match="no module's region of this loss can choose"):
        got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d1"]) == 5.0
    assert_fp32_trees_close(got, jax.grad(loss)(params, jnp.asarray(_X)))


def test_a_vmap_inside_the_loss_decides_on_the_whole_batch():
    """A per-example loss under vmap: the decider sees the batched cotangent, so its
    choice is the batch's (the largest example's), its first reserve that of a sum over
    the batch (the kernel's gradient is one), and the gradient stays exact."""
    params, _, _ = _chain()

    def per_example(p, x, y=None):
        return jnp.sum(jax.vmap(lambda xi: _d2(p["d2"], _d1(p["d1"], xi)))(x) * _C)

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    step, state = _grads_through(scaler, per_example, params, (jnp.asarray(_X),),
                                 {"": 0, "d1": 0, "d2": 0})
    got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["d2"]) == _first(np.abs(_C).max())
    assert_fp32_trees_close(got, jax.grad(_chain_loss)(params, jnp.asarray(_X)))


# -------------------------------------------------------------------- devices


def _square_loss(p, x):  # (a cotangent that grows with the input)
    return jnp.sum(_d2(p["d2"], _d1(p["d1"], x)) ** 2) * 2.0**-10


@functools.cache
def _mapped(mesh, check_vma, axis_name):
    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    tx = alj.adaptive_unscale(scaler, axis_name=axis_name)

    def local(params, state, x):
        _, grads, stats = alj.adaptive_value_and_grad(_square_loss)(state, params, x)
        return jax.tree_util.tree_map(lambda a: a[None], stats.log2_scales)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P("data"),
                      check_vma=check_vma)
    return tx, jax.jit(f)


@pytest.mark.parametrize("check_vma,axis_name", [(True, None), (False, "data")],
                         ids=["typed", "untyped-axis_name"])
def test_devices_choose_one_scale_for_the_gradients_they_share(mesh, check_vma, axis_name):
    """Each device's shard of the batch is 2**d larger: the deciders take their amax
    over the devices (one scalar all-reduce each), so every device uses the scale the
    whole batch calls for, the one a single device picks."""
    params, _, _ = _chain()
    n = mesh.devices.size
    x = np.repeat(_X[:1], 2 * n, axis=0) * np.repeat(2.0 ** np.arange(n), 2)[:, None]
    tx, f = _mapped(mesh, check_vma, axis_name)
    state = tx.init(params)
    rep = NamedSharding(mesh, P())
    out = f(jax.device_put(params, rep), jax.device_put(state, rep),
            jax.device_put(x.astype(np.float32), NamedSharding(mesh, P("data"))))
    for g in ("d1", "d2"):
        v = np.asarray(out[g])
        assert np.all(v == v[0]), (g, v)
    single = jax.jit(alj.adaptive_value_and_grad(_square_loss))(
        state, params, jnp.asarray(x[-2:], jnp.float32))[2]  # the largest shard alone
    for g in ("d1", "d2"):
        assert float(np.asarray(out[g])[0]) == float(single.log2_scales[g]), g



class _Outer(nn.Module):
    """A module with a parameter of its own and a child (linen names it Outer_0/Dense_0)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(1.0), (x.shape[-1], 6))
        h = jnp.tanh(nn.Dense(6)(jnp.tanh(x @ w)))
        return h @ self.param("v", nn.initializers.normal(1.0), (6, 3))


class _Wrapped(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _Outer()(x)


def test_a_child_inside_a_live_parent_converts_between_two_chosen_scales():
    """The child's input point sits between the parent's region and the child's: both
    scales are chosen later in the forward order than it, and it receives both through
    tokens; the gradient stays exact."""
    model = _Wrapped()
    params = model.init(jax.random.key(0), jnp.asarray(_X))["params"]

    def loss(p, x, y=None):
        return jnp.sum(model.apply({"params": p}, x) * _C)

    scaler = alj.adaptive(groups="module", compute_dtype="float16", same_step=True,
                          retries=0)
    _, program, _ = alj._grad.trace(loss, scaler, params, (jnp.asarray(_X),), {})
    assert set(program.live.groups) == {"_Outer_0", "_Outer_0/Dense_0"}
    assert any(len(n) == 2 for n in program.live.needs.values())  # both sides by token
    step, state = _grads_through(scaler, loss, params, (jnp.asarray(_X),),
                                 {"": 2, "_Outer_0": -3, "_Outer_0/Dense_0": 9})
    got, _, stats = step(state, params, jnp.asarray(_X), _Y)
    assert float(stats.log2_scales["_Outer_0"]) == _first(np.abs(_C).max())
    assert_fp32_trees_close(got, jax.grad(loss)(params, jnp.asarray(_X)))


# ------------------------------------------- one global scale that cannot hold the span


_LAYERS = [alj.scale_group(f"l{i}")(lambda p, x: jax.nn.sigmoid(x @ p["w"]))
           for i in range(10)]


def _deep_loss(p, x, y=None):
    for i, layer in enumerate(_LAYERS):
        x = layer(p[f"l{i}"], x)
    return jnp.sum(x)


@functools.cache
def _deep_health(groups, grad_dtype):
    rng = np.random.default_rng(7)
    params = {f"l{i}": {"w": jnp.asarray(rng.normal(size=(16, 16)) * 0.3, jnp.float32)}
              for i in range(10)}
    scaler = alj.adaptive(groups=groups, grad_dtype=grad_dtype, simulate=True,
                          compute_dtype="float16")
    tx = alj.adaptive_unscale(scaler)
    state = tx.init(params)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    grad_fn, update = jax.jit(alj.adaptive_value_and_grad(_deep_loss)), jax.jit(tx.update)
    for _ in range(2):  # (the first step runs at scale 1, below where the top allows)
        _, grads, stats = grad_fn(state, params, x)
        _, state = update(grads, state, params, scale_stats=stats)
    return bool(stats.flushed), alj.diagnostics.check_health(state, warn=False)


def test_one_global_scale_that_cannot_hold_the_span_says_module_groups_are_the_fix():
    """Sigmoid shrinks the cotangent about 2 binades a layer: at the one scale e4m3's
    max allows for the top layers, the lowest layers' cotangents flush entirely, and the
    health check says (once, as a warning) that per-module scales are the fix; e5m2's
    32 binades hold the spread, and per module every group has its own scale."""
    flushed, msgs = _deep_health("global", "float8_e4m3fn")
    assert flushed
    assert len(msgs) == 1 and "groups='module'" in msgs[0]
    assert _deep_health("global", "float8_e5m2") == (False, [])
    assert _deep_health("module", "float8_e4m3fn") == (False, [])


# ------------------------------------------------ every front end and transformation


@pytest.mark.filterwarnings("ignore:adaloss_jax. same-step scales .same_step, on by")  # (drawn
# cases where nothing can decide: a shard_map around the model, a cond inside it)
@SLOW  # (its fixed siblings in the fast tier: the model cases above, checkpoint, jit, vmap)
@PROPERTY
@given(front_end=st.sampled_from(FRONT_ENDS), around=st.sampled_from(AROUND),
       inside=st.sampled_from(INSIDE), seed=st.integers(0, 2**16))
@example(front_end="linen", around="none", inside="none", seed=0)
def test_fp32_gradients_exact_under_same_step_scales_and_transformations(
        front_end, around, inside, seed):
    """Whatever the prior scales, front end and transformation around and inside the
    model: the regions that decide in the backward pass, those that keep the plan, and
    the tokens between them leave the fp32 gradient unchanged."""
    scaler = alj.adaptive(compute_dtype="float16", groups="module", max_rise=1000,
                          same_step=True)
    case = build(front_end, around, inside, jnp.float32, scaler)
    rng = np.random.default_rng(seed)
    log2 = {g: int(rng.integers(-8, 16)) for g in case.state.groups}
    unscaled, _ = unscaled_through_optimizer(case, scaler, log2)
    assert_fp32_trees_close(unscaled, case.reference())


class _DeadBranch(nn.Module):
    @nn.compact
    def __call__(self, x):
        nn.Dense(4, name="dead", dtype=jnp.float16)(x)  # its output reaches nothing
        h = jnp.tanh(nn.Dense(4, name="first", dtype=jnp.float16)(x))
        return nn.Dense(2, name="last", dtype=jnp.float16)(h)


def test_a_module_whose_output_reaches_nothing_keeps_its_planned_scale():
    """A decider the backward pass never reaches (its module's output unused): its region
    stays at the plan's scale, as the other points of the region read it, and the steps
    after the first are applied (found by the random NNX graphs: a dead region reported
    at scale 1 made the rule skip every step, asking for the plan it never got)."""
    model = _DeadBranch()
    x = jax.random.normal(jax.random.key(0), (8, 4))
    params = model.init(jax.random.key(1), x)["params"]

    def loss_fn(p, x, y):
        out = model.apply({"params": p}, x).astype(jnp.float32)
        return jnp.mean((out - y) ** 2) * 2.0**-16

    step, state = _grads_through(alj.adaptive(groups="module", retries=0), loss_fn, params,
                                 (x,))
    y = jnp.zeros((8, 2))
    applied = []
    for _ in range(3):
        planned = float(state[0].log2_scales["dead"])
        grads, state, stats = step(state, params, x, y)
        applied.append(bool(state[0].last_applied))
        assert float(stats.log2_scales["dead"]) == planned
        assert float(stats.log2_scales["first"]) > 0  # the live groups decide
    assert applied[1:] == [True, True]  # (step 0 ran at scale 1: the root's far below)
    assert not np.any(np.asarray(grads["dead"]["kernel"]))
    ref = jax.grad(loss_fn)(params, x, y)
    assert_fp32_trees_close(grads["first"], ref["first"], rtol=2e-2)


# ------------------------------------------------- warm-up from the initial scale, no retries


class _AttnBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=jnp.float16)(x)
        h = nn.LayerNorm(dtype=jnp.float16)(x)
        q, k, v = jnp.split(nn.Dense(24, dtype=jnp.float16)(h), 3, -1)
        s = (q @ k.swapaxes(-1, -2)).astype(jnp.float32) / jnp.sqrt(8.0)
        x = x + nn.Dense(8, dtype=jnp.float16)(jax.nn.softmax(s).astype(jnp.float16) @ v)
        return nn.Dense(10, dtype=jnp.float16)(x)


def _warm_up_skips(model, x, y, grad_dtype, steps=5, loss_scale=1.0, **options):
    """The steps skipped from the initial scale with nothing moving (SGD(0)), the rule
    alone (``retries=0``)."""
    from adaloss_jax.flax import TrainState, linen_train_step

    params = model.init(jax.random.key(2), x)["params"]

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * loss_scale

    scaler = alj.adaptive(groups="module", grad_dtype=grad_dtype, retries=0,
                          simulate=grad_dtype != "float16", **options)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    step = jax.jit(lambda s: linen_train_step(s, loss_fn, x, y))
    skipped = []
    for i in range(steps):
        state, _ = step(state)
        if not bool(alj.scale_state(state).last_applied):
            skipped.append(i)
    return skipped


def test_an_attention_block_keeps_room_for_its_kernel_sums_and_skips_nothing():
    """fp16, 512 x 8 tokens: the first choice of each Dense's scale comes from its
    output cotangent, and its kernel gradient sums 4096 rows of it; without the first
    choice's reserve, that sum overflowed and the step was skipped. From fp16's start
    nothing is skipped; from scale 1 (the root far below its scale) step 0 alone, with
    the reserve capped at 5 binades as well (without the reserve, step 1 was skipped
    too)."""
    x = jax.random.normal(jax.random.key(0), (512, 8, 16))
    y = jax.random.randint(jax.random.key(1), (512, 8), 0, 10)
    assert _warm_up_skips(_AttnBlock(), x, y, "float16") == []
    assert _warm_up_skips(_AttnBlock(), x, y, "float16", initial_scale=1.0,
                          max_rise=5) == [0]


def test_a_scanned_gpt_whose_cotangents_flush_in_e4m3_skips_only_step_0():
    """The bench's byte GPT, one scanned block, e4m3 cotangents: at step 0's scales
    cotangents on their way into some groups flush entirely, so those groups' statistics
    miss their largest values; the rule caps their rise at the jump that cannot overflow
    what was lost (without the cap, steps after 0 overflowed and were skipped)."""
    from adaloss_jax.bench._models import GPT

    tokens = jax.random.randint(jax.random.key(0), (16, 64), 0, 256)
    skipped = _warm_up_skips(GPT(layers=1, scan=True), tokens[:, :-1], tokens[:, 1:],
                             "float8_e4m3fn")
    assert skipped == [0]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_a_gpt_whose_logits_cotangent_flushes_at_the_cast_skips_only_step_0(scan):
    """The bench's byte GPT (one block, tied head) in e4m3 with its loss x 2^-20, as in
    the bench's tiny regime: at step 0 the logits' cotangent flushes where the loss casts
    it down, so every module receives zeros and the root, measured only on the cast's
    float32 side, is starved (what reached the embedding's end of its region was lost).
    Its jump lands that measured value at e4m3's smallest normal, leaving the range above
    for the tied head's kernel gradient (13 binades larger: a sum over 1024 tokens), so
    step 1 is applied; jumping by the blind jump alone, the cast flushed it again and
    step 1 was skipped too. Every group downstream received only zeros, computed from
    that value: each starts where it too would land at the smallest normal (the scanned
    stack's final LayerNorm, which cannot choose its scale in the backward pass, was
    left at the blind jump, its cotangent flushed at step 1 again)."""
    from adaloss_jax.bench._models import GPT

    tokens = jax.random.randint(jax.random.key(0), (16, 65), 0, 256)
    skipped = _warm_up_skips(GPT(layers=1, d_model=64, heads=4, context=64, scan=scan),
                             tokens[:, :-1], tokens[:, 1:], "float8_e4m3fn", steps=3,
                             loss_scale=2.0**-20)
    assert skipped == [0]


@pytest.mark.parametrize("grad_dtype", ["float16", "float8_e4m3fn"])
def test_the_root_is_measured_before_the_loss_casts_its_cotangent_down(grad_dtype):
    """A loss x 2^-30 (below the bench's tiny regime): at scale 1 the logits' cotangent
    flushes where the loss casts it down to float16, before any module's point sees it.
    A point on the cast's float32 side measures it there and converts it from the
    loss's seed scale (1) to the one the root chooses from it in the same backward pass,
    so the root's statistics after step 0 hold the fp32 amax of d loss / d logits (to
    fp16's rounding) and no step is skipped (measured but run at the seed scale below
    the cast, step 0 was skipped; measuring nothing, the root jumped blind and step 1
    was skipped too)."""
    from adaloss_jax.flax import TrainState, linen_train_step

    model = _models.MLP(depth=3, width=32)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    params = model.init(jax.random.key(2), x)["params"]

    def tiny(logits):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return ce.mean() * 2.0**-30

    scaler = alj.adaptive(groups="module", grad_dtype=grad_dtype, retries=0,
                          simulate=grad_dtype != "float16", initial_scale=1.0)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    step = jax.jit(lambda s: linen_train_step(
        s, lambda p, x: tiny(model.apply({"params": p}, x)), x))
    skipped = []
    for i in range(4):
        state, _ = step(state)
        st = alj.scale_state(state)
        if i == 0 and grad_dtype == "float16":
            logits = model.apply({"params": params}, x)
            want = jnp.log2(jnp.max(jnp.abs(jax.grad(tiny)(logits.astype(jnp.float32)))))
            assert float(want) < -25  # below fp16's smallest subnormal: flushed at the cast
            assert float(st.log2_amax[""]) == pytest.approx(float(want), abs=1e-3)
        if not bool(st.last_applied):
            skipped.append(i)
    assert skipped == []


def _chunked(ce, chunks=4):
    """``ce(logits, labels)`` (a mean over rows) computed chunk by chunk in a
    ``lax.scan``, each chunk's cast inside the body (a cross-entropy that never holds
    all float32 logits)."""
    def chunked(logits, labels):
        def body(total, chunk):
            return total + ce(*chunk), None
        split = lambda a: a.reshape(chunks, -1, *a.shape[1:])  # noqa: E731
        return jax.lax.scan(body, 0.0, (split(logits), split(labels)))[0] / chunks
    return chunked


def _switched(ce):
    """``ce(logits, labels)`` in the branch a ``lax.cond`` takes; the other branch casts
    too."""
    return lambda logits, labels: jax.lax.cond(labels[0] >= 0, ce,
                                               lambda *a: 2.0 * ce(*a), logits, labels)


def _sharded(ce, check_vma=True):
    """``ce(logits, labels)`` per device in a ``shard_map`` over the batch on 2 devices
    (the mean of their means), each device's cast inside the body; typed, or not
    (``check_vma=False``)."""
    def sharded(logits, labels):
        per_device = lambda lg, lb: jax.lax.pmean(ce(lg, lb), "data")  # noqa: E731
        return jax.shard_map(per_device, mesh=_mesh(), in_specs=(P("data"), P("data")),
                             out_specs=P(), check_vma=check_vma)(logits, labels)
    return sharded


_WRAPS = {
    "jit": lambda loss, ce: jax.jit(loss),  # the whole loss jitted
    "jit-ce": lambda loss, ce: loss(ce=jax.jit(ce)),  # a jitted cross-entropy
    "remat": lambda loss, ce: jax.checkpoint(loss),
    "scan-ce": lambda loss, ce: loss(ce=_chunked(ce)),  # cast in each chunk
    "cond-ce": lambda loss, ce: loss(ce=_switched(ce)),  # a cast in each branch
    "shard-ce": lambda loss, ce: loss(ce=_sharded(ce)),  # a cast on each device
    "shard-ce-untyped": lambda loss, ce: loss(ce=_sharded(ce, check_vma=False)),
}


@pytest.mark.parametrize("wrap", sorted(_WRAPS))
def test_a_loss_cast_inside_a_nested_equation_is_measured_before_it_narrows(wrap):
    """The loss of the test above (x 2^-30) jitted whole, its cross-entropy jitted on
    its own, the loss under ``jax.checkpoint``, its cross-entropy computed chunk by
    chunk in a ``scan``, per device in a ``shard_map`` or in a ``cond``'s branch: the
    cast sits inside a nested
    equation, and its point goes there (one per branch). The root's statistics after
    step 0 hold the fp32 amax at the cast. Where the cast and the model's points run in
    one scope (a nested ``jit`` is inlined; one checkpoint body around the whole loss)
    the root chooses its scale at the cast in step 0's backward pass, and no step is
    skipped; where the cast runs per chunk, per device or per branch, the root's
    regions keep the planned scale and only step 0 is skipped (with no point inside,
    the root measured nothing, jumped blind, and step 1 was skipped too; a branch not
    taken, whose row stays zero, starved the root, held its jump below its statistics,
    and step 1 was refused as computed too low)."""
    from adaloss_jax.flax import TrainState, linen_train_step

    model = _models.MLP(depth=3, width=32)
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    params = model.init(jax.random.key(2), x)["params"]

    def ce(logits, labels=y):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels).mean() * 2.0**-30

    def loss(p=None, x=None, ce=ce):
        if p is None:
            return lambda p, x: ce(model.apply({"params": p}, x), y)
        return ce(model.apply({"params": p}, x), y)

    loss_fn = _WRAPS[wrap](loss, ce)
    scaler = alj.adaptive(groups="module", retries=0, initial_scale=1.0)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
                              scaler=scaler)
    rec, _, _ = _grad_trace(loss_fn, scaler, params, x)
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16"] * (
        2 if wrap == "cond-ce" else 1)
    step = jax.jit(lambda s: linen_train_step(s, loss_fn, x))
    logits = model.apply({"params": params}, x)
    want = float(jnp.log2(jnp.max(jnp.abs(jax.grad(ce)(logits.astype(jnp.float32))))))
    assert want < -25  # below fp16's smallest subnormal: flushed at the cast
    skipped = []
    for i in range(3):
        state, _ = step(state)
        st = alj.scale_state(state)
        if i == 0:
            assert float(st.log2_amax[""]) == pytest.approx(want, abs=1e-3)
        if not bool(st.last_applied):
            skipped.append(i)
    assert skipped == ([] if wrap in ("jit", "jit-ce", "remat") else [0])


def test_one_jitted_cross_entropy_called_twice_gets_a_point_per_call_and_stays_exact():
    """A jitted cross-entropy called on two heads inside a jitted loss: jax hands both
    calls the same inner jaxpr, and each call site gets its own rebuilt copy with its
    own cast point (an fp16 model). An fp32 model with the same loss, scaled at
    arbitrary per-group scales, gets exact gradients."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    ce = jax.jit(lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean())

    def loss_of(model):
        def loss_fn(p, x, y):
            out = model.apply({"params": p}, x)
            return jax.jit(lambda o: ce(o, y) + ce(o * 2, (y + 1) % 4))(out)
        return loss_fn

    m16 = _models.MLP(depth=3, width=32)
    p16 = m16.init(jax.random.key(2), x)["params"]
    rec, _, _ = _grad_trace(loss_of(m16), alj.adaptive(groups="module"), p16, x, y)
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16", "float16"]

    m32 = _models.MLP(depth=3, width=32, dtype=jnp.float32)
    params = m32.init(jax.random.key(2), x)["params"]
    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    groups = alj.adaptive_unscale(scaler).init(params).groups
    log2 = dict(zip(groups, [5, -3, 9, 0, 12]))
    step, state = _grads_through(scaler, loss_of(m32), params, (x, y), log2)
    got, _, _ = step(state, params, x, y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss_of(m32)))(params, x, y))


@pytest.mark.parametrize("wrap", [_chunked, _switched, _sharded,
                                  functools.partial(_sharded, check_vma=False)],
                         ids=["scan", "cond", "shard_map", "shard_map_untyped"])
def test_a_cross_entropy_in_a_scan_or_cond_gets_its_points_and_stays_exact(wrap):
    """The points on the wide side of a cast inside a ``scan`` body (each chunk's), a
    ``shard_map``'s (each device's) or a ``cond``'s branches measure and leave the
    gradient as it is: an fp32 model whose loss casts its output there, at arbitrary
    per-group scales, gets exact gradients."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)

    def loss_of(model):
        def loss_fn(p, x, y):
            ce = wrap(lambda lg, labels: optax.softmax_cross_entropy_with_integer_labels(
                lg.astype(jnp.float32), labels).mean())
            return ce(model.apply({"params": p}, x), y)
        return loss_fn

    m16 = _models.MLP(depth=3, width=32)
    p16 = m16.init(jax.random.key(2), x)["params"]
    rec, _, _ = _grad_trace(loss_of(m16), alj.adaptive(groups="module"), p16, x, y)
    assert len(rec.casts) == (2 if wrap is _switched else 1)
    m32 = _models.MLP(depth=3, width=32, dtype=jnp.float32)
    params = m32.init(jax.random.key(2), x)["params"]
    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    groups = alj.adaptive_unscale(scaler).init(params).groups
    step, state = _grads_through(scaler, loss_of(m32), params, (x, y),
                                 dict(zip(groups, [5, -3, 9, 0, 12])))
    got, _, _ = step(state, params, x, y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss_of(m32)))(params, x, y))


_seed_a = alj.scale_group("seed_a")(lambda p, x: jnp.tanh(x @ p["w"].astype(x.dtype)))
_seed_b = alj.scale_group("seed_b")(lambda p, x: x @ p["w"].astype(x.dtype))
_SEED_PARAMS = {"seed_a": {"w": jax.random.normal(jax.random.key(5), (16, 32)) / 4},
                "seed_b": {"w": jax.random.normal(jax.random.key(6), (32, 4)) / 4},
                "bias": jnp.full((32,), 0.1), "shift": jnp.full((4,), 0.2),
                "temp": jnp.float32(1.5)}
_SEED_X = jax.random.normal(jax.random.key(7), (64, 16))
_SEED_Y = jax.random.randint(jax.random.key(8), (64,), 0, 4)


def _seed_loss(dtype, variant, tiny=1.0):
    """Two groups and a parameter of the root's own (``shift``) added to their output,
    rounded to float16 (a no-op for an fp16 model) and cast to float32 for the
    cross-entropy. ``variant``: ``"cast"``, the loss reads only that cast;
    ``"entered"``, another root parameter (``bias``) is added between the groups (as a
    GPT's position embedding: the root is entered there too); ``"direct"``, it adds
    the cross-entropy to an element of the float16 output in float16 (its region then
    holds float16 values, the output's among them); ``"param"``, the root's ``temp``
    divides the float32 logits (a parameter read in the loss's region); ``"fp16"``, a
    sum of squares in float16 (no cast)."""
    def loss(p, x, y):
        h = _seed_a(p["seed_a"], x.astype(dtype))
        if variant == "entered":
            h = h + p["bias"].astype(dtype)
        out = (_seed_b(p["seed_b"], h) + p["shift"].astype(dtype)).astype(jnp.float16)
        if variant == "fp16":  # (a reduction jnp would not widen)
            return jax.lax.reduce(jnp.square(out - 1.0), np.float16(0), jax.lax.add,
                                  (0, 1)) * jnp.float16(tiny)
        logits = out.astype(jnp.float32)
        if variant == "param":
            logits = logits / p["temp"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        if variant == "direct":
            return (ce * tiny).astype(jnp.float16) + out[0, 0] * jnp.float16(2.0**-10)
        return ce * tiny
    return loss


@pytest.mark.parametrize("variant", ["cast", "entered", "direct", "param", "fp16"])
def test_the_loss_seed_is_the_root_scale_only_where_the_cast_is_the_way_out(variant):
    """The loss's region runs at the seed scale (the root's planned one). Where its
    cotangent leaves it only through the cast, measured in float32 there, the cast point
    converts from the seed to the root's scale; the root, no longer anchoring the
    loss's region, chooses that scale in the same backward pass like a module, at the
    last of its ways in, the cast (the cast's float16 side holds it, and ``shift``'s
    gradient), though it is entered elsewhere too (``bias``'s gradient, on the stream:
    what enters there is bounded by the rule's scale once measured). Where the loss's
    region also holds float16 values or reads a parameter, it stays the root's, which
    keeps the rule's scale. In fp32, at arbitrary scales (the seed among them), the
    gradients are exact either way; and from scale 1 with the loss x 2^-30 (all of it
    flushed at the seed scale; x 2^-20 in float16, partly), step 0 is applied only
    where the root chose."""
    from adaloss_jax._tree import SEED

    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    _, program, groups = _grad_trace(_seed_loss(jnp.float16, variant), scaler,
                                     _SEED_PARAMS, _SEED_X, _SEED_Y)
    assert groups == ["", "seed_a", "seed_b"]
    casts = [s for s in program.sites() if s.row.wide]
    seeded = variant in ("cast", "entered")
    assert [(s.pair, s.cfg.convert) for s in casts] == (
        [] if variant == "fp16" else [((("",), (SEED,)), True)] if seeded
        else [((("",), ("",)), False)])
    assert ("" in program.live.groups) == seeded
    assert any(SEED in side for pair in program.pairs() for side in pair) == seeded

    loss32 = _seed_loss(jnp.float32, variant)
    step, state = _grads_through(scaler, loss32, _SEED_PARAMS, (_SEED_X, _SEED_Y),
                                 {"": 7, "seed_a": -3, "seed_b": 11})
    got, _, _ = step(state, _SEED_PARAMS, _SEED_X, _SEED_Y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss32))(_SEED_PARAMS, _SEED_X, _SEED_Y))

    tx = optax.chain(alj.adaptive_unscale(alj.adaptive(groups="module", retries=0,
                                                       initial_scale=1.0)),
                     alj.skip_nonfinite(optax.sgd(0.0)))
    state = tx.init(_SEED_PARAMS)
    vg = alj.adaptive_value_and_grad(_seed_loss(
        jnp.float16, variant, tiny=2.0**-20 if variant == "fp16" else 2.0**-30))
    loss, grads, stats = jax.jit(vg)(state, _SEED_PARAMS, _SEED_X, _SEED_Y)
    _, state = tx.update(grads, state, _SEED_PARAMS, loss=loss, scale_stats=stats)
    assert bool(state[0].last_applied) == seeded
    if seeded:  # the root chose: the cast converted before it narrowed
        assert float(stats.log2_scales[""]) > 30
        assert not any(bool(stats.starved[g]) for g in stats.starved.names)


@pytest.mark.parametrize("variant", ["cast", "entered"])
@pytest.mark.parametrize("wrap", ["jit", "remat", "vmap"])
def test_the_root_decided_at_the_cast_holds_under_transformations(wrap, variant):
    """The ``"cast"`` and ``"entered"`` losses above jitted whole, under
    ``jax.checkpoint``, or with the model mapped row by row by ``jax.vmap``: the cast
    still converts from the seed and the root still decides there, and an fp32 model's
    gradients at arbitrary scales (the seed among them) are jax.grad's."""
    from adaloss_jax._tree import SEED

    def wrapped(dtype):
        loss = _seed_loss(dtype, variant)
        if wrap == "jit":
            return jax.jit(loss)
        if wrap == "remat":
            return jax.checkpoint(loss)

        def mapped(p, x, y):  # the model per row, the loss on the stacked output
            def row(xr):
                h = _seed_a(p["seed_a"], xr.astype(dtype))
                if variant == "entered":
                    h = h + p["bias"].astype(dtype)
                return (_seed_b(p["seed_b"], h) + p["shift"].astype(dtype)).astype(
                    jnp.float16)
            logits = jax.vmap(row)(x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return mapped

    scaler = alj.adaptive(groups="module", compute_dtype="float16")
    _, program, _ = _grad_trace(wrapped(jnp.float16), scaler, _SEED_PARAMS, _SEED_X,
                                _SEED_Y)
    assert [(s.pair, s.cfg.convert) for s in program.sites() if s.row.wide] == [
        ((("",), (SEED,)), True)]
    assert "" in program.live.groups
    loss32 = wrapped(jnp.float32)
    step, state = _grads_through(scaler, loss32, _SEED_PARAMS, (_SEED_X, _SEED_Y),
                                 {"": 7, "seed_a": -3, "seed_b": 11})
    got, _, _ = step(state, _SEED_PARAMS, _SEED_X, _SEED_Y)
    assert_fp32_trees_close(got, jax.jit(jax.grad(loss32))(_SEED_PARAMS, _SEED_X, _SEED_Y))


def test_a_cast_of_a_scan_carry_computed_after_a_point_is_found():
    """The cast reads the scan's carry, which starts as data (zeros) and becomes the
    model's output only from the second iteration on: it is found by walking the body
    again with the carry marked as computed after a point."""
    x = jax.random.normal(jax.random.key(0), (64, 16))
    y = jax.random.randint(jax.random.key(1), (64,), 0, 4)
    model = _models.MLP(depth=3, width=32)
    params = model.init(jax.random.key(2), x)["params"]

    def loss_fn(p, x, y):
        out = model.apply({"params": p}, x).reshape(4, 16, -1)

        def body(prev, chunk):  # the cross-entropy of the previous chunk
            return chunk, optax.softmax_cross_entropy_with_integer_labels(
                prev.astype(jnp.float32), y[:16]).mean()
        return jax.lax.scan(body, jnp.zeros_like(out[0]), out)[1].sum()

    rec, _, _ = _grad_trace(loss_fn, alj.adaptive(groups="module"), params, x, y)
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16"]


def _grad_trace(loss_fn, scaler, params, *args):
    from adaloss_jax import _grad

    return _grad.trace(loss_fn, scaler, params, args, {})


def test_only_casts_of_the_loss_region_get_a_point():
    """The attention block casts inside a module (its scores, LayerNorm's statistics) and
    its loss casts the logits and, to add them, the input data (as it is, and doubled
    in a nested jit): only the logits' cast, the one the root's cotangent narrows at,
    is measured."""
    from adaloss_jax import _grad

    model = _AttnBlock()
    x = jax.random.normal(jax.random.key(0), (4, 8, 16)).astype(jnp.float16)
    y = jax.random.randint(jax.random.key(1), (4, 8), 0, 10)
    params = model.init(jax.random.key(2), x)["params"]

    twice = jax.jit(lambda v: v * 2)  # data through a nested jit: no module's output

    def loss_fn(p, x, y):
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.0 * jnp.sum(x.astype(jnp.float32) + twice(x).astype(jnp.float32))

    rec, _, _ = _grad.trace(loss_fn, alj.adaptive(groups="module"), params, (x, y), {})
    assert [jnp.dtype(d).name for d in rec.casts.values()] == ["float16"]
    # The same loss jitted: the casts sit inside the nested jit, and still only the
    # logits' one is measured.
    nested, _, _ = _grad.trace(jax.jit(loss_fn), alj.adaptive(groups="module"), params,
                               (x, y), {})
    assert [jnp.dtype(d).name for d in nested.casts.values()] == ["float16"]
    (point,) = [e for e in nested.closed.jaxpr.eqns[-1].params["jaxpr"].jaxpr.eqns
                if _point_of(e) in nested.casts]
    assert point.invars[0].aval.shape == (4, 8, 10)  # the logits', cast to float32
    cast = next(e for e in rec.closed.jaxpr.eqns
                if e.primitive.name == "convert_element_type"
                and any(v is e.outvars[0] for p in rec.closed.jaxpr.eqns
                        if _point_of(p) in rec.casts for v in p.invars))
    assert cast.outvars[0].aval.shape == (4, 8, 10)  # the logits'


def _point_of(eqn):
    from adaloss_jax import _jaxpr

    return _jaxpr.point_number(eqn)


@pytest.mark.parametrize("chunks", [None, 3], ids=["whole", "chunked"])
@pytest.mark.parametrize("around", AROUND)
def test_the_loss_cast_is_measured_around_every_transformation(around, chunks):
    """The model under vmap, remat, a nested jit, cond or shard_map (typed or not), its
    fp16 output cast to float32 by the loss (x 2^-30: at scale 1 it all flushes in the
    cast), whole or chunk by chunk in a ``scan``: the root's statistics of the first
    pass are the fp32 amax of the loss's cotangent at the cast (to fp16's rounding),
    however the model is wrapped. Where the root chooses its scale at the cast (one
    cast, in the scope of the model's points: none, vmap and jit around the model)
    the cotangent is converted before it narrows and no module is starved; elsewhere
    every module, which received only zeros computed from it, is starved and told that
    value (lost_amax), which the rule keeps from flushing again."""
    tiny = 2.0**-30
    scaler = alj.adaptive(groups="module", retries=0, initial_scale=1.0)
    case = build("jax", around, "none", jnp.float16, scaler, tiny=tiny, chunks=chunks)
    _, _, stats = case.grads(case.state)
    params, apply = _jax_model("none", jnp.float16)
    out = _around(around, functools.partial(apply, params))(_x(jnp.float32))
    ct = jax.grad(lambda o: jnp.mean(o**2) * tiny)(out.astype(jnp.float32))
    want = float(jnp.log2(jnp.max(jnp.abs(ct))))
    assert want < -25  # below fp16's smallest subnormal: lost in the cast
    at_unit = jnp.log2(stats.amax[""]) - stats.log2_scales[""]  # (the root's chosen)
    assert float(at_unit) == pytest.approx(want, abs=1e-3)
    modules = [g for g in stats.starved.names if g]
    assert modules
    if chunks is None and around in ("none", "vmap", "jit"):
        assert not any(bool(stats.starved[g]) for g in stats.starved.names)
        return
    assert all(bool(stats.starved[g]) for g in modules)
    assert [float(stats.lost_amax[g]) for g in stats.lost_amax.names] == pytest.approx(
        [want] * len(stats.lost_amax.names), abs=1e-5)
