"""Every ```python snippet in README.md runs as written (each in a fresh namespace, in one
fresh Python process, from an empty working directory, importing this checkout)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def snippets() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_the_one_liner_and_every_front_end():
    joined = "\n".join(snippets())
    assert "optax.chain(alj.adaptive_unscale(), optax.adamw(1e-3))" in joined
    for needle in ("alj.scale_group(", "eqx_adaptive_value_and_grad", "TrainState.create(",
                   "nnx_optimizer("):
        assert needle in joined, needle


def test_every_readme_snippet_runs(tmp_path):
    blocks = snippets()
    runner = "\n".join(
        [f"exec(compile({b!r}, 'README.md snippet {i}', 'exec'), {{'__name__': '__main__'}})"
         for i, b in enumerate(blocks)] + [f"print('ran {len(blocks)} snippets')"])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    out = subprocess.run([sys.executable, "-c", runner], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"ran {len(blocks)} snippets" in out.stdout
