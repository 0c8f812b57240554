"""The documentation says true things about the code: every error and warning message
the library raises is on the troubleshooting page, and every public function and class
has a docstring with its arguments, what it returns and a doctested example."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"


def _literal(node) -> str:
    """A message expression's text, each formatted part as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) + _literal(node.right)
    return ""


def _named(tree) -> dict[str, str]:
    """A module's message constants: ``NAME = "..."`` at the top level, each ``{field}``
    of a template as ``{}``."""
    return {t.id: re.sub(r"\{\w*\}", "{}", n.value.value)
            for n in tree.body if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for t in n.targets if isinstance(t, ast.Name) and t.id.isupper()}


def _message(node, named: dict[str, str]) -> str:
    """A message argument's text: a literal, or a named constant (``NAME`` or
    ``NAME.format(...)``)."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "format":
        node = node.func.value
    if isinstance(node, ast.Name):
        return named.get(node.id, "")
    return _literal(node)


def messages() -> list[tuple[str, str]]:
    """``(where, message)`` for every ``raise X(msg)`` and ``warn``/``notice_once`` call,
    a message given by name included."""
    out = []
    for path in sorted((ROOT / "adaloss_jax").rglob("*.py")):
        tree = ast.parse(path.read_text())
        named = _named(tree)
        for node in ast.walk(tree):
            call = None
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                call = node.exc
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", "")) in ("warn", "notice_once"):
                call = node
            if call is None or not call.args:
                continue
            name = getattr(call.func, "id", getattr(call.func, "attr", ""))
            text = _message(call.args[-1] if name == "notice_once" else call.args[0], named)
            if text:
                out.append((f"{path.relative_to(ROOT)}:{node.lineno}", text))
    return out


def _key(message: str) -> str | None:
    """The first literal run of 12+ characters (at most 40): what the page must quote."""
    for part in re.split(r"\{[^{}]*\}", message):  # "{}" of an f-string, "{name!r}"
        part = " ".join(part.replace("adaloss_jax: ", "").split())
        if len(part) >= 12:
            return part[:40]
    return None


def test_every_message_is_on_the_troubleshooting_page():
    page = " ".join(PAGE.read_text().replace("`", "").split())
    missing = [(where, key) for where, msg in messages()
               if (key := _key(msg)) is not None and key not in page]
    assert len(messages()) > 50
    assert not missing, "\n".join(f"{w}: {k!r}" for w, k in missing)


def _public():
    import adaloss_jax
    import adaloss_jax.equinox
    import adaloss_jax.flax
    import adaloss_jax.numerics

    for mod in (adaloss_jax, adaloss_jax.flax, adaloss_jax.numerics, adaloss_jax.equinox):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{mod.__name__}.{name}", obj


@pytest.mark.parametrize("name,obj", list(_public()), ids=[n for n, _ in _public()])
def test_every_public_function_and_class_documents_itself(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{name}: no doctested example"
    if inspect.isclass(obj):
        assert re.search(r"^(Attributes|Args):", doc, re.M), f"{name}: no Attributes/Args"
    else:
        params = [p for p in inspect.signature(obj).parameters.values()
                  if p.name not in ("self", "args", "kwargs")]
        if params:
            assert re.search(r"^Args:", doc, re.M), f"{name}: no Args"
        assert re.search(r"^Returns:", doc, re.M), f"{name}: no Returns"


def test_every_hand_written_mutation_still_finds_its_text():
    """``benchmarks/mutations.py`` breaks the code by replacing a text that must occur
    exactly once; a text the code no longer holds would test nothing."""
    import importlib.util

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("mutations", root / "benchmarks/mutations.py")
    mutations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mutations)
    stale = [name for name, (path, old, *_rest) in mutations.MUTATIONS.items()
             if (root / path).read_text().count(old) != 1]
    assert not stale, stale
