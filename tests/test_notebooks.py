"""The notebooks in notebooks/ are valid, stored without outputs, and run top to bottom.

Each notebook's code cells are joined into one script and run in a fresh Python process
(as a user's kernel would, without jupyter: no new dependency), headless
(``MPLBACKEND=Agg``), from an empty working directory, importing this checkout of the
library. The notebooks carry their own ``assert`` statements, so running them is the test.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the full suite only (CI)

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
EXPECTED = ("quickstart.ipynb", "flax_integration.ipynb", "underflow_diagnosis.ipynb")
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Each notebook takes well under a minute on 2 idle cores; the margin is for a loaded CI box.
TIMEOUT_S = 300


def _load(path: pathlib.Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def notebook_script(nb: dict) -> str:
    """The code cells as one Python script.

    IPython-only lines (``!shell`` escapes and ``%magics``) become ``pass`` at the same
    indentation, so a block that held one stays valid Python.
    """
    lines: list[str] = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in _source(cell).splitlines():
            stripped = line.lstrip()
            if stripped.startswith(("!", "%")):
                line = line[: len(line) - len(stripped)] + "pass  # IPython-only line skipped"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def test_the_expected_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= set(EXPECTED), sorted(p.name for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_nbformat4_without_outputs(path):
    nb = _load(path)
    assert nb.get("nbformat") == 4, f"{path.name}: nbformat {nb.get('nbformat')!r}, expected 4"
    assert isinstance(nb.get("nbformat_minor"), int)
    assert isinstance(nb.get("metadata"), dict)
    cells = nb.get("cells")
    assert isinstance(cells, list) and cells, f"{path.name}: no cells"
    kinds = {c.get("cell_type") for c in cells}
    assert {"markdown", "code"} <= kinds and kinds <= {"markdown", "code", "raw"}, kinds
    for i, cell in enumerate(cells):
        where = f"{path.name} cell {i}"
        assert isinstance(cell.get("metadata"), dict), where
        src = cell.get("source")
        assert isinstance(src, str) or all(isinstance(s, str) for s in src), where
        if cell["cell_type"] == "code":
            # Outputs make diffs noisy and can go stale; CI runs the notebooks instead.
            assert cell.get("outputs") == [], f"{where}: has stored outputs"
            assert cell.get("execution_count") is None, f"{where}: has an execution count"


def test_ipython_lines_are_skipped():
    nb = {"cells": [
        {"cell_type": "markdown", "source": "!not code"},
        {"cell_type": "code", "source": ["!pip install x\n", "if True:\n", "    %time 1\n",
                                          "x = 1"]},
    ]}
    script = notebook_script(nb)
    assert "pip" not in script and "%time" not in script and "not code" not in script
    compile(script, "<notebook>", "exec")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    script = tmp_path / f"{path.stem}.py"
    script.write_text(notebook_script(_load(path)), encoding="utf-8")
    env = dict(os.environ)
    env["MPLBACKEND"] = "Agg"
    # This checkout first, whatever copy of the library is installed.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"{path.name} ran longer than {TIMEOUT_S} s; stderr:\n{(err or '')[-4000:]}")
    assert proc.returncode == 0, (
        f"{path.name} failed (exit code {proc.returncode}).\n"
        f"--- stdout (tail) ---\n{proc.stdout[-3000:]}\n"
        f"--- stderr (tail) ---\n{proc.stderr[-6000:]}"
    )
