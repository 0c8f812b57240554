"""Skipped steps of the property test's random linen graphs, per module in e4m3, from the
initial scale.

Each graph is a sequence of ``tests/test_stream_property.py``'s ops on token embeddings
(``OPS``: ``dense``, ``residual``, ``scan``, ``rnn`` (a GRU over time), ``olstm`` (Flax's
``OptimizedLSTMCell`` over time), ...), with an untied or tied output layer, the loss
multiplied by 1, 2^-12 and 2^-20; ``alj.adaptive(groups="module",
grad_dtype="float8_e4m3fn", simulate=True)``, ``--steps`` steps of SGD(0) (nothing moves,
so any skip is the scale rule's doing). Printed: the steps skipped, per graph, tie and
multiplier, and the count of runs that skipped any.

Usage::

    python benchmarks/random_graph_skips.py      # the OptimizedLSTMCell graphs; ~4 min
    python benchmarks/random_graph_skips.py --graphs "dense,rnn,residual;scan,cond,scan"
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_live_warmup import _random_net_skips  # noqa: E402

GRAPHS = "olstm;dense,olstm,residual;olstm,scan;rnn,olstm"
MULTIPLIERS = {"x1": 1.0, "x2^-12": 2.0**-12, "x2^-20": 2.0**-20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default=GRAPHS,
                        help="graphs separated by ';', each a comma-separated list of ops")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    graphs = [tuple(g.split(",")) for g in args.graphs.split(";") if g]
    runs = skipping = 0
    print(f"{'graph':32s} {'tied':5s} " + " ".join(f"{m:>10s}" for m in MULTIPLIERS))
    for ops in graphs:
        for tied in (False, True):
            cells = []
            for tiny in MULTIPLIERS.values():
                skipped = _random_net_skips(ops, tied, tiny, steps=args.steps)
                runs += 1
                skipping += bool(skipped)
                cells.append(",".join(map(str, skipped)) or "none")
            print(f"{'+'.join(ops):32s} {str(tied):5s} " + " ".join(f"{c:>10s}" for c in cells),
                  flush=True)
    print(f"{skipping} of {runs} runs skipped a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
