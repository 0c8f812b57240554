"""The stream analysis and the reading of traced programs, on small hand-written programs
(pure JAX, a few equations each): where conversions go, what a transformation changes
(nothing), and what cannot be seen through (opaque, not applied)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import adaloss_jax as alj
from adaloss_jax import _jaxpr, _record, _stream

A, B = ("a",), ("b",)
ROOT = ("",)


def _dense(p, x):
    return jnp.tanh(x @ p["w"])


a, b = alj.scale_group("a")(_dense), alj.scale_group("b")(_dense)
PARAMS = {"a": {"w": jnp.eye(4) / 2}, "b": {"w": jnp.eye(4) / 3}}
X = jnp.ones((2, 4))


def plan_of(loss, params=PARAMS, x=X) -> tuple[_record.Recording, _stream.Plan]:
    owners_of = {("a",): "a", ("b",): "b"}
    rec = _record.record(loss, params, (x,), {},
                         lambda path, m: "group" if path in owners_of else "measure")
    owners = [owners_of.get(p[:1], "") for p in rec.param_paths]
    return rec, _stream.analyse(rec.closed.jaxpr, rec.sizes, owners)


def applied(plan) -> list[tuple]:
    """``(x anchors, y anchors)`` of every applied point's marked leaves (a parameter
    passed as an argument is not marked), in point order."""
    return [tuple((x, y) for x, y in zip(p.x, p.y) if x is not None)
            for p in plan.points if p.x is not None]


def test_a_chain_keeps_the_consumers_scale_until_the_loss():
    """a -> b -> loss: the cotangent leaving b goes to the loss region (root) and back
    at b's scale; between a and b the stream runs at b's scale (the consumer's), and
    enters a converted to a's."""
    rec, plan = plan_of(lambda p, x: jnp.sum(b(p["b"], a(p["a"], x))))
    assert rec.sizes == [1, 1, 1, 1]  # a's input and output, b's input and output
    # a's input (the parameter-free x: measured at a's scale), a's output into the stream
    # at b's scale, b's output to the loss; b's input only repeats a's output: left out.
    assert applied(plan) == [((A, A),), ((A, B),), ((B, ROOT),)]
    # Every parameter is read in its own group's region: no parameter conversion.
    assert plan.params == (A, B)


def test_a_fan_in_runs_at_every_consumer_scale():
    """x feeds a and the residual sum: one region anchored by both of its consumers."""
    rec, plan = plan_of(lambda p, x: jnp.sum(b(p["b"], a(p["a"], x) + x)))
    anchors = {xa for pts in applied(plan) for xa, _ in pts}
    assert ("a", "b") in anchors or ("", "b") in anchors or any(len(t) > 1 for t in anchors)


@pytest.mark.parametrize("how", ["slice", "scan"])
def test_a_parameter_passed_as_an_argument_passes_its_point_unmarked(how):
    """A value computed from parameters alone (a slice, a cast; or the first stacked
    output of a scan over them, which no carry reaches, computed by a group called on a
    constant) crossing a group's boundary is a parameter: no row, no conversion at the
    point."""
    stacked = {"a": {"w": jnp.stack([jnp.eye(4)] * 2)}}
    owners = lambda path, m: "group" if path == ("a",) else "measure"

    def weights(p):
        if how == "slice":
            return p["a"]["w"][1].astype(jnp.float16)
        # (a scan with a point inside is walked, not one opaque equation: a's call on a
        # constant there computes from parameters alone, and so does its output)
        eye = jnp.eye(4, dtype=jnp.float16)
        _, ws = jax.lax.scan(lambda c, w: (c + 1.0, a({"w": w.astype(jnp.float16)}, eye)),
                             0.0, p["a"]["w"])
        return ws[1]

    rec = _record.record(lambda p, x: jnp.sum(a({"w": weights(p)}, x)),
                         stacked, (X,), {}, owners)
    plan = _stream.analyse(rec.closed.jaxpr, rec.sizes, ["a"])
    last = plan.points[-2]  # the input of a's last call (then its output)
    assert rec.sizes[-2] == 2  # the parameter value and x cross it
    assert last.x[0] is None and last.y[0] is None  # the parameter value passes unmarked
    assert last.x[1] is not None


@pytest.mark.parametrize("wrap", ["jit", "checkpoint", "cond"])
def test_jit_checkpoint_and_cond_change_no_plan(wrap):
    def wrapped(f):
        if wrap == "jit":
            return jax.jit(f)
        if wrap == "checkpoint":
            return jax.checkpoint(f)
        return lambda p, x: jax.lax.cond(True, f, lambda p, x: f(p, x * 2), p, x)

    def loss(p, x):
        return jnp.sum(b(p["b"], a(p["a"], x)))

    _, plain = plan_of(loss)
    rec, transformed = plan_of(wrapped(loss))
    kinds = {_jaxpr.Reader().kind(e) for e in rec.closed.jaxpr.eqns}
    assert {"jit": _jaxpr.INLINE, "checkpoint": _jaxpr.REMAT, "cond": _jaxpr.COND}[wrap] in kinds
    if wrap == "cond":  # both branches are recorded: each has its points, the same plan
        assert applied(transformed) == applied(plain) * 2
    else:
        assert applied(transformed) == applied(plain)


# Values only ``aux`` reads (a metric), or nobody: their cotangent is zero, so what
# computes them joins no regions (a weight norm in aux joined every module's).
_UNREAD = {
    "aux reads every parameter":
        lambda p, h, o: (jnp.sum(o), jnp.sum(p["a"]["w"] ** 2) + jnp.sum(p["b"]["w"] ** 2)),
    "aux reads two modules' outputs": lambda p, h, o: (jnp.sum(o), jnp.mean(h * o)),
    "aux, jitted": lambda p, h, o: (jnp.sum(o), jax.jit(lambda u, v: jnp.mean(u * v))(h, o)),
    "nobody reads": lambda p, h, o: (jnp.sum(o), (h * o, p["a"]["w"] + p["b"]["w"])[0][0, 0]),
    "aux, rematerialised": lambda p, h, o: (
        jnp.sum(o), jax.checkpoint(lambda u, v: jnp.mean(u * v))(h, o)),
    "aux, in a shard_map": lambda p, h, o: (jnp.sum(o), jax.shard_map(
        lambda u, v: jnp.mean(u * v), mesh=jax.make_mesh((1,), ("d",)),
        in_specs=(jax.P(), jax.P()), out_specs=jax.P())(h, o)),
}


@pytest.mark.parametrize("tail", list(_UNREAD))
def test_what_only_aux_or_nobody_reads_joins_no_regions(tail):
    """a -> b -> loss, plus values computed from both modules' parameters or outputs
    that reach ``aux`` only (index 1 of the loss's outputs), or nothing: the plan is
    the one without them. The same values added to the loss join the regions they
    read (below)."""
    def body(p, x):
        h = a(p["a"], x)
        return h, b(p["b"], h)

    _, plain = plan_of(lambda p, x: jnp.sum(body(p, x)[1]))
    _, with_tail = plan_of(lambda p, x: _UNREAD[tail](p, *body(p, x)))
    assert applied(with_tail) == applied(plain)
    assert with_tail.params == plain.params == (A, B)
    # The same in both branches of a cond around the whole loss: the aux of each
    # branch reaches the cond's second output only.
    def cond(f):
        return lambda p, x: jax.lax.cond(
            x[0, 0] > 0, lambda p, x: f(p, x), lambda p, x: f(p, 2 * x), p, x)

    _, plain = plan_of(cond(lambda p, x: (jnp.sum(body(p, x)[1]), 0.0)))
    _, with_tail = plan_of(cond(lambda p, x: _UNREAD[tail](p, *body(p, x))))
    assert applied(with_tail) == applied(plain)
    # Read by the loss, the parameters' squares join a's and b's parameters' regions.
    _, read = plan_of(lambda p, x: jnp.sum(body(p, x)[1]) + _UNREAD[
        "aux reads every parameter"](p, *body(p, x))[1])
    assert read.params != plain.params


def test_reaching_follows_autodiff_and_trusts_no_custom_rule():
    """``_jaxpr.reaching``: a scan's per-iteration output that only ``aux`` reads does
    not reach the loss, nor what computes it inside the body or a jit; its carry and
    what feeds the loss do. A ``custom_vjp`` whose rule sends a cotangent to an input
    its output ignores reads that input: the input reaches."""
    @jax.custom_vjp
    def first(u, v):
        return u

    first.defvjp(lambda u, v: (u, None), lambda _, g: (g, g))

    def loss(x, y):
        def body(c, xi):
            return c * xi, jnp.cos(c)  # the carry; a per-iteration value for aux only

        c, ys = jax.lax.scan(body, x, jnp.stack([x, x]))
        aux = jax.jit(lambda t: jnp.exp(t))(ys)
        return jnp.sum(first(c, jnp.sin(y))), aux

    jaxpr = jax.make_jaxpr(loss)(jnp.ones(3), jnp.ones(3)).jaxpr
    reach = _jaxpr.reaching(jaxpr, [0])
    eqn = {e.primitive.name: e for e in jaxpr.eqns}
    carry, ys = eqn["scan"].outvars
    assert carry in reach and ys not in reach
    body = eqn["scan"].params["jaxpr"].jaxpr
    assert {e.primitive.name for e in body.eqns if e.outvars[0] in reach} == {"mul"}
    assert eqn["jit"].outvars[0] not in reach
    assert eqn["sin"].outvars[0] in reach  # (the custom rule's cotangent for it)
    assert jaxpr.outvars[0] in reach and jaxpr.outvars[1] not in reach


def test_a_scan_carry_is_one_region_across_iterations():
    stacked = {"a": {"w": jnp.stack([jnp.eye(4) / 2] * 3)}}

    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, w: (a({"w": w}, h), None), x, p["a"]["w"])
        return jnp.sum(h)

    rec, plan = plan_of(loss, stacked)
    assert _jaxpr.SCAN in {_jaxpr.Reader().kind(e) for e in rec.closed.jaxpr.eqns}
    pts = applied(plan)
    # Into a from the carry (the loss's region: root) and back out to it.
    assert ((ROOT, A),) in pts or ((A, ROOT),) in pts


