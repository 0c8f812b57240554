"""The linen front end: module calls reported to the active receivers (the recorder of
an adaptive gradient, a numerics probe's taps). Registered with the core on import."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from flax import linen as nn

from adaloss_jax import _record

_LOCAL = threading.local()


def _interceptor(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "setup" or module.scope is None:
        return next_fun(*args, **kwargs)
    path = tuple(module.scope.path)
    prefixes = _LOCAL.__dict__.setdefault("prefixes", [])
    if path:
        prefix = prefixes[-1] if prefixes else ()
        return _record.report(prefix + path, module, next_fun, args, kwargs)
    # The root of an apply: its module paths count from the parameters it was given,
    # which may be a sub-tree of the loss's (``model.apply({"params": p["student"]})``).
    prefix = _record.subtree_prefix(module.scope.variables().get("params", {}))
    prefixes.append(prefix if prefix is not None else (prefixes[-1] if prefixes else ()))
    try:
        return _record.report(prefixes[-1], module, next_fun, args, kwargs)
    finally:
        prefixes.pop()


@contextlib.contextmanager
def intercept(receiver=None) -> Iterator[None]:
    """Within the context, every linen module method call (not ``setup``) is reported
    with the module's scope path to :func:`adaloss_jax._record.report`, prefixed with
    where the applied parameters sit in the loss's. Nested contexts install the
    interceptor once, so each call is reported once."""
    del receiver
    if getattr(_LOCAL, "on", False):
        yield
        return
    _LOCAL.on = True
    try:
        with nn.intercept_methods(_interceptor):
            yield
    finally:
        _LOCAL.on = False


_record.register_hook(intercept)
