"""Break the library on purpose and check that the tests notice (issue 22).

Each mutation is one textual change to a copy of the repository; the tests named with it
run on that copy and must fail. A mutation the tests miss is reported as ``SURVIVED``.

Usage::

    python benchmarks/mutations.py              # every mutation (about 15 minutes)
    python benchmarks/mutations.py --only max-as-sum,axis-name-ignored
    python benchmarks/mutations.py --fast       # the fast tier's cases of those tests only
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (file, text, replacement, tests that must fail, what it breaks)
MUTATIONS = {
    "same-step-devices-disagree": (
        "adaloss_jax/_channel.py",
        "        amax = jax.lax.pmax(amax, axes)",
        "        amax = amax",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "same-step deciders choose per device, not over the devices sharing the gradient"),
    "same-step-prior-ignored": (
        "adaloss_jax/_channel.py",
        "    s = jnp.minimum(jnp.floor(cfg.target - (jnp.log2(amax) - ly)) - headroom, prior)",
        "    s = jnp.floor(cfg.target - (jnp.log2(amax) - ly)) - headroom",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a same-step choice rises above the rule's scale (its back-off, the growth seen)"),
    "same-step-arrival-token-ignored": (
        "adaloss_jax/_channel.py",
        "    ly = base[1] if cfg.y_token is None else base[1] + emitted[cfg.y_token]",
        "    ly = base[1]",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a point reads the planned scale of its consumer side where that region decided"),
    "same-step-exit-token-ignored": (
        "adaloss_jax/_channel.py",
        "    lx = base[0] if cfg.x_token is None else base[0] + emitted[cfg.x_token] * (",
        "    lx = base[0] if cfg.x_token is None else base[0] + 0.0 * (",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a point converts into a region that decided at the region's planned scale"),
    "same-step-chain-carry-dropped": (
        "adaloss_jax/_apply.py",
        "carried = [sum(ctx.tokens.pop(_live.CHAIN_Y), jnp.zeros((), jnp.float32))]",
        "carried = [jnp.zeros((), jnp.float32)]",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a scanned chain's layer reads the next layer's planned scale, not its choice"),
    "same-step-checkpoint-tokens-kept-inside": (
        "adaloss_jax/_apply.py",
        "            shape_out[:] = shape",
        "            shape_out[:] = [(g, 0) for g, _ in shape]",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "tokens emitted inside a checkpoint body never reach a decider after it"),
    "same-step-tokens-left-out-of-bodies": (
        "adaloss_jax/_apply.py",
        "    return ([(g, len(ts)) for g, ts in tokens.items()],",
        "    return ([(g, 0) for g in tokens],",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "tokens emitted before a checkpoint body or a cond never reach a decider in it "
        "or after it"),
    "same-step-stream-way-in-at-every-layer": (
        "adaloss_jax/_channel.py",
        "        base[2] if cfg.follows else 1.0)",
        "        1.0)",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a stream's way in converts from the layer's own stream at the first layer too"),
    "same-step-stream-way-in-token-kept-inside": (
        "adaloss_jax/_apply.py",
        "            live.tokens.setdefault(g, []).append(t[chain.first])",
        "            pass",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the token of a stream's way in never leaves the scan: the root decides, the way "
        "in reads its plan"),
    "same-step-stream-first-is-slice-0": (
        "adaloss_jax/_apply.py",
        'per_layer += (jnp.arange(p["length"]) != (chain.first if chain else 0),)',
        'per_layer += (jnp.arange(p["length"]) != 0,)',
        ["tests/test_live.py"],
        "a reversed scan's stream way in reads the root at slice 0, not at the layer "
        "executed first"),
    "same-step-stream-named-outside": (
        "adaloss_jax/_live.py",
        "                         lambda a, b: layer & {*_parts(a), *_parts(b)}, earlier):",
        "                         lambda a, b: False, earlier):",
        ["tests/test_live.py"],
        "a stack's stream read outside its body besides the first layer's way in decides "
        "in the body all the same"),
    "same-step-switch-tokens-kept-inside": (
        "adaloss_jax/_apply.py",
        "        live.tokens.update(_unflatten(flat, list(union.items())))",
        "        pass",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "tokens emitted in a cond's branches never reach a decider after it"),
    "same-step-layer-regions-planned": (
        "adaloss_jax/_live.py",
        "            found = _inside(scan, every, params, counts)",
        "            found = None",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the regions inside a scanned layer keep the plan instead of deciding"),
    "max-as-sum": (
        "adaloss_jax/_channel.py",
        "jnp.concatenate([jnp.max(rows[..., :_MAXED], axis=axes),",
        "jnp.concatenate([jnp.sum(rows[..., :_MAXED], axis=axes),",
        ["tests/test_jax_transformations.py", "tests/test_channel.py"],
        "a point met in several passes sums its maxima instead of taking their max"),
    "device-reduction-dropped": (
        "adaloss_jax/_channel.py",
        "    if not axes:\n        return row\n    axes = tuple(sorted(axes))",
        "    if True:\n        return row\n    axes = tuple(sorted(axes))",
        ["tests/test_adaptive_distributed.py", "tests/test_jax_transformations.py"],
        "statistics under shard_map are not reduced over the devices"),
    "axis-name-ignored": (
        "adaloss_jax/_decide.py",
        "    return x if axis_name is None or x is None else op(x, axis_name)",
        "    return x",
        ["tests/test_adaptive_distributed.py"],
        "adaptive_unscale ignores axis_name"),
    "wrong-scale-on-one-group": (
        "adaloss_jax/_decide.py",
        "        out.append(x * inv[g])",
        "        out.append(x * inv[g] * (1.0625 if g == leaf_groups[-1] else 1.0))",
        ["tests/test_jax_transformations.py"],
        "one group's gradients unscaled by a wrong factor"),
    "every-module-gradient-off": (
        "adaloss_jax/_decide.py",
        "        out.append(x * inv[g])",
        "        out.append(x * inv[g] * (1.0625 if g else 1.0))",
        ["tests/test_jax_transformations.py"],
        "every per-module gradient multiplied by 1.0625 (issue 22's Equinox case)"),
    "wrong-ratio": (
        "adaloss_jax/_apply.py",
        "    ratios = {(x, y): scale[x] / scale[y] for x, y in pairs if x != y}",
        "    ratios = {(x, y): scale[x] / scale[y] * 2.0 for x, y in pairs if x != y}",
        ["tests/test_jax_transformations.py"],
        "every conversion by twice the ratio of its two scales"),
    "underscaled-step-applied": (
        "adaloss_jax/_rule.py",
        "    underscaled = jnp.any(rise > cfg.max_rise)",
        "    underscaled = jnp.any(rise > 1000)",
        ["tests/test_rule.py", "tests/test_adaptive.py"],
        "a step far below its statistics' scale is applied"),
    "skip-unless-every-group-measured": (
        "adaloss_jax/_rule.py",
        "    measured = jnp.any(act & (amax > 0))",
        "    measured = jnp.all(~act | (amax > 0))",
        ["tests/test_adaptive.py", "tests/test_rule.py"],
        "only steps where every group measured something are applied (issue 22)"),
    "backoff-ignored": (
        "adaloss_jax/_rule.py",
        "    nxt = jnp.where(bad | backs_off, used - drop, jnp.where(amax > 0, target, grown))",
        "    nxt = jnp.where(amax > 0, target, grown)",
        ["tests/test_rule.py"],
        "a group where an overflow started does not back off"),
    "parameters-measured": (
        "adaloss_jax/_stream.py",
        "                          if self._source(kv) == _PARAMS or not self.reaches(",
        "                          if not self.reaches(",
        ["tests/test_jax_transformations.py", "tests/test_stream.py"],
        "a parameter passed into a group as an argument is measured as a cotangent"),
    "aux-joins-regions": (
        "adaloss_jax/_stream.py",
        "                if blob is not None or self.reaches(outs):",
        "                if True:",
        ["tests/test_stream.py", "tests/test_live_warmup.py"],
        "what only aux reads (a weight norm, a per-layer metric) joins the regions it reads"),
    "unread-outputs-anchored": (
        "adaloss_jax/_stream.py",
        "                          if self._source(kv) == _PARAMS or not self.reaches([outs[i]])}",
        "                          if self._source(kv) == _PARAMS}",
        ["tests/test_live.py", "tests/test_stream.py", "tests/test_live_warmup.py"],
        "a point's output that nothing reaching the loss reads (only aux, or a module "
        "reading its input's shape) gets a site: its zeros count as a cotangent that "
        "arrived as zeros (an OptimizedLSTMCell fan-in's groups starved every step)"),
    "reaching-reads-every-input": (
        "adaloss_jax/_jaxpr.py",
        "            if mapped:\n",
        "            if False:\n",
        ["tests/test_stream.py", "tests/test_live_warmup.py"],
        "an equation with a sub-jaxpr that reaches the loss reads all its inputs (a scale "
        "point's output that only aux reads counts as read)"),
    "custom-rule-trusted": (
        "adaloss_jax/_jaxpr.py",
        "            mapped = (e.primitive.name in _AUTODIFFED and bool(subs)",
        "            mapped = (bool(subs)",
        ["tests/test_stream.py"],
        "a custom_vjp's inputs reach the loss only where its forward reads them"),
    "value-holder-swapped": (
        "adaloss_jax/_swap.py",
        "        if not attrs:\n",
        "        if False:\n",
        ["tests/test_equinox.py"],
        "a module with no method to report (Equinox's StateIndex) gets a subclass too"),
    "loss-seed-not-converted": (
        "adaloss_jax/_apply.py",
        "self.columns, convert=xa != ya, measure=True, y_max=y_max, x_max=lim),",
        "self.columns, convert=False, measure=True, y_max=y_max, x_max=lim),",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the loss's cast measures but never converts from the seed: the root never decides"),
    "fan-ins-never-live": (
        "adaloss_jax/_live.py",
        "    return g if g is not None or not fanins else fan_in(anchors)",
        "    return g",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a fan-in (a residual stream) keeps its anchors' planned scales: fp8 step 0 skipped"),
    "fan-in-first-choice-as-a-modules": (
        "adaloss_jax/_apply.py",
        "            halfway=isinstance(group, tuple) or key in self.live.streams, follows",
        "            halfway=False, follows",
        ["tests/test_live_warmup.py"],
        "a fan-in's first choice keeps a module's room (5 binades in fp8), not half its span"),
    "e5m2-module-rise-as-e4m3s": (
        "adaloss_jax/_adaptive_scaler.py",
        '_MODULE_RISE = {"float16": 16, "float8_e5m2": 10}',
        '_MODULE_RISE = {"float16": 16}',
        ["tests/test_live_warmup.py"],
        "e5m2 per module keeps e4m3's max_rise (5): a kernel's sum over 8192 tokens overflows "
        "float16 at the first choice, and step 0 is skipped"),
    "fan-in-choice-not-decoded": (
        "adaloss_jax/_grad.py",
        "            stats = program.decode(rows, actual, planned=used, moved=moved)",
        "            stats = program.decode(rows, actual, planned=used, moved=None)",
        ["tests/test_live.py", "tests/test_live_warmup.py", "tests/test_channel.py"],
        "the statistics read a live fan-in's rows at its planned scale, not its choice"),
    "fan-in-prior-ignored": (
        "adaloss_jax/_grad.py",
        "        out[a] = jnp.stack([jnp.max(cols[0]), jnp.min(cols[1]),",
        "        out[a] = jnp.stack([jnp.max(cols[0]), jnp.inf,",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a live fan-in's choice is not bounded by its anchors' rule scales once measured"),
    "fan-in-headroom-ignored": (
        "adaloss_jax/_grad.py",
        "        out[a] = jnp.stack([jnp.max(cols[0]), jnp.min(cols[1]),",
        "        out[a] = jnp.stack([jnp.min(cols[0]) * 0, jnp.min(cols[1]),",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a live fan-in keeps none of the headroom its anchors learned"),
    "root-never-live": (
        "adaloss_jax/_live.py",
        "        if g == ROOT and not root:",
        "        if g == ROOT:",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the root's regions below the loss's cast keep the planned scale (step 0 skipped)"),
    "root-parameters-anchor-their-regions": (
        "adaloss_jax/_stream.py",
        "            elif name != ROOT or rooted is None or j in rooted:",
        "            else:",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a root's parameter read before a scanned stack anchors the sum under its first "
        "layer: the root's choice, made from the logits, holds it"),
    "root-parameters-never-anchor-again": (
        "adaloss_jax/_grad.py",
        "    if stuck:",
        "    if False:",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a root's parameter read where the region cannot decide (inside a shard_map of "
        "the loss) leaves it to the plan of its readers, not the root's statistics"),
    "root-parameters-free-without-same-step": (
        "adaloss_jax/_grad.py",
        "    plan = _plan(rec, scaler, owners, stacks, frozenset() if scaler.same_step else None)",
        "    plan = _plan(rec, scaler, owners, stacks, frozenset())",
        ["tests/test_live.py"],
        "with the rule's scales alone the root's parameters anchor nothing either"),
    "one-iteration-scan-walked-apart": (
        "adaloss_jax/_apply.py",
        "elif kind in (_jaxpr.INLINE, _jaxpr.REMAT, _jaxpr.COND) or self._once(eqn):",
        "elif kind in (_jaxpr.INLINE, _jaxpr.REMAT, _jaxpr.COND):",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a scan of one iteration is analysed as a scan over time: its body keeps the plan"),
    "one-iteration-scan-scanned": (
        "adaloss_jax/_apply.py",
        "        if self._once(eqn):  # the body once",
        "        if False:  # the body once",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a scan of one iteration is analysed as its body run once but evaluated as a scan "
        "outside the live scope"),
    "scan-over-time-body-in-a-live-scope": (
        "adaloss_jax/_apply.py",
        "            ctx = None\n",
        "            ctx = \"\"\n",
        ["tests/test_live.py"],
        "a scan that is no live stack (an RNN over time) evaluates its body as in a live "
        "scope: a checkpoint in the body looks for tokens"),
    "way-in-decides-nothing": (
        "adaloss_jax/_live.py",
        "(opened if one else extra).setdefault(g, [])",
        "extra.setdefault(g, [])",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a region entered only at a stream's way in inside the body keeps the plan"),
    "way-in-decides-at-every-layer": (
        "adaloss_jax/_channel.py",
        "            chosen_x = jnp.where(first, chosen_x, lx)",
        "            chosen_x = chosen_x",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a way in deciding the region before the scan converts into that choice at every "
        "layer, not only the first"),
    "way-in-group-scale-summed-over-layers": (
        "adaloss_jax/_channel.py",
        "            mine = jnp.where(first, mine, 0.0)",
        "            pass",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the group's scale a way in chose is summed over every layer's choice"),
    "way-in-token-summed-over-layers": (
        "adaloss_jax/_channel.py",
        "            moved = jnp.where(first, moved, 0.0)",
        "            pass",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the points before the scan read a way in's choice summed over every layer"),
    "way-in-tokens-left-outside": (
        "adaloss_jax/_apply.py",
        "opened = {g: (live.inputs[g], live.tokens.pop(g, []))",
        "opened = {g: (live.inputs[g], [])",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the tokens emitted before the scan for a way in's choice never reach it"),
    "stacks-handoff-unchecked": (
        "adaloss_jax/_live.py",
        "        if kept == exits:\n            break",
        "        if True:\n            break",
        ["tests/test_live.py"],
        "a stack entered from another's exit relays though that one does not"),
    "stacks-handoff-token-dropped": (
        "adaloss_jax/_live.py",
        "last=st.chain.last if st.chain.last in live or st.chain.last in firsts else None)",
        "last=st.chain.last if st.chain.last in live else None)",
        ["tests/test_live.py"],
        "a stream's final token never reaches the stack scanned straight after it"),
    "stacks-handoff-chain-last-cleared": (
        "adaloss_jax/_live.py",
        "c._replace(last=c.last if c.last in live or c.last in firsts else None)",
        "c._replace(last=c.last if c.last in live else None)",
        ["tests/test_live.py"],
        "a chain's final token dropped where its consumer is another stack's first layer"),
    "earlier-stack-measure-refused": (
        "adaloss_jax/_live.py",
        "            if (k == e if convert else a == b) and side[at] == first:",
        "            if convert and k == e and side[at] == first:",
        ["tests/test_live.py"],
        "a point measuring a stack's first layer inside the stack scanned before it "
        "makes it keep the plan"),
    "chain-touched-by-fan-ins": (
        "adaloss_jax/_live.py",
        "for side in (a, b) for g in _region_groups(side))",
        "for side in (a, b) for g in (_per_layer(side) or side or ()))",
        ["tests/test_live.py"],
        "a chain counts a fan-in its first layer reads as touching it, and keeps the plan "
        "after a stream"),
    "stacked-parameter-conversions-dropped": (
        "adaloss_jax/_stream.py",
        "            params.append(Steps([of(region(u[s])) for s in range(len(u))]))",
        "            params.append(None)",
        ["tests/test_live.py"],
        "a stacked parameter read per layer in a fan-in of its layer is unscaled at its "
        "own slot's scale (mutmut's survivor _stream.x_analyse__mutmut_223, seed 131)"),
    "ways-in-parameters-unchecked": (
        "adaloss_jax/_live.py",
        "    for k, (a, b), convert in [*outside, *_param_sites(params)]:",
        "    for k, (a, b), convert in outside:",
        ["tests/test_live.py"],
        "a parameter converting into a stack's later layer leaves it a chain or a stream"),
    "stream-parameter-way-in-no-token": (
        "adaloss_jax/_live.py",
        "map(key_of, pair)) if g in live or g in firsts]",
        "map(key_of, pair)) if g in live]",
        ["tests/test_live.py"],
        "a parameter converting into a stream's first layer converts from its plan"),
    "loss-seed-at-roots-choice": (
        "adaloss_jax/_channel.py",
        "        single = jnp.asarray([len(a) == 1 and a[0] != SEED for a in sets])",
        "        single = jnp.asarray([len(a) == 1 for a in sets])",
        ["tests/test_channel.py"],
        "a row measured at the loss's seed is decoded at the root's same-step scale"),
    "loss-seed-spreads": (
        "adaloss_jax/_stream.py",
        "                cur |= {ROOT} if SEED in got else got",
        "                cur |= got",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the regions below the loss's cast run at the seed, not the root's scale"),
    "loss-seed-with-a-parameter": (
        "adaloss_jax/_stream.py",
        "        seeded = not read_in_loss and _left_by_casts(whole, region, loss_region, casts)",
        "        seeded = _left_by_casts(whole, region, loss_region, casts)",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a parameter read in the loss's region runs at the seed, unscaled at the root's"),
    "loss-seed-left-by-any-point": (
        "adaloss_jax/_stream.py",
        "                if n not in casts or ry is not loss_region or rx is loss_region:",
        "                if rx is loss_region:",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a loss region holding narrow values runs at the seed, its rise never checked"),
    "starved-peak-recorded": (
        "adaloss_jax/_rule.py",
        "        keep_peak = keep_peak | (starved & (amax > 0))",
        "        keep_peak = keep_peak",
        ["tests/test_rule.py"],
        "a starved group's partial statistics bound its next same-step choices"),
    "refusal-counted-as-nonfinite": (
        "adaloss_jax/_common.py",
        "        notfinite_count=jnp.where(finite, 0, state.notfinite_count + 1),",
        "        notfinite_count=jnp.where(applied, 0, state.notfinite_count + 1),",
        ["tests/test_rule.py"],
        "a refused finite step extends the run of non-finite steps (the blind back-off "
        "and the escalation read it)"),
    "escalation-blames-beside-a-blamed-group": (
        "adaloss_jax/_rule.py",
        "cfg.max_consecutive_skips) & ~jnp.any(act & blamed)",
        "cfg.max_consecutive_skips)",
        ["tests/test_rule.py"],
        "past K non-finite steps the groups an overflow hid are blamed with it"),
    "forward-overflow-marks-overflowed": (
        "adaloss_jax/_rule.py",
        "        overflowed=GroupVector(names, jnp.where(m.loss_finite & ~hold,",
        "        overflowed=GroupVector(names, jnp.where(~hold,",
        ["tests/test_rule.py"],
        "a forward overflow, which moves no scale, rewrites which groups overflowed"),
    "forward-overflow-sets-the-peak": (
        "adaloss_jax/_rule.py",
        "    keep_peak = bad | hold | backs_off | ~m.loss_finite  # (a forward overflow: kept)",
        "    keep_peak = bad | hold | backs_off",
        ["tests/test_rule.py"],
        "a forward overflow's statistics set the held peak of a step that is thrown away"),
    "blind-drop-counts-every-nonfinite-step": (
        "adaloss_jax/_rule.py",
        "    drop = cfg.backoff * jnp.where(blind, _formats.pow2(jnp.minimum(run, 4)), 1.0)",
        "    drop = cfg.backoff * jnp.where(blind, _formats.pow2(jnp.minimum(\n"
        "        base.notfinite_count, 4)), 1.0)",
        ["tests/test_rule.py"],
        "the harder back-off of a group blamed again counts other groups' overflows and "
        "accidents in its run (a group blamed twice dropped by factor ** 16)"),
    "global-peak-is-span-flag": (
        "adaloss_jax/_rule.py",
        "        as_high = top >= log2_max - cfg.margin - 1\n",
        "        as_high = held = top >= log2_max - cfg.margin - 1\n",
        ["tests/test_rule.py"],
        "one global scale's held peak is the span check's flag, not its amax"),
    "fan-in-unified-wrongly": (
        "adaloss_jax/_stream.py",
        "            for s in srcs:  # (from the loss's region, seeded or not: the root)\n",
        "            for s in list(srcs)[:1]:\n",
        ["tests/test_stream.py", "tests/test_adaptive.py"],
        "a fan-in region takes one consumer's scale instead of all of theirs"),
    "scaler-mismatch-unchecked": (
        "adaloss_jax/_adaptive.py",
        "    if state.scaler != scaler:",
        "    if False:",
        ["tests/test_one_liner.py"],
        "an optimizer state built with another scaler is accepted"),
    "same-step-not-the-default": (
        "adaloss_jax/_adaptive_scaler.py",
        '                               self.groups == "module" and self.statistic == "amax")',
        '                               False)',
        ["tests/test_adaptive_scaler.py::test_same_step_is_the_default_per_module_with_the_amax_statistic",
         "tests/test_adaptive.py::test_simulated_e5m2_cotangents_scaled_beat_unscaled"],
        "per module, the scales are the rule's unless same_step=True is passed"),
    "first-choice-no-reserve": (
        "adaloss_jax/_channel.py",
        "    reserve = min(first_reserve(cts), cfg.reserve)",
        "    reserve = 0.0",
        ["tests/test_live.py", "tests/test_live_warmup.py",
         "tests/test_channel.py"],
        "a first same-step choice keeps no room for its kernel gradient's sum over rows: "
        "step 1 overflows it"),
    "root-cast-unmeasured": (
        "adaloss_jax/_grad.py",
        "    casts = _jaxpr.widening_casts(jaxpr, narrow)",
        "    casts = []",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the root's cotangent is measured only after the loss casts it down: in the tiny "
        "regime it flushes there, the root jumps blind, and step 1 is skipped too"),
    "nested-loss-cast-unmeasured": (
        "adaloss_jax/_jaxpr.py",
        "        bodies = (cast_bodies(eqn) if kind in",
        "        bodies = ([] if kind in",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a loss jitted whole (or its cross-entropy jitted, or the loss under "
        "jax.checkpoint) gets no point at its cast: in the tiny regime the root measures "
        "nothing, jumps blind, and step 1 is skipped too"),
    "initial-log2-by-xla": (
        "adaloss_jax/_state.py",
        "    s0 = math.log2(scaler.initial_scale)",
        "    s0 = jnp.log2(jnp.float32(scaler.initial_scale))",
        ["tests/test_state.py::test_the_initial_log2_scales_are_exact_integers"],
        "the initial log2 scale taken by XLA's float32 log2: 2**15 starts at 2**14.999999, "
        "off a power of two"),
    "fp16-starts-at-1": (
        "adaloss_jax/_adaptive_scaler.py",
        '2.0**15 if fmt.name == "float16" else 1.0)',
        "1.0)",
        ["tests/test_live_warmup.py::test_an_attention_block_keeps_room_for_its_kernel_sums_and_skips_nothing",
         "tests/test_diagnostics.py::test_a_global_state_is_one_row_and_reads_like_an_adaptive_one"],
        "fp16 starts at scale 1: the root's step 0 far below its scale, skipped (the "
        "front ends' small MLPs apply it from 1 as well)"),
    "fp16-module-rise-capped-at-5": (
        "adaloss_jax/_adaptive_scaler.py",
        '_MODULE_RISE = {"float16": 16, "float8_e5m2": 10}',
        '_MODULE_RISE = {"float16": 5, "float8_e5m2": 10}',
        ["tests/test_live_warmup.py::test_an_attention_block_keeps_room_for_its_kernel_sums_and_skips_nothing"],
        "fp16 per module keeps max_rise 5: a first choice's room for its kernel sums is "
        "capped at 5 binades, and the head's overflows at step 0"),
    "scanned-loss-cast-unmeasured": (
        "adaloss_jax/_jaxpr.py",
        '    if eqn.primitive.name == "scan" and isinstance(inner, jcore.ClosedJaxpr):',
        "    if False and isinstance(inner, jcore.ClosedJaxpr):",
        ["tests/test_live_warmup.py::test_a_loss_cast_inside_a_nested_equation_is_measured_before_it_narrows",
         "tests/test_live_warmup.py::test_a_cross_entropy_in_a_scan_or_cond_gets_its_points_and_stays_exact"],
        "a cross-entropy computed chunk by chunk in a scan gets no point at its cast: in "
        "the tiny regime the root measures nothing, jumps blind, and step 1 is skipped "
        "too"),
    "sharded-loss-cast-unmeasured": (
        "adaloss_jax/_jaxpr.py",
        '    if (eqn.primitive.name == "shard_map" and isinstance(inner, jcore.Jaxpr)',
        "    if (False and isinstance(inner, jcore.Jaxpr)",
        ["tests/test_live_warmup.py::test_a_loss_cast_inside_a_nested_equation_is_measured_before_it_narrows",
         "tests/test_live_warmup.py::test_a_cross_entropy_in_a_scan_or_cond_gets_its_points_and_stays_exact"],
        "a cross-entropy computed per device in a shard_map gets no point at its cast: in "
        "the tiny regime the root measures nothing, jumps blind, and step 1 is skipped "
        "too"),
    "untaken-branch-starves": (
        "adaloss_jax/_channel.py",
        "    zero = (amax_r == 0) & ~_untaken(rows, amax_r)",
        "    zero = amax_r == 0",
        ["tests/test_channel.py::test_a_cond_branch_not_taken_starves_nothing",
         "tests/test_live_warmup.py::test_a_loss_cast_inside_a_nested_equation_is_measured_before_it_narrows"],
        "a cond's branch not taken (its row of zeros) starves its groups: a loss casting "
        "in both branches holds the root's jump below its statistics, and step 1 is "
        "refused"),
    "every-branch-row-untaken": (
        "adaloss_jax/_channel.py",
        "    return jnp.asarray([r.branch is not None for r in rows]) & seen[idx]",
        "    return jnp.asarray([r.branch is not None for r in rows])",
        ["tests/test_channel.py::test_a_cond_branch_not_taken_starves_nothing",
         "tests/test_live_warmup.py::test_the_loss_cast_is_measured_around_every_transformation"],
        "zeros that arrived in a cond's taken branch starve nothing (taken for a branch "
        "not taken): the modules there lose what was lost upstream"),
    "every-cast-measured": (
        "adaloss_jax/_grad.py",
        "    return _record.mark_casts(rec, [i for i, k in zip(casts, inside) if k])",
        "    return _record.mark_casts(rec, casts)",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "casts inside modules (a LayerNorm's, attention scores') get a root point too"),
    "wide-row-counted-as-stored": (
        "adaloss_jax/_channel.py",
        "        stored_in = jnp.asarray([r.x_max == fmt_max and not r.wide for r in rows])",
        "        stored_in = jnp.asarray([r.x_max == fmt_max for r in rows])",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the root's fp32 measurement before the cast is taken for a value flushed where "
        "it is stored: the root is capped as starved"),
    "starved-blind-group-lifted-to-floor": (
        "adaloss_jax/_rule.py",
        "        grown = jnp.where(starved, jnp.minimum(grown, jnp.maximum(log2 + blind_jump,",
        "        grown = jnp.where(False, jnp.minimum(grown, jnp.maximum(log2 + blind_jump,",
        ["tests/test_rule.py"],
        "a group that measured nothing because its cotangent arrived as zeros is lifted to "
        "the floor other groups' statistics set, and overflows there"),
    "starved-group-rises-freely": (
        "adaloss_jax/_rule.py",
        "    if starved is not None:  # (values lost below u_min / 2 may be its largest)",
        "    if False:  # (values lost below u_min / 2 may be its largest)",
        ["tests/test_rule.py", "tests/test_live.py"],
        "a group whose incoming cotangents flushed rises to what its partial statistics "
        "call for, and overflows what was lost"),
    "starved-jump-ignores-what-it-measured": (
        "adaloss_jax/_rule.py",
        "    lowest = jnp.where(known > -jnp.inf, jnp.ceil(math.log2(fmt.min_normal) - known),",
        "    lowest = jnp.where(False, jnp.ceil(math.log2(fmt.min_normal) - known),",
        ["tests/test_rule.py", "tests/test_live.py"],
        "a starved group jumps by the blind jump alone, below where the value it measured "
        "on the wide side of a cast is kept: the cast flushes it again and the next step "
        "is skipped too"),
    "lost-values-forgotten-downstream": (
        "adaloss_jax/_rule.py",
        "    known = unit if m.lost_amax is None else jnp.maximum(unit, m.lost_amax)",
        "    known = unit",
        ["tests/test_rule.py", "tests/test_live.py"],
        "a group that received only zeros ignores the value measured upstream before it "
        "was lost and jumps blind: the scanned GPT's final LayerNorm flushes again at "
        "step 1"),
    "zeros-carry-nothing": (
        "adaloss_jax/_channel.py",
        "        came = jax.ops.segment_max(jnp.where(zero, now[y_set], -jnp.inf), x_set, ns)",
        "        came = now",
        ["tests/test_channel.py", "tests/test_live.py"],
        "what was lost is known only to the region right after where it was lost, not "
        "along the rows of zeros that follow"),
    "decider-bounds-read-apart": (
        "adaloss_jax/_channel.py",
        "        chosen_x, mine = decide(amax, cts, ly, limits, cfg, pc.dummy_axes)\n",
        "        chosen_x, _ = decide(amax, cts, ly, limits, cfg, pc.dummy_axes)\n"
        "        mine = chosen_x - limits[2]\n",
        ["tests/test_live.py::test_each_live_region_adds_at_most_one_distinct_kernel_to_the_delayed_rules"],
        "the same numbers, but each decider's plan is read outside its conditional: a "
        "kernel of its own per group, each compiled"),
    "bench-run-key-ignores-options": (
        "adaloss_jax/bench/_report.py",
        '            row["settings"], row.get("spec", ""))',
        '            row["settings"], "")',
        ["tests/test_bench.py::test_cli_end_to_end_and_resume"],
        "a stored bench run made under other options (an older default) is reused"),
    "families-import-each-other": (
        "adaloss_jax/_global_transforms.py",
        "from adaloss_jax import _global_scalers, _lookup",
        "from adaloss_jax import _global_scalers, _lookup, _state  # noqa: F401",
        ["tests/test_layering.py"],
        "the global transformations import the adaptive state again"),
    "layer-runs-skip-a-layer": (
        "adaloss_jax/_layout.py",
        "and slots[j].group == first.group and slots[j].index == j - i):",
        "and slots[j].group == first.group):",
        ["tests/test_layout.py"],
        "a stack missing a layer is stored as one run (each layer reads its neighbour's)"),
    "adaptive-state-not-registered": (
        "adaloss_jax/_state.py",
        '_lookup.register(AdaptiveScaleState, unscale="adaptive_unscale", '
        'scaled="adaptive_scaled")',
        "",
        ["tests/test_layering.py", "tests/test_state.py"],
        "scale_state cannot find an adaptive state"),
    "branch-deciders-dropped": (
        "adaloss_jax/_live.py",
        "            branch[g] = _branch_deciders(d, keys, rest, order, conds)",
        "            branch[g] = []",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a region with entries in several cond branches decides only in the last"),
    "branch-decider-emits-for-itself": (
        "adaloss_jax/_live.py",
        "(g in live and live[g] != key and others.get(key) != g)",
        "(g in live and live[g] != key)",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a decider in another cond branch also emits a token for its own region"),
    "branch-border-unchecked": (
        "adaloss_jax/_live.py",
        "            if all(order[k][1] < order[d_b][1] for k in there if k != d_b):",
        "            if True:",
        ["tests/test_live.py"],
        "a branch decides though a point of its region's border follows its decider"),
    "branch-nested-conds-ignored": (
        "adaloss_jax/_live.py",
        "                out += [d_b, *_branch_deciders(d_b, mine, there, order, inner)]",
        "                out += [d_b]",
        ["tests/test_live.py"],
        "a cond nested in another branch of the cond around a decider gets no deciders"),
    "branch-conds-unrecorded": (
        "adaloss_jax/_apply.py",
        "                        conds.append((scope, at))",
        "                        pass",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "the walk records no cond: only the last branch decides"),
    "own-ignored": (
        "adaloss_jax/_rule.py",
        "    checked = act & (amax > 0) & ~bad & (True if m.own is None else m.own)",
        "    checked = act & (amax > 0) & ~bad",
        ["tests/test_rule.py", "tests/test_live_warmup.py"],
        "a group that measured nothing of its own refuses a step as computed below its scale"),
    "own-counts-fan-ins": (
        "adaloss_jax/_channel.py",
        "                if side not in (moved or {}):",
        "                if True:",
        ["tests/test_live_warmup.py"],
        "a live fan-in's rows count as its anchors' own"),
    "own-params-ignored": (
        "adaloss_jax/_decide.py",
        "        own = (full(stats.own, False, jnp.bool_) | (p_amax > 0)) & ~adopted",
        "        own = full(stats.own, False, jnp.bool_) & ~adopted",
        ["tests/test_rule.py"],
        "a group whose parameter gradients measured something, but none of its rows, is "
        "not checked against max_rise"),
    "adopted-counts-own": (
        "adaloss_jax/_decide.py",
        "        own = (full(stats.own, False, jnp.bool_) | (p_amax > 0)) & ~adopted",
        "        own = full(stats.own, False, jnp.bool_) | (p_amax > 0)",
        ["tests/test_rule.py", "tests/test_live_warmup.py"],
        "a group that adopted a fan-in's choice refuses a step as computed below its scale"),
    "fan-in-slots-refused": (
        "adaloss_jax/_live.py",
        "            and all(type(g) is str or _slot(g) for g in anchors)):",
        "            and all(type(g) is str for g in anchors)):",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a fan-in holding a stack's slot keeps the plan: a GRU before a stack skips step 0"),
    "fan-in-slot-members-stacked": (
        "adaloss_jax/_live.py",
        "        if isinstance(g, tuple) and (g in parts or {a for a in g if not _slot(a)}",
        "        if isinstance(g, tuple) and (g in parts or set(g)",
        ["tests/test_live.py"],
        "a fan-in read by a layer the stack's body names keeps the plan"),
    "fan-in-parts-ignored": (
        "adaloss_jax/_live.py",
        "        if isinstance(g, tuple) and (g in parts or {a for a in g if not _slot(a)}",
        "        if isinstance(g, tuple) and (False or {a for a in g if not _slot(a)}",
        ["tests/test_live.py"],
        "a fan-in met as one layer's part of per-layer anchors decides outside the scan"),
    "chain-last-one-group-only": (
        "adaloss_jax/_live.py",
        "    return Chain(slots, key, run[0], region_key(y[run[-1]]))",
        "    return Chain(slots, key, run[0], single(y[run[-1]]))",
        ["tests/test_live.py"],
        "a chain read by several modules hands its last token to nobody: they keep the plan"),
    "stream-last-one-group-only": (
        "adaloss_jax/_live.py",
        "    last = region_key(out[run[-1]])",
        "    last = single(out[run[-1]])",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a stream read by several modules after its stack keeps their fan-in at the plan"),
    "adoption-none": (
        "adaloss_jax/_live.py",
        "            if f is not None and not more and g != ROOT and g not in alone | taken}",
        "            if False}",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "no group adopts a fan-in's choice: an OptimizedLSTMCell's gates keep the plan"),
    "adoption-ignores-alone": (
        "adaloss_jax/_live.py",
        "            if f is not None and not more and g != ROOT and g not in alone | taken}",
        "            if f is not None and not more and g != ROOT and g not in taken}",
        ["tests/test_live.py"],
        "a group with a region of its own adopts a fan-in's choice"),
    "adoption-ignores-other-leaves": (
        "adaloss_jax/_live.py",
        "            if f is not None and not more and g != ROOT and g not in alone | taken}",
        "            if f is not None and g != ROOT and g not in alone | taken}",
        ["tests/test_live.py"],
        "a group with a parameter read elsewhere adopts a fan-in's choice"),
    "adopted-params-converted": (
        "adaloss_jax/_apply.py",
        "                continue  # (its group's scale is the fan-in's choice: as computed)",
        "                pass",
        ["tests/test_live.py"],
        "an adopting group's parameter gradients convert to its planned scale (with no "
        "token: the plan's ratio)"),
    "adopted-scale-is-plan": (
        "adaloss_jax/_grad.py",
        "                    if g in adopts:",
        "                    if False:",
        ["tests/test_live.py"],
        "an adopting group is unscaled by its planned scale, not the fan-in's choice"),
    "own-counts-float32": (
        "adaloss_jax/_channel.py",
        "            e_own.append(i in own and lim < _WIDE)",
        "            e_own.append(i in own)",
        ["tests/test_equinox.py"],
        "rows held in float32's range count for the max_rise check"),
    "time-decides-at-every-step": (
        "adaloss_jax/_apply.py",
        "        recurrent = group is not None and group in live.over_time",
        "        recurrent = False",
        ["tests/test_live.py"],
        "a decider in a scan over time chooses at every step, not once for all"),
    "time-decides-at-the-first-step": (
        "adaloss_jax/_apply.py",
        "(0 if p[\"reverse\"] else n - 1)",
        "(n - 1 if p[\"reverse\"] else 0)",
        ["tests/test_live.py"],
        "a scan over time decides at the step executed first, not the one the backward "
        "pass runs first"),
    "time-tokens-before-left-out": (
        "adaloss_jax/_apply.py",
        "        first = [sum(live.tokens.pop(g, []), zero) for g in inside]",
        "        first = [zero for g in inside]",
        ["tests/test_live.py"],
        "the points before a scan over time read the plan, not the choice made inside"),
    "time-after-token-last-step-only": (
        "adaloss_jax/_apply.py",
        "            live.tokens.setdefault(g, []).append(jnp.sum(t))",
        "            live.tokens.setdefault(g, []).append(t[-1])",
        ["tests/test_live.py"],
        "only a scan over time's last step reads the choice of a region after it"),
    "time-late-border-refused": (
        "adaloss_jax/_live.py",
        "(order[k][1] < at or carried and k not in keys)",
        "(order[k][1] < at)",
        ["tests/test_live.py"],
        "a region in a scan over time with a border point after its decider keeps the "
        "plan"),
    "time-outside-entries-ignored": (
        "adaloss_jax/_live.py",
        "        inside = {g: d for g, d in found.items() if g not in barred and g not in live}",
        "        inside = {g: d for g, d in found.items() if g not in live}",
        ["tests/test_live.py"],
        "a region read outside a scan over time (or in two of them) decides inside it"),
    "time-late-outside-border-allowed": (
        "adaloss_jax/_live.py",
        "            before.setdefault(gy, []).append(k) if early(k) else barred.add(gy)",
        "            before.setdefault(gy, []).append(k)",
        ["tests/test_live.py"],
        "a region in a scan over time decides though its border outside follows the "
        "scan"),
    "halfway-float32-span": (
        "adaloss_jax/_channel.py",
        "    return (max(low, math.log2(_formats.FLOAT16.min_subnormal)),",
        "    return (low,",
        ["tests/test_live.py"],
        "a fan-in deciding at a float32 point puts its cotangent halfway down float32's "
        "span, where its region's float16 values flush"),
    "held-span-float32-max": (
        "adaloss_jax/_channel.py",
        "            math.log2(min(x_max, _formats.FLOAT16.max)))",
        "            math.log2(x_max))",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "a decider at a float32 point aims at float32's largest value, which its "
        "region's float16 values overflow"),
    "time-scans-unrecorded": (
        "adaloss_jax/_apply.py",
        "                elif kind == _jaxpr.SCAN and scope == ():  # a scan over time",
        "                elif False:",
        ["tests/test_live.py", "tests/test_live_warmup.py"],
        "no region decides in a scan over time"),
}


def run(name: str, keep: bool, fast: bool = False) -> tuple[bool | None, float, str]:
    """(caught, seconds, detail); caught is None where the text to mutate is stale.
    ``fast``: only the fast tier's cases of the mutation's tests run (``-m "not slow"``)."""
    path, old, new, tests, _ = MUTATIONS[name]
    tmp = tempfile.mkdtemp(prefix=f"mut-{name}-")
    try:
        shutil.copytree(ROOT, os.path.join(tmp, "repo"),
                        ignore=shutil.ignore_patterns(".git", "bench-results", "__pycache__",
                                                      ".hypothesis", "_build"))
        repo = os.path.join(tmp, "repo")
        target = os.path.join(repo, path)
        text = open(target).read()
        if text.count(old) != 1:
            return None, 0.0, (f"the text to mutate occurs {text.count(old)} times in {path}: "
                               "update it to the code as it is now")
        open(target, "w").write(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": repo}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "-n", "2", *(["-m", "not slow"] if fast else []), *tests],
                              cwd=repo, env=env, capture_output=True,
                              text=True)
        failed = [ln.split(" ")[1] for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
        return proc.returncode != 0, time.perf_counter() - t0, (failed[0] if failed else
                                                                proc.stdout.strip()[-200:])
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma list of mutation names")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies")
    parser.add_argument("--fast", action="store_true",
                        help="run only the fast tier's cases of each mutation's tests")
    parser.add_argument("--tests", default="",
                        help="only the mutations whose tests include this file name")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(MUTATIONS)
    names = [n for n in names if any(args.tests in t for t in MUTATIONS[n][3])]
    survived = 0
    for name in names:
        caught, seconds, detail = run(name, args.keep, args.fast)
        survived += not caught
        verdict = "STALE" if caught is None else "caught" if caught else "SURVIVED"
        print(f"{verdict:<9} {name:<34} {seconds:5.0f} s  "
              f"{MUTATIONS[name][4]}\n          first failing test: {detail}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