def test_points_inside_a_custom_derivative_are_not_applied():
    """A user's custom_jvp replaces autodiff's derivative: points inside it would never
    see a cotangent, so they are left out and the equation is one region."""

    @jax.custom_jvp
    def f(p, x):
        return a(p, x)

    f.defjvp(lambda primals, tangents: (f(*primals), tangents[1]))
    rec, plan = plan_of(lambda p, x: jnp.sum(b(p["b"], f(p["a"], x))))
    assert len(rec.sizes) == 4  # recorded
    assert all(p.x is None for p in plan.points[:2])  # a's points: inside custom_jvp
    assert any(p.x is not None for p in plan.points[2:])  # b's: applied
    kinds = [_jaxpr.Reader().kind(e) for e in rec.closed.jaxpr.eqns]
    assert _jaxpr.OPAQUE in kinds


def test_reader_kinds():
    rec, _ = plan_of(lambda p, x: jnp.sum(b(p["b"], a(p["a"], x))))
    reader = _jaxpr.Reader()
    kinds = [reader.kind(e) for e in rec.closed.jaxpr.eqns]
    assert kinds[0] == _jaxpr.PARAMS
    assert kinds.count(_jaxpr.POINT) == 4
    assert _jaxpr.PLAIN in kinds
    assert [_jaxpr.point_number(e) for e in rec.closed.jaxpr.eqns
            if reader.kind(e) == _jaxpr.POINT] == [0, 1, 2, 3]


