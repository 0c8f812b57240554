"""The package's import graph: a floor both scaler families stand on, the global scalers
and the adaptive core as siblings that never import each other, and what reads either
state above both. Read from the source (``ast``), so a stray import fails here before it
tangles the two families again."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "adaloss_jax"

FLOOR = {"_common", "_formats", "_lookup", "_skip", "_tree", "_validation"}
GLOBAL = {"_global_scalers", "_global_transforms"}
ADAPTIVE = {"_adaptive", "_adaptive_scaler", "_apply", "_channel", "_decide", "_grad", "_groups",
            "_jaxpr", "_layout", "_live", "_record", "_rule", "_state", "_stream", "_swap"}
ABOVE = {"_check", "_checkpoint", "_diagnostics"}


def imports(module: str) -> set[str]:
    """The package's own top-level modules ``module`` imports (``adaloss_jax._x``, or a
    name taken from ``adaloss_jax``), at any depth of its code."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != "adaloss_jax":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names
                      if a.name.startswith("adaloss_jax.")}
    return found - {module}


def test_every_core_module_has_a_floor():
    """A new core module must be placed in one of the four layers."""
    core = {p.stem for p in PACKAGE.glob("_*.py")} - {"__init__"}
    assert core == FLOOR | GLOBAL | ADAPTIVE | ABOVE, core ^ (FLOOR | GLOBAL | ADAPTIVE | ABOVE)


@pytest.mark.parametrize("module", sorted(FLOOR))
def test_the_floor_imports_only_the_floor(module):
    assert imports(module) <= FLOOR, imports(module) - FLOOR


@pytest.mark.parametrize("family,other", [(GLOBAL, ADAPTIVE), (ADAPTIVE, GLOBAL)],
                         ids=["global", "adaptive"])
def test_neither_family_imports_the_other(family, other):
    crossing = {(m, o) for m in family for o in imports(m) if o in other | ABOVE}
    assert not crossing, crossing


def test_the_global_state_and_the_adaptive_state_are_found_without_either_family():
    """``scale_state`` (floor) finds both kinds: each family registers its state."""
    import jax.numpy as jnp
    import optax

    import adaloss_jax as alj
    from adaloss_jax import _lookup

    params = {"w": jnp.zeros(2)}
    found = _lookup.scale_state(alj.loss_scaled(optax.sgd(0.1), alj.static(8.0)).init(params))
    assert isinstance(found, alj.LossScaleState)
    found = _lookup.scale_state(alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive()).init(params))
    assert isinstance(found, alj.AdaptiveScaleState)
    with pytest.raises(ValueError, match="adaloss_jax.adaptive_unscale"):
        _lookup.training_state((optax.sgd(0.1).init(params), found))
