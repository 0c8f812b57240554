"""What ``max_rise`` costs in training: the bench's code-gpt task (tiny regime) with
e4m3 per-module scaling at several ``max_rise``, next to fp32 (issue 22's measurement
behind the default; see docs/results.md section 4).

Usage::

    python benchmarks/max_rise_training.py                      # about a minute
    python benchmarks/max_rise_training.py --rises 0,3 --seeds 0,1,2 --steps 300

Other bench options (``--tasks``, ``--seeds``, ``--out``, ...) pass through to the bench
(``--plots`` turns its plots back on); the extra configs are named ``e4m3-module-rN``.
"""

from __future__ import annotations

import argparse
import sys

from adaloss_jax.bench import _cli, _configs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rises", default="0,1,2", help="comma-separated max_rise values")
    known, rest = parser.parse_known_args(argv)
    names = ["fp32", "e4m3-module"]  # e4m3-module: the default max_rise
    for r in (int(v) for v in known.rises.split(",")):
        config = _configs._ada(f"e4m3-module-r{r}", f"e4m3-module with max_rise={r}",
                               groups="module", max_rise=r, **_configs._E4M3)
        _configs.CONFIGS[config.name] = config
        names.append(config.name)
    defaults = {"--tasks": "code-gpt", "--regimes": "tiny", "--seeds": "0,1",
                "--steps": "150", "--out": "bench-results/max-rise"}
    args = [a for flag, value in defaults.items() if flag not in rest for a in (flag, value)]
    if "--plots" not in rest:
        args.append("--no-plots")
    rest = [a for a in rest if a != "--plots"]
    return _cli.main([*args, *rest, "--configs", ",".join(names)])


if __name__ == "__main__":
    sys.exit(main())
