"""How long the adaptive rule takes to apply a step, over many draws of the rule's
property test (``tests/test_rule.py``: a random state, a hidden model of a backward
pass with growth inside its modules, and random accidents: a NaN in the data, a
forward overflow).

For each format, the draws' longest run of steps not applied (accidents not counted),
as a histogram, its mean and maximum, and how many draws returned a group to a scale it
overflowed at (must be 0). The property test bounds the run by 16 and runs 40 draws
(150 with ``CI`` set); this runs as many as asked, with a seed, to compare two versions
of the rule on the same draws::

    python benchmarks/rule_sweep.py --examples 2000 --seed 7
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_rule  # noqa: E402


def sweep(fmt: str, examples: int, rng_seed: int) -> tuple[collections.Counter, int]:
    longest, returned = collections.Counter(), [0]

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        _, _, _, accidents, (used, bad, applied, _) = test_rule._drawn_run(data, fmt)
        runs = test_rule._unapplied(accidents, applied)
        longest[max(runs.values(), default=0)] += 1
        overflowed_at = np.full(used.shape[1], np.inf)
        for i in runs:
            if not np.all(used[i] < overflowed_at):
                returned[0] += 1
                break
            overflowed_at = np.where(bad[i], np.minimum(overflowed_at, used[i]),
                                     overflowed_at)

    one()
    return longest, returned[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--formats", default=",".join(test_rule._FORMATS))
    args = p.parse_args()
    for fmt in args.formats.split(","):
        hist, returned = sweep(fmt, args.examples, args.seed)
        n = sum(hist.values())
        mean = sum(k * v for k, v in hist.items()) / n
        print(f"{fmt:14s} draws {n}  longest run not applied: mean {mean:.3f}, "
              f"max {max(hist)}  returned to an overflow: {returned}")
        print("  histogram (run: draws):", ", ".join(f"{k}: {v}" for k, v in sorted(hist.items())))


if __name__ == "__main__":
    main()
