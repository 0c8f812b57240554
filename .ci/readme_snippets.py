"""Runs every ```python snippet of a Markdown file, each in a fresh namespace, in this
process: CI runs it with the wheel's Python from an empty directory, with warnings as
errors (``python -W error .ci/readme_snippets.py README.md``)."""

import pathlib
import re
import sys

text = pathlib.Path(sys.argv[1]).read_text(encoding="utf-8")
blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
for i, block in enumerate(blocks):
    exec(compile(block, f"{sys.argv[1]} snippet {i}", "exec"), {"__name__": "__main__"})
import adaloss_jax  # noqa: E402

print(f"ran {len(blocks)} snippets with adaloss_jax {adaloss_jax.__version__} from "
      f"{adaloss_jax.__file__}")
