"""A step's verdict, for the gradient function's retries and for the optimizer alike:
each parameter gradient unscaled by its group's scale, the statistics as vectors over
the state's groups (reduced over devices), and the rule's next state."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from adaloss_jax import (
    _common,
    _formats,
    _groups,
    _rule,
    _tree,
)
from adaloss_jax._layout import Layer, layers
from adaloss_jax._state import (
    AdaptiveScaleState,
    ScaleStats,
)


def unscale(updates, stats: ScaleStats, state: AdaptiveScaleState):
    """Each leaf in fp32 divided by its group's scale (a stack of layers: each slice by
    its layer's), and each state group's largest gradient magnitude at that scale (inf
    where a gradient is not finite)."""
    active = set(stats.log2_scales.names)
    stacked = {s.group for s in active if isinstance(s, Layer)}
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    leaf_groups = [_groups.leaf_group(p, active | stacked, state.scaler)
                   for p in _tree.leaf_paths(updates)]
    inv = {g: _formats.pow2(-(stats.log2_scales.stacked(g) if g in stacked
                              else stats.log2_scales[g]))
           for g in sorted(set(leaf_groups), key=_tree.natural)}
    out, leaf_max, index = [], [], []
    for g, leaf in zip(leaf_groups, leaves):
        x = _common.to_fp32(leaf)
        # Non-finite elements enter the max as inf (XLA's CPU max can drop a NaN).
        mag = jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.asarray(jnp.inf, x.dtype))
        if g in stacked:  # slice i of the leaf is layer i's
            n = inv[g].shape[-1]
            leaf_max.append(jnp.max(mag.reshape(n, -1), axis=1, initial=0.0))
            index += [state.groups.index(s) for s in layers(g, n)]
            out.append(x * inv[g].reshape((n,) + (1,) * (x.ndim - 1)))
            continue
        leaf_max.append(jnp.max(mag, initial=0.0)[None])
        index.append(state.groups.index(g))
        out.append(x * inv[g])
    ng = len(state.groups)
    p_amax = jnp.zeros((ng,), jnp.float32)
    if leaves:
        p_amax = jax.ops.segment_max(jnp.concatenate(leaf_max).astype(jnp.float32),
                                     jnp.asarray(index), ng)
        p_amax = jnp.maximum(p_amax, 0.0)
    return jax.tree_util.tree_unflatten(treedef, out), p_amax


def foreign(received: jax.Array, measured: jax.Array, axis_name: str | None) -> jax.Array:
    """Whether the gradients handed to ``update`` (their per-group largest magnitude at
    scale, ``received``) are not those the statistics came with (``measured``): another
    magnitude by more than 2x, or finite where those were not. Under a bound
    ``axis_name`` the gradients may have been summed or averaged over its devices since,
    so only a magnitude beyond ``2 n`` times the largest measured on any device counts."""
    if axis_name is None:
        finite_r, finite_m = received < jnp.inf, measured < jnp.inf
        apart = (received > 2 * measured) | (measured > 2 * received)
        return jnp.any((finite_r != finite_m) | (finite_r & finite_m & apart))
    n = jax.lax.axis_size(axis_name)
    top = jax.lax.pmax(measured, axis_name)
    beyond = jnp.any((received < jnp.inf) & (received > 2 * n * top))
    return jax.lax.pmax(beyond.astype(jnp.int32), axis_name) > 0


def verdict(state: AdaptiveScaleState, grads, stats: ScaleStats, loss,
             axis_name) -> tuple[AdaptiveScaleState, jax.Array]:
    """The rule's next state for one pass (its gradients and statistics), and each state
    group's largest gradient magnitude at its scale on this device."""
    _, p_amax = unscale(grads, stats, state)
    return _rule.adjust(state, measured(state, stats, p_amax, loss, axis_name)), p_amax


def over_devices(x, op, axis_name):
    return x if axis_name is None or x is None else op(x, axis_name)


def measured(state: AdaptiveScaleState, stats: ScaleStats, p_amax, loss,
              axis_name) -> _rule.Measured:
    """The step's statistics as vectors over the state's groups, reduced over devices."""
    ng = len(state.groups)
    idx = jnp.asarray([state.groups.index(g) for g in stats.log2_scales.names], jnp.int32)

    def full(v, fill, dtype):  # the group axis last, as in a GroupVector
        if v is None:
            return None
        shape = v.array.shape[:-1] + (ng,)
        return jnp.full(shape, fill, dtype).at[..., idx].set(v.array.astype(dtype))

    active = jnp.zeros((ng,), jnp.bool_).at[idx].set(True)
    adopted = jnp.zeros((ng,), jnp.bool_) if stats.adopted is None else full(
        stats.adopted, False, jnp.bool_)  # (its gradients: at a fan-in's choice)
    own = None
    if stats.own is not None:  # its rows', or its parameter gradients' (not adopted)
        own = (full(stats.own, False, jnp.bool_) | (p_amax > 0)) & ~adopted
    p_amax = over_devices(p_amax, jax.lax.pmax, axis_name)
    p_nonfinite = ~(p_amax < jnp.inf)
    amax = over_devices(jnp.maximum(full(stats.amax, 0.0, jnp.float32), p_amax), jax.lax.pmax,
                   axis_name)
    bad = over_devices(full(stats.bad, False, jnp.bool_).astype(jnp.int32), jax.lax.pmax,
                  axis_name) > 0
    nonfinite = over_devices((stats.nonfinite | jnp.any(p_nonfinite)).astype(jnp.int32),
                        jax.lax.pmax, axis_name) > 0
    loss_finite = (jnp.asarray(True) if loss is None
                   else _common.all_finite(loss, axis_name=axis_name))
    used = jnp.where(active, full(stats.log2_scales, 0.0, jnp.float32),
                     state.log2_scales.array)
    return _rule.Measured(
        active=active, used=used, amax=amax, bad=bad, param_nonfinite=p_nonfinite,
        grads_finite=~nonfinite, loss_finite=loss_finite,
        sumsq=over_devices(full(stats.sumsq, 0.0, jnp.float32), jax.lax.psum, axis_name),
        count=over_devices(full(stats.count, 0.0, jnp.float32), jax.lax.psum, axis_name),
        hist=over_devices(None if stats.hist is None else full(stats.hist, 0.0, jnp.float32).T,
                     jax.lax.psum, axis_name),
        flushed=None if stats.flushed is None else over_devices(
            stats.flushed.astype(jnp.int32), jax.lax.pmax, axis_name) > 0,
        starved=None if stats.starved is None else over_devices(
            full(stats.starved, False, jnp.bool_).astype(jnp.int32), jax.lax.pmax,
            axis_name) > 0,
        lost_amax=None if stats.lost_amax is None else over_devices(
            full(stats.lost_amax, -jnp.inf, jnp.float32), jax.lax.pmax, axis_name),
        own=None if own is None else over_devices(own.astype(jnp.int32), jax.lax.pmax,
                                                  axis_name) > 0)


def bound(axis_name: str | None) -> str | None:
    """``axis_name`` where it is bound here (inside the ``shard_map`` it names), else
    None (a state built for a mapped step, used in an unmapped one)."""
    if axis_name is None:
        return None
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        return None
    return axis_name