def test_recording_is_not_fooled_by_jax_trace_caches():
    """A jitted function traced once without points (outside the gradient) is traced
    again, with them, while recording: JAX's cache cannot hand back the old trace."""
    jb = jax.jit(lambda p, x: b(p, x))
    jax.make_jaxpr(jb)(PARAMS["b"], X)  # cached without points
    rec, plan = plan_of(lambda p, x: jnp.sum(jb(p["b"], a(p["a"], x))))
    assert len(rec.sizes) == 4
    assert len(applied(plan)) >= 2


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "remat"])
def test_a_stack_of_layers_in_a_jitted_or_rematerialised_loss_keeps_a_scale_per_layer(wrap):
    """The stacked parameters enter a nested ``jit`` or ``checkpoint`` as they are (each
    read once): the walk follows them in, so the scan there is still a stack of layers,
    a group per layer, as in the loss unwrapped."""
    import _stacked

    from adaloss_jax import _grad

    x = jnp.ones((2, 4), jnp.float16)
    scaler = alj.adaptive(groups="module")
    _, _, plain = _grad.trace(_stacked.loss, scaler, _stacked.params(), (x,), {})
    _, _, wrapped = _grad.trace(wrap(_stacked.loss), scaler, _stacked.params(), (x,), {})
    assert wrapped == plain == ["", "Dense_0", *(f"{_stacked.STACK}[{i}]" for i in range(3))]
