"""Sphinx configuration: MyST pages, myst-nb for the notebooks, autodoc (Google style) for
the API reference. Built in CI with warnings as errors:

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
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
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # attributes as fields: a NamedTuple's are not documented twice

html_theme = "sphinx_book_theme"
html_title = "adaloss_jax"
html_static_path = ["_static"]
html_theme_options = {"show_toc_level": 2}

suppress_warnings = ["myst.header"]


def _copy_notebooks(app):
    """The walkthroughs live in notebooks/ (run by the tests); the site renders copies."""
    src, dst = os.path.join(ROOT, "notebooks"), os.path.join(app.srcdir, "notebooks")
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        if name.endswith(".ipynb"):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def setup(app):
    app.connect("builder-inited", _copy_notebooks)
