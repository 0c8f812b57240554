"""A mutation score measured by a tool (issue 31): mutmut's mutants of the core and the
front ends, a seeded random sample of them, each run against the fast tier's tests.

``benchmarks/mutations.py`` keeps the hand-written breaks; this script asks a tool for
breaks nobody planned. mutmut (pinned: its mutant names and options are read here)
generates every mutant of the files ``[tool.mutmut] only_mutate`` names in
``pyproject.toml``; the script draws ``--sample`` of them with ``random.Random(--seed)``,
runs them with ``mutmut run NAME ...`` (each mutant against the fast-tier tests that
reach its function, ``-x``), and prints the score: killed / (sampled - equivalent).
Mutants argued equivalent (no input can tell them from the original) are listed in
:data:`EQUIVALENT` with a line each; the diff is checked, so a stale entry is reported
rather than silently counted.

Usage (from the repository root; 2 CPU cores: the first run collects which tests reach
which function, about ten minutes, then roughly a minute per mutant)::

    pip install mutmut==3.8.1
    python benchmarks/mutation_score.py                 # seed 31, 100 mutants
    python benchmarks/mutation_score.py --survivors     # after adding tests: rerun the rest
    python benchmarks/mutation_score.py --list          # the sample's names, no run
    python benchmarks/mutation_score.py --show NAME     # one mutant's diff
    python benchmarks/mutation_score.py --within _live.x__stream__ --sample 12  # new code

mutmut works in ``mutants/`` (ignored by git); delete it after changing the package.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip install tomli
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 31
SAMPLE = 100

# name: (a line of the mutant's diff, why no test can tell it from the original)
EQUIVALENT: dict[str, tuple[str, str]] = {
    "adaloss_jax.flax._linen.xǁTrainStateǁapply_gradients__mutmut_2": (
        '+    extra = {} if (scale_stats is None) and False else {"scale_stats": scale_stats}',
        "scale_stats=None passed explicitly instead of left out: TrainState's tx is always "
        "a scaler's transformation (create wraps it, or the user's scaled one), whose "
        "update takes scale_stats=None as its default (a plain optax tx fails on loss= "
        "first)"),
    "adaloss_jax._decide.x_measured__mutmut_162": (
        "+        count=over_devices(full(stats.count, 1.0, jnp.float32), jax.lax.psum,",
        "a group absent from the step's statistics gets count 1 instead of 0: the rule reads "
        "count only through max(count, 1) (_rule._gaussian), and an absent group keeps "
        "its state"),
    "adaloss_jax._rule.x__quantile__mutmut_8": (
        "+    zero = jnp.zeros(hist.shape[:-1] + (1,), )",
        "the default float dtype is float32 unless x64 is on; with x64 the cumulative "
        "counts are promoted to float64, the same whole numbers, so the same quantile"),
    "adaloss_jax._jaxpr.x__label__mutmut_9": (
        '+    label = eqn.params.get("name", None)',
        "a jit equation without a name: the default, '' or None, is returned as '' by "
        "the isinstance test that follows either way"),
    "adaloss_jax._common.x_all_finite__mutmut_13": (
        "+        ok = jax.lax.pmin(ok.astype(None), axis_name) > 0",
        "astype(None) makes the bool a float32 0.0/1.0; its pmin is > 0 exactly when "
        "the int32 one is"),
    "adaloss_jax._apply.x__eval_run__mutmut_24": (
        '+    info = jcore.DebugInfo("ADALOSS_JAX", "the recorded loss", tuple("" for _ in free),',
        "the name a replayed jaxpr's debug info is traced for: read by nothing, printed "
        "by nothing a user sees"),
    "adaloss_jax._apply.xǁProgramǁdummies__mutmut_4": (
        "+    return [jnp.zeros((*s.lead, self.columns.width), ) for s in self.sites()]",
        "jnp.zeros' default dtype is float32 (jax_enable_x64 off, as the library runs)"),
    "adaloss_jax._stream.xǁ_Walkerǁwalk__mutmut_148": (
        "+                           )",
        "a nested jaxpr's constants joined to its equation's region: the walk of its body "
        "with that region as its blob joins every variable an equation there reads, "
        "constants included, and a constant nothing reads belongs to no region"),
    "adaloss_jax._grad.x__limits__mutmut_24": (
        "+        cols = table[:, jnp.asarray([names.index(g) for g in a], )]",
        "an anchor set is never empty, so the indices are Python ints, which jnp.asarray "
        "makes int32 (jax_enable_x64 off, as the library runs; int64 with it on, as "
        "good an index)"),
    "adaloss_jax._stream.xǁ_Walkerǁwalk__mutmut_137": (
        "+        self.union(*ins, *outs)",
        "outside a blob the representative is one of the equation's own variables, "
        "joined either way; inside one, the blob's inputs, constants and outputs are "
        "joined to it, every equation there joins what it reads and writes (plain ones "
        "with the blob, nested ones among themselves), so a nested equation's variables "
        "reach the blob through its inputs or its readers, and an output read by nothing "
        "belongs to no region that matters"),
    "adaloss_jax._adaptive_scaler.xǁAdaptiveScaleǁ__post_init____mutmut_146": (
        "+        module = _MODULE_RISE.get(fmt.name, 1) if self.groups == \"module\" else 0",
        "the default max_rise is max(module, backoff + 1), and backoff = log2(factor) >= 1 "
        "for every factor check_growth_factor accepts (a power of two > 1): a format "
        "without a module rise of its own gets backoff + 1 >= 2 whether the default is 0 "
        "or 1"),
    "adaloss_jax._apply.xǁProgramǁ_live__mutmut_32": (
        "+                if kind == _jaxpr.COND or scope == ():",
        "it records as conds also the top level's jit, checkpoint and one-iteration scan "
        "equations, and the conds met in a scan's body: _branch_deciders looks for other "
        "branches with entries, and an equation of one sub-program has none (jit, "
        "closed_call, core_call, checkpoint and scan each hold one); the conds of other "
        "scopes are skipped by its scope test (only the top level's regions get branch "
        "deciders, all of scope ())"),
    "adaloss_jax._channel.x_convert_param__mutmut_6": (
        "+    cfg = PointConfig(None, convert=True, measure=False, y_max=inf, x_max=inf)",
        "a parameter conversion measures nothing (measure=False): its backward pass "
        "returns before measure(), the only reader of a PointConfig's columns"),
    "adaloss_jax._apply.xǁProgramǁ_over_time__mutmut_18": (
        "+    zero = jnp.zeros((), )",
        "jnp.zeros' default float dtype is float32 (jax_enable_x64 off, as the library "
        "runs), the dtype it names"),
    "adaloss_jax._state.x_initial_state__mutmut_78": (
        "+        ceiling=GroupVector(groups, jnp.full((n,), jnp.inf, )),",
        "jnp.full's default float dtype is float32 (jax_enable_x64 off, as the library "
        "runs), the dtype it names"),
    "adaloss_jax._decide.x_measured__mutmut_257": (
        "+            full(stats.lost_amax, +jnp.inf, jnp.float32), jax.lax.pmax, axis_name),",
        "the fill of the groups absent from the step's statistics: the rule reads "
        "lost_amax only through its floor `lowest`, applied where a group is starved, and "
        "an absent group's starved is filled False (with +inf, lowest is -inf, not NaN); "
        "the state's statistics keep the channel's own lost_amax, not this one"),
    "adaloss_jax._live.x__inside__mutmut_65": (
        "+                              firsts=marks - {FOLLOW}, )",
        "_inside keeps only the regions a layer's symbol (or the stream) names, never a "
        "fan-in's anchor set, and only needs of those; a fan-in's entries and border go "
        "under its own key and change no other region's (no conds in a layer's body: no "
        "branch deciders)"),
}


def _mutmut():
    try:
        import mutmut  # noqa: F401
    except ImportError:
        sys.exit("needs mutmut 3.8.1: pip install mutmut==3.8.1")
    from mutmut import __main__ as cli
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code
    return cli, get_diff_for_mutant, status_by_exit_code


def _generate(cli):
    """Every mutant mutmut makes of the configured files: {name: SourceFileMutationData}."""
    cli.set_mutant_under_test("mutant_generation")
    os.makedirs("mutants", exist_ok=True)
    cli.copy_src_dir()
    cli.copy_also_copy_files()
    cli.setup_source_paths()
    cli.store_lines_covered_by_tests()
    cli.create_mutants(os.cpu_count() or 2)
    by_name = {}
    for path in cli.walk_mutatable_files():
        data = cli.SourceFileMutationData(path=path)
        data.load()
        for name in data.exit_code_by_key:
            by_name[name] = data
    return by_name


def _diff(get_diff, name, data):
    return get_diff(name, path=data.path)


def _tests_fail(name: str) -> str | None:
    """mutmut picks a mutant's tests by the calls it saw while each test ran, so a
    function called when a module is imported (a format table, a registry) has none or
    the wrong ones, and a test that reaches it through a jitted or cached program may be
    missed. A mutant that survived those runs once more against its module's own test
    file, ``tests/test_<module>.py`` where one exists, then against the whole fast tier
    as ``[tool.mutmut] pytest_add_cli_args_test_selection`` selects it (stopping at the
    first failure). Returns which killed it, with the first failing test, or ``None``."""
    module = name.split(".x")[0].rsplit(".", 1)[-1].lstrip("_")
    own = os.path.join("tests", f"test_{module}.py")
    env = {**os.environ, "MUTANT_UNDER_TEST": name}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        selection = tomllib.load(f)["tool"]["mutmut"]["pytest_add_cli_args_test_selection"]
    runs = [("its module's tests", [own, "-p", "no:xdist"])] if os.path.exists(own) else []
    runs.append(("the fast tier", [*selection, "-n", "2"]))
    for what, args in runs:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly",
                              "-p", "no:cacheprovider", *args],
                             cwd="mutants", env=env, capture_output=True, text=True)
        failed = [line.split()[1] for line in run.stdout.splitlines()
                  if line.startswith("FAILED ")]
        killed = run.returncode == 1 or bool(failed)  # (xdist's -x exits with 2)
        print(f"{name}: {what} {'fail (killed)' if killed else 'pass'}"
              + (f": {failed[0]}" if failed else ""))
        if killed:
            return what + (f" ({failed[0]})" if failed else "")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--sample", type=int, default=SAMPLE)
    ap.add_argument("--within", default="", metavar="TEXT",
                    help="draw only mutants whose name holds TEXT (new code: "
                         "'_live.x__stream__' for the mutants of _live._stream)")
    ap.add_argument("--list", action="store_true", help="print the sample and stop")
    ap.add_argument("--show", metavar="NAME", help="print one mutant's diff and stop")
    ap.add_argument("--rerun", action="store_true",
                    help="run every sampled mutant again, not only those without a result")
    ap.add_argument("--survivors", action="store_true",
                    help="run again the sampled mutants no test killed (after adding tests)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    cli, get_diff, status_of = _mutmut()
    with open(os.devnull, "w") as quiet:
        saved = sys.stdout
        sys.stdout = quiet
        try:
            by_name = _generate(cli)
        finally:
            sys.stdout = saved
    names = sorted(n for n in by_name if args.within in n)
    if not names:
        sys.exit(f"no mutant's name holds {args.within!r} (names look like "
                 f"{sorted(by_name)[0]}); --list shows a sample")
    sample = sorted(random.Random(args.seed).sample(names, min(args.sample, len(names))))
    print(f"mutmut: {len(names)} mutants of the core and front ends"
          + (f" whose name holds {args.within!r}" if args.within else "")
          + f"; sample of {len(sample)} with seed {args.seed}")
    if args.show:
        print(_diff(get_diff, args.show, by_name[args.show]))
        return 0
    if args.list:
        for name in sample:
            print(name)
        return 0
    settled = ("killed", "survived", "no tests", "check was interrupted by user")  # else: again
    status = {n: status_of[by_name[n].exit_code_by_key.get(n)] for n in sample}
    todo = [n for n in sample if args.rerun or status[n] not in settled
            or (args.survivors and status[n] != "killed")]
    start = time.time()
    if todo:
        subprocess.run([sys.executable, "-m", "mutmut", "run", *todo], check=False)
    minutes = (time.time() - start) / 60
    for data in set(by_name.values()):
        data.load()
    status = {n: status_of[by_name[n].exit_code_by_key.get(n)] for n in sample}
    for name in sample:
        # pytest's exit code 2 ("interrupted", as mutmut calls it): nobody interrupts
        # here; it is the code of a test module that fails to import the mutant.
        if by_name[name].exit_code_by_key.get(name) == 2:
            status[name] = "killed (the tests fail to import it)"
        elif status[name] == "segfault":  # (mutmut's name for a crashed test process:
            # the tests did not pass, so the break was caught)
            status[name] = "killed (the tests' process crashed)"
    for name in sample:
        if status[name] in ("survived", "no tests"):
            by = _tests_fail(name)
            if by:
                status[name] = f"killed by {by}"
    stale = []
    equivalent = []
    for name, (line, _why) in EQUIVALENT.items():
        if name not in status:
            continue
        if line not in _diff(get_diff, name, by_name[name]):
            stale.append(name)
        elif not status[name].startswith("killed"):
            equivalent.append(name)
    unrun = [n for n in sample if status[n] == "not checked"]
    if unrun:  # (no score: mutmut ran none of these, most often because its first run of
        # the tests, the one that finds which tests reach which function, failed)
        print(f"mutmut ran {len(unrun)} of the {len(sample)} sampled mutants not at all "
              f"(see its output above: 'failed to collect stats' means a test fails in "
              f"mutants/ without any mutant; run the fast tier there to see which, and "
              f"deselect a test that reads the package's source in pyproject.toml's "
              f"[tool.mutmut]): no score", file=sys.stderr)
        return 2
    counted = [n for n in sample if n not in equivalent]
    killed = [n for n in counted if status[n].startswith("killed")]
    print()
    print(f"{'mutant':64s} status")
    for name in sample:
        mark = " (equivalent)" if name in equivalent else ""
        print(f"{name:64s} {status[name]}{mark}")
    print()
    for name in counted:
        if not status[name].startswith("killed"):
            print(f"--- {status[name]}: {name}")
            print(_diff(get_diff, name, by_name[name]))
    for name in stale:
        print(f"stale EQUIVALENT entry (its diff changed): {name}")
    score = len(killed) / max(len(counted), 1)
    print(f"\nscore: {len(killed)} killed of {len(counted)} non-equivalent sampled mutants "
          f"= {score:.1%} ({len(equivalent)} equivalent; seed {args.seed}, sample "
          f"{len(sample)}; ran {minutes:.1f} min)")
    return 0 if score >= 0.9 and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
