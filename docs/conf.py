"""Sphinx configuration: MyST pages, myst-nb for the notebooks, autodoc (Google style) for
the API reference. Built in CI with warnings as errors:

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import re
import shutil
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "adaloss_jax"
author = "the adaloss_jax developers"
copyright = "2026, the adaloss_jax developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "bench/*.md", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3
nb_execution_mode = "force"  # the notebooks are stored without outputs: run them
nb_execution_timeout = 600
nb_execution_raise_on_error = True

autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"  # no bare, undescribed entries
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # defaults as written in the source (nnx.Param, 2.0**64)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # attributes as fields: a NamedTuple's are not documented twice

html_theme = "sphinx_book_theme"
html_title = "adaloss_jax"
html_static_path = ["_static"]
html_css_files = ["layout.css"]  # a wider content column: 95-character code lines fit at 1280 px
html_theme_options = {"show_toc_level": 2}

suppress_warnings = ["myst.header"]


def _copy_notebooks(app):
    """The walkthroughs live in notebooks/ (run by the tests); the site renders copies."""
    src, dst = os.path.join(ROOT, "notebooks"), os.path.join(app.srcdir, "notebooks")
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name.endswith(".ipynb"):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


_POWER = re.compile(r"(?<![\w.])2\.0\*\*(-?\d+)")  # 2.0**64, as a function's source has it
_FLOAT = re.compile(r"(?<![\w.*])\d+\.\d*(?:e[+-]?\d+)?(?![\w.*])")  # 1.8446744073709552e+19


def _scales_as_powers(app, what, name, obj, options, signature, return_annotation):
    """Signatures show power-of-two defaults as ``2**64``, as the reprs do: a function's
    default as written (``2.0**64``) and a dataclass's (whose ``__init__`` has no source to
    preserve) as a value."""
    from adaloss_jax._formats import pow2_repr

    def power(match):
        text = pow2_repr(float(match.group(0)))
        return text if text.startswith("2**") else match.group(0)

    if signature:
        signature = _FLOAT.sub(power, _POWER.sub(r"2**\1", signature))
    return signature, return_annotation


def setup(app):
    app.connect("builder-inited", _copy_notebooks)
    app.connect("autodoc-process-signature", _scales_as_powers)
