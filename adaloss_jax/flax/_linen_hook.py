"""The linen front end: module calls reported to the active receivers (scale points of
an adaptive gradient, a numerics probe's taps)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from flax import linen as nn

from adaloss_jax import _points

_LOCAL = threading.local()


def _interceptor(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "setup" or module.scope is None:
        return next_fun(*args, **kwargs)
    return _points.report(tuple(module.scope.path), module, next_fun, args, kwargs)


@contextlib.contextmanager
def intercept(points=None) -> Iterator[None]:
    """Within the context, every linen module method call (not ``setup``) is reported
    with the module's scope path to :func:`adaloss_jax._points.report`. Nested contexts
    install the interceptor once, so each call is reported once. (``points`` is unused:
    the signature of a front-end hook.)"""
    del points
    if getattr(_LOCAL, "on", False):
        yield
        return
    _LOCAL.on = True
    try:
        with nn.intercept_methods(_interceptor):
            yield
    finally:
        _LOCAL.on = False
