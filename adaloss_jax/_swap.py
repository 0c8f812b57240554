"""Scale points for object-style modules (NNX, Equinox), without touching the user's model.

A front end builds a private copy of the model inside the traced loss and gives each of
its modules a subclass whose public methods are reported to the active
receivers (:func:`~adaloss_jax._record.report`) under the module's path. The path lives in the
subclass, so it survives the framework's own flatten/unflatten (``nnx.scan``,
``nnx.remat``, ``eqx.filter_vmap``, ``jax.lax.scan`` over stacked layers): a rebuilt
module keeps its class. Outside an adaptive gradient the methods are the originals.
"""

from __future__ import annotations

from collections.abc import Iterable

from adaloss_jax import _record

_SUBCLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _scaled_method(cls: type, name: str):
    original = getattr(cls, name)

    def method(self, *args, **kwargs):
        return _record.report(type(self)._adaloss_path, self,
                              lambda *a, **k: original(self, *a, **k), args, kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__qualname__}.{name}"
    return method


def scaled_class(cls: type, path: tuple[str, ...], base_names: frozenset) -> type:
    """A subclass of ``cls`` whose ``__call__`` and public methods (those not in
    ``base_names``, the framework base class's own) report their calls as ``path``;
    ``cls`` itself where it has none (a module that only holds values, such as
    Equinox's ``StateIndex``, which ``eqx.nn.State`` checks by ``type(i) is
    StateIndex``: nothing to report, so it keeps its class)."""
    if "_adaloss_path" in vars(cls):  # already a scaled class
        cls = cls.__mro__[1]
    key = (cls, path)
    if key not in _SUBCLASSES:
        names = set()
        for klass in cls.__mro__:
            for name, value in vars(klass).items():
                public = name == "__call__" or not name.startswith("_")
                plain = callable(value) and not isinstance(value, staticmethod | classmethod | type)
                if public and plain and name not in base_names:
                    names.add(name)
        attrs = {n: _scaled_method(cls, n) for n in names if hasattr(cls, n)}
        if not attrs:
            _SUBCLASSES[key] = cls
            return cls
        attrs["_adaloss_path"] = path
        attrs["__module__"] = cls.__module__
        _SUBCLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _SUBCLASSES[key]


def install(modules: Iterable[tuple[tuple[str, ...], object]], base_names: frozenset) -> list:
    """Swaps the class of each ``(path, module)`` (private copies only!) for its scaled
    subclass; a module met twice keeps its first path. Returns what :func:`uninstall`
    needs."""
    swapped, seen = [], set()
    for path, module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        swapped.append((module, type(module)))
        object.__setattr__(module, "__class__", scaled_class(type(module), path, base_names))
    return swapped


def uninstall(swapped: list) -> None:
    for module, cls in swapped:
        object.__setattr__(module, "__class__", cls)
