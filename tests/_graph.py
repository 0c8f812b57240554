"""The model body the random-graph tests of the front ends share: the same ops, read the
same way, whether the layers are Equinox modules, NNX modules or pure JAX functions
marked with ``scale_group`` (linen's ``RandomNet`` builds its modules inline, as linen
does, and keeps its own body)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp

OPS = ("dense", "residual", "reuse", "concat", "scan")


def run(ops: Sequence[str], x, *, layer: Callable, shared: Callable, scan: Callable,
        other: Callable | None = None):
    """``x`` through ``ops``: ``layer(i, x, gate=1.0)`` is op ``i``'s own layer,
    ``shared(x, gate=...)`` one layer called twice (a module reused), ``scan(i, x)`` two
    stacked layers, each ``x + layer(x)``, and ``other(op, i, x)`` a front end's own op."""
    for i, op in enumerate(ops):
        if op == "dense":
            x = layer(i, x)
        elif op == "residual":
            x = x + layer(i, x, gate=0.5)
        elif op == "reuse":
            x = shared(x, gate=0.5) + shared(x * 0.25, gate=2.0) + layer(i, x)
        elif op == "concat":
            x = layer(i, jnp.concatenate([x, jnp.tanh(x)], axis=-1))
        elif op == "scan":
            x = scan(i, x)
        elif other is not None:
            x = other(op, i, x)
        else:
            raise ValueError(f"no op {op!r} in this front end's graphs")
    return x
