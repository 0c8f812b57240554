"""Test set-up: 8 CPU devices for the sharding tests, quick compiles, seeded randomness,
and which tests run in the full suite only."""

import os


def _xla_flags():
    """XLA_FLAGS for the tests, set before jax initialises its backends: 8 CPU devices,
    and quick compiles. The tests compile hundreds of small programs and run each a few
    steps, so most of their time is compiling: LLVM at -O0, and XLA's older loop
    emitters for fused kernels instead of its MLIR fusion emitters (each cuts a step's
    compile time: CHANGELOG; the HLO passes are unchanged, and so is the arithmetic,
    fast-math being off, though loops may sum in another order). What they compile is
    kept too (below; the tiers' times on 2 cores: README). Subprocesses and xdist
    workers inherit the variable; one already set (by the user, or a parent) is kept.
    A jaxlib that does not know the emitter flag (XLA aborts on an unknown flag) runs
    without it: one probe process per run decides."""
    if "XLA_FLAGS" in os.environ:
        return
    flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    quick = flags + " --xla_cpu_use_fusion_emitters=false"
    import subprocess
    import sys

    try:
        known = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                               env={**os.environ, "XLA_FLAGS": quick, "JAX_PLATFORMS": "cpu"},
                               capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.SubprocessError):
        known = False
    os.environ["XLA_FLAGS"] = quick if known else flags


_xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _xla_cache():
    """XLA's persistent compilation cache for the tests, in the checkout's `.xla-cache/`
    (git-ignored), shared by the xdist workers and the subprocesses they start.

    Most of a test's time is compiling. Many tests compile the same program (one model,
    one configuration, traced anew), and a program compiled once is then read back
    instead; a later run compiles only the programs a change touched. The cache is keyed
    by the program, the compile options, XLA_FLAGS, the devices and the jaxlib version, so what
    is read back is what would have been compiled. Set JAX_COMPILATION_CACHE_DIR to put
    it elsewhere, ADALOSS_TEST_XLA_CACHE=0 to compile everything. Emptied when it grows
    past 2 GiB (by the first process of a run, before any worker starts).
    """
    if os.environ.get("ADALOSS_TEST_XLA_CACHE", "1") == "0":
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(root, ".xla-cache")
        if "PYTEST_XDIST_WORKER" not in os.environ and os.path.isdir(path):
            size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file())
            if size > 2 * 2**30:
                import shutil

                shutil.rmtree(path, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    # Every program, however quick to compile: the small ones are most of them.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


_xla_cache()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    yield


@pytest.fixture(scope="module")
def mesh():
    """A one-axis ("data") mesh over the 8 CPU devices."""
    import jax

    if jax.device_count() < 8:
        pytest.fail(f"expected 8 CPU devices (XLA_FLAGS above), got {jax.device_count()}")
    return jax.make_mesh((8,), ("data",))


# Property tests really search: random examples, a new draw every run (failures are
# kept in hypothesis's database and replayed first). The fast tier draws a few per test,
# CI (CI=true) more. No shrinking: every example compiles programs, and the strategies
# are small choices that a failure report already names.
def _hypothesis_profiles():
    from hypothesis import Phase, settings

    phases = (Phase.explicit, Phase.reuse, Phase.generate)
    settings.register_profile("fast", max_examples=4, deadline=None, phases=phases)
    settings.register_profile("ci", max_examples=12, deadline=None, phases=phases)
    settings.load_profile("ci" if os.environ.get("CI") else "fast")


_hypothesis_profiles()


# The fast tier's slowest tests (measured with --durations on 2 CPU cores), run in the
# full suite only, every case of each: each has a faster sibling in the fast tier that
# guards the same contract (an mlp for a resnet, one front end for four, a fixed twin for
# a property search, the global scaler's sharded run for the adaptive one's). Listed by
# function; a parametrized test that keeps some of its cases in the fast tier is in
# FAST_TIER_KEEPS instead (an id with a case here is reported as stale).
FULL_SUITE_ONLY = {
    "test_scanned_stacks.py::test_scanned_stack_equals_its_unrolled_twin_exactly_in_fp32",
    "test_scanned_stacks.py::test_nn_scan_stack_gets_a_scale_per_layer_equal_to_its_python_loop_twin",
    "test_scanned_stacks.py::test_a_stack_scanned_over_otherwise_keeps_one_scale",
    "test_scanned_stacks.py::test_per_example_vmap_around_a_scanned_stack_measures_the_batched_loss",
    "test_scanned_stacks.py::test_scanned_stack_scales_each_layer_like_its_unrolled_twin_in_fp16",
    "test_jax_transformations.py::test_transformed_model_measures_what_its_untransformed_twin_measures",
    "test_jax_transformations.py::test_fp32_gradients_exact_under_arbitrary_per_group_scales",
    "test_adaptive_distributed.py::test_spmd_jit_sharded_batch_equals_single_device",
    "test_adaptive_distributed.py::test_untyped_shard_map_devices_agree_only_with_axis_name",
    "test_no_host_sync.py::test_adaptive_step_has_no_host_round_trips",
    "test_bench.py::test_interrupted_bench_keeps_finished_runs",
    "test_adaptive.py::test_check_mode_names_disagreeing_leaves",
    "test_adaptive.py::test_models_applied_to_sub_trees_of_the_parameters_get_their_own_groups",
    "test_one_liner.py::test_state_statistics_or_gradients_of_another_model_are_refused",
    "test_orbax.py::test_checkpoint_manager_round_trip_resumes_bit_identically",
    "test_numerics.py::test_taps_inside_an_adaptive_gradient_see_each_call_once",
    "test_global_transforms.py::test_twin_run_matches_control_that_skips_explicitly",
    "test_flax_free_core.py::test_core_imports_and_trains_without_flax",
    # same-step scales in stacks: the scanned transformer (the forward and reversed
    # chains stay in the fast tier, FAST_TIER_KEEPS, with the analysis's hand-written
    # cases)
    "test_live.py::test_a_scanned_transformer_decides_inside_each_block_as_its_unrolled_twin",
    # the GPTs whose loss cast flushes (the MLP's root-at-the-cast test and the scanned
    # e4m3 GPT's step-0-only test stay), the fp8 peers' scanned twins (their plain
    # equivalences stay)
    "test_live_warmup.py::test_a_gpt_whose_logits_cotangent_flushes_at_the_cast_skips_at_most_step_0",
    "test_bench.py::test_new_fp8_peers_quantize_a_scanned_stack_like_its_unrolled_twin",
}


# Tests parametrized over models, formats, front ends or transformations: the fast tier
# runs the cases named here, the full suite every case (a case added to such a test runs
# in the full suite only until it is named here). For the same-step tests (test_live*.py)
# the cases kept were chosen so that each break of benchmarks/mutations.py the whole fast
# tier caught before still fails in it (CHANGELOG; `python benchmarks/mutations.py --fast`
# checks that); for the others, the cases left out are the slowest, each with a kept
# sibling that guards the same contract.
FAST_TIER_KEEPS = {
    "test_live.py::test_a_residual_streams_fan_in_decides_and_stays_exact_under_transformations":
        ("jit-none", "shard_map-none", "none-remat", "vmap-cond"),
    "test_live.py::test_modules_in_checkpoint_bodies_and_switch_branches_decide_and_stay_exact":
        ("nested-abch-1", "cond inside-abh-1", "decider inside-abch-1", "called twice-ah-0",
         "switch, first taken-abch-1", "switch, last taken-abch-1",
         "nested switch in the first-abch-1"),
    "test_live.py::test_a_scanned_stacks_stream_decides_at_each_layers_exit_and_stays_exact":
        ("True-root-False", "True-parent-False", "False-before-False"),
    "test_live.py::test_a_way_in_deciding_and_stacks_back_to_back_hold_under_transformations":
        ("way in decides-vmap", "stacks back to back-jit", "one layer-remat"),
    "test_live.py::test_a_stack_scanned_straight_into_another_hands_it_its_last_layers_token":
        ("kinds0-reverse0", "kinds3-reverse3", "read-reverse4"),
    "test_live.py::test_an_rnn_over_time_decides_in_its_scan_and_stays_exact":
        ("gru-1-False-False", "gru-5-True-False", "lstm-5-False-True"),
    "test_live.py::test_fan_ins_holding_a_stacks_slot_or_its_last_token_hold_under_transformations":
        ("rnn into stack-vmap", "stream into two-jit", "chain into two-vmap"),
    "test_live.py::test_an_rnn_under_a_transformation_around_the_model_stays_exact":
        ("gru-vmap", "gru-cond", "gru-shard_map_untyped", "olstm-remat"),
    "test_live.py::test_an_rnn_computing_in_float16_gets_float32s_gradients": ("gru", "olstm"),
    "test_live.py::test_a_stacked_parameter_read_in_its_layers_fan_in_converts_per_layer":
        ("none", "cond"),
    "test_live_warmup.py::test_a_scanned_stacks_stream_decides_in_the_pass_and_skips_nothing":
        ("_HighwayScan-float8_e4m3fn-0", "_ResidualScan-float8_e4m3fn--20",
         "one-layer-gpt-float8_e4m3fn-0", "wrapped-gpt-float8_e4m3fn-0"),
    "test_live_warmup.py::test_a_loss_cast_inside_a_nested_equation_is_measured_before_it_narrows":
        ("jit-ce", "remat", "cond-ce-first", "scan-ce", "shard-ce-untyped"),
    "test_live_warmup.py::test_the_loss_cast_is_measured_around_every_transformation":
        ("none-whole", "jit-chunked", "remat-whole", "vmap-chunked", "cond-chunked",
         "shard_map-whole", "shard_map_untyped-chunked"),
    "test_live_warmup.py::test_a_residual_stream_chooses_its_scale_in_the_pass_and_skips_nothing":
        ("attention-float8_e5m2-1024", "mlp-float8_e5m2-64"),
    "test_live_warmup.py::test_modules_under_remat_decide_in_the_pass_and_skip_nothing":
        ("_Remat-float8_e4m3fn--20", "_RematScan-float8_e5m2--20"),
    "test_live_warmup.py::test_a_cross_entropy_in_a_scan_or_cond_gets_its_points_and_stays_exact":
        ("scan", "cond", "shard_map_untyped"),
    "test_live_warmup.py::test_the_root_decided_at_the_cast_holds_under_transformations":
        ("jit-entered", "remat-entered", "vmap-cast"),
    "test_adaptive.py::test_fp32_model_exact_under_arbitrary_per_group_scales":
        ("mlp", "cnn_batchnorm", "unet_concat", "gpt_tied_reused_attention",
         "scanned_stack_shared"),
    "test_adaptive.py::test_module_called_inside_and_outside_lifted_transforms":
        ("module",),
    "test_adaptive.py::test_no_step_is_applied_far_below_the_scale_its_statistics_call_for":
        ("module-mlp-0.000244140625", "module-gpt_tied_reused_attention-9.5367431640625e-07",
         "global-mlp-0.000244140625", "global-gpt_tied_reused_attention-9.5367431640625e-07"),
    "test_adaptive.py::test_simulated_e5m2_cotangents_scaled_beat_unscaled":
        ("module-True",),
    "test_adaptive.py::test_tiny_loss_adaptive_at_least_halves_underflow_of_dynamic":
        ("mlp", "unet_concat"),
    "test_adaptive_distributed.py::test_typed_shard_map_devices_agree_and_equal_one_device":
        ("axis_name", "no-axis_name-retries"),
    "test_bench.py::test_fp8_peers_refuse_a_model_without_fp8_layers":
        ("fp8-current", "fp8-qwix", "fp8-mxfp8"),
    "test_distributed.py::test_state_of_full_parameters_accepts_their_shards":
        ("loss_scaled",),
    "test_documented.py::test_linen_train_state_axis_name_makes_every_device_skip_together":
        ("adaptive",),
    "test_documented.py::test_linen_train_step_has_aux_and_keyword_arguments":
        ("adaptive",),
    "test_documented.py::test_nnx_train_step_wrt_has_aux_and_keyword_arguments":
        ("adaptive",),
    "test_frontend_sharding.py::test_sharded_batch_gives_the_single_device_scales":
        ("pure-jax",),
    "test_jax_transformations.py::test_per_example_vmap_at_batch_256_measures_the_batched_amax":
        ("module",),
    "test_live.py::test_a_scanned_chain_decides_under_transformations_of_the_loss":
        ("none", "vmap"),
    "test_live.py::test_a_scanned_stack_chooses_each_layers_scale_as_its_unrolled_twin":
        ("False-False-False", "False-False-True"),
    "test_live.py::test_a_stack_whose_every_output_is_read_keeps_the_plan_and_stays_exact":
        ("False",),
    "test_messages.py::test_an_adaptive_step_warns_of_nothing":
        ("amax",),
    "test_misuse.py::test_an_adaptive_scaler_on_a_wide_model_turns_itself_off":
        ("bfloat16",),
    "test_misuse.py::test_gradients_not_those_of_the_statistics_raise_a_health_flag":
        ("plain jax.grad-0", "scaled down by 2**-20-0"),
    "test_nnx_adaptive.py::test_fp32_exact_under_arbitrary_per_group_scales":
        ("amax-2",),
    "test_parity.py::test_real_gradients_same_scales_and_skips_as_flax":
        ("2",),
    "test_scanned_stacks.py::test_scanned_stack_equals_its_unrolled_twin_fixed_examples":
        ("True-True-False", "True-False-True"),
}


def _full_suite_only(nodeid: str) -> bool:
    """Whether a test (its id from tests/) runs in the full suite only."""
    function, _, case = nodeid.partition("[")
    keeps = FAST_TIER_KEEPS.get(function)
    return function in FULL_SUITE_ONLY or (keeps is not None and case[:-1] not in keeps)


class _StaleList(pytest.Item):
    """A test that fails, naming the ids in FULL_SUITE_ONLY or FAST_TIER_KEEPS that no
    collected test has (or a function in both).
    (An error raised in the collection hook itself reaches the user under ``-n 2`` only as
    an xdist INTERNALERROR that blames whichever test a worker ran last.)"""

    def __init__(self, *, stale, **kwargs):
        super().__init__(**kwargs)
        self.stale = sorted(stale)

    def runtest(self):
        raise AssertionError(
            "tests/conftest.py's FULL_SUITE_ONLY or FAST_TIER_KEEPS names tests that do not "
            f"exist (renamed or re-parametrized?), or a test in both: {self.stale}. Update "
            "them to their new ids (python -m pytest --co -q lists them); FULL_SUITE_ONLY "
            "takes whole functions, FAST_TIER_KEEPS the cases a parametrized one keeps.")

    def repr_failure(self, excinfo):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, "FULL_SUITE_ONLY / FAST_TIER_KEEPS"


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects by marker
def pytest_collection_modifyitems(session, config, items):
    ids = {item.nodeid.removeprefix("tests/") for item in items}
    for item in items:
        if _full_suite_only(item.nodeid.removeprefix("tests/")):
            item.add_marker(pytest.mark.slow)
    whole_suite = not config.option.file_or_dir and not config.getoption("keyword")
    functions = {i.partition("[")[0] for i in ids}
    kept = {f"{function}[{case}]" for function, cases in FAST_TIER_KEEPS.items()
            for case in cases}
    stale = (FULL_SUITE_ONLY - functions) | (kept - ids) | (FULL_SUITE_ONLY & set(FAST_TIER_KEEPS))
    if stale and whole_suite:  # a renamed test: keep the lists true (a failing test of its
        # own, run first)
        items.insert(0, _StaleList.from_parent(
            session, name="fast-tier-lists-name-existing-tests", stale=stale))
