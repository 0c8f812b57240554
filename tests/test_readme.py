"""Every ```python snippet in the README and the documentation pages runs as written, with
warnings as errors (so each computes in the dtype it claims: an fp32 model under a
scaler warns), each page in one fresh Python process from an empty directory, every
snippet in a fresh namespace."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
    if p.name not in ("results.md", "changelog.md"))


def snippets(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_shows_the_quickstart_and_every_front_end():
    joined = "\n".join(snippets("README.md"))
    for needle in ("alj.adaptive_scaled(", "alj.scale_group(", "eqx_adaptive_value_and_grad",
                   "TrainState.create(", "nnx_optimizer("):
        assert needle in joined, needle
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220


def run_snippets(blocks: list[str], where: str, cwd, env=None) -> subprocess.CompletedProcess:
    """Runs the snippets in one fresh process with warnings as errors."""
    runner = "\n".join(
        [f"exec(compile({b!r}, '{where} snippet {i}', 'exec'), {{'__name__': '__main__'}})"
         for i, b in enumerate(blocks)] + [f"print('ran {len(blocks)} snippets')"])
    env = {**os.environ, "MPLBACKEND": "Agg", **(env or {})}
    return subprocess.run([sys.executable, "-W", "error", "-c", runner], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_snippet_runs_warning_free(page, tmp_path):
    blocks = snippets(page)
    if not blocks:
        pytest.skip(f"{page} has no python snippet")
    out = run_snippets(blocks, page, tmp_path, {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"ran {len(blocks)} snippets" in out.stdout
