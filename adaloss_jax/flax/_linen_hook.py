"""The linen front end of adaptive scaling: module calls reported to the scale points."""

from __future__ import annotations

from flax import linen as nn


def intercept(points):
    """A context manager under which every linen module method call (not ``setup``) is
    run through ``points.wrap`` with the module's scope path."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "setup" or module.scope is None:
            return next_fun(*args, **kwargs)
        return points.wrap(tuple(module.scope.path), module, next_fun, args, kwargs)

    return nn.intercept_methods(interceptor)
