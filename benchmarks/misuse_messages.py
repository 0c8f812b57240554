"""The misuses a new user makes (issue 30) and what each gets: an error at trace time, or a
health flag that ``alj.diagnostics.status_line`` and ``alj.diagnostics.check_health`` report.

    python benchmarks/misuse_messages.py

A two-layer pure-JAX model in fp16; each case prints its message (tests/test_misuse.py
pins every one of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import adaloss_jax as alj

dense = alj.scale_group("d")(lambda p, x: jnp.tanh(x @ p["w"]))
head = alj.scale_group("h")(lambda p, x: x @ p["w"])


def params_of(width: int = 8) -> dict:
    return {"d": {"w": jnp.full((4, width), 0.1, jnp.float16)},
            "h": {"w": jnp.full((width, 2), 0.1, jnp.float16)}}


PARAMS, X = params_of(), jnp.ones((16, 4), jnp.float16)


def loss_fn(p, x):
    return jnp.mean(head(p["h"], dense(p["d"], x)).astype(jnp.float32) ** 2) * 2.0**-12


def step(tx, state, stats_from=None, grads_of=None):
    """One step; the statistics measured with ``stats_from`` (default: ``state``), the
    gradients handed to update made by ``grads_of`` (default: those of the call)."""
    loss, grads, stats = alj.adaptive_value_and_grad(loss_fn)(stats_from or state, PARAMS, X)
    grads = grads_of(PARAMS, X) if grads_of else grads
    return tx.update(grads, state, PARAMS, loss=loss, scale_stats=stats)[1]


def report(name: str, run) -> None:
    try:
        state = run()
    except ValueError as e:
        print(f"[{name}] ValueError: {e}\n")
        return
    print(f"[{name}] no error; status: {alj.diagnostics.status_line(state, warn=False)}")
    for problem in alj.diagnostics.check_health(state, warn=False):
        print(f"  check_health: {problem}")
    print()


def main() -> None:
    module = alj.adaptive(groups="module")
    tx = alj.adaptive_scaled(optax.sgd(0.1), module)
    reversed_chain = optax.chain(optax.adamw(1e-2), alj.adaptive_unscale(module))
    report("1 the chain written the other way round",
           lambda: jax.jit(lambda s: step(reversed_chain, s))(reversed_chain.init(PARAMS)))
    other = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="global"))
    report("2a statistics measured with another optimizer state",
           lambda: step(tx, tx.init(PARAMS), stats_from=other.init(PARAMS)))
    report("2b gradients of plain jax.grad with the statistics of a call",
           lambda: jax.jit(lambda s: step(tx, s, grads_of=jax.grad(loss_fn)))(tx.init(PARAMS)))
    report("3 a state built for the same layer names at another width",
           lambda: step(tx, tx.init(params_of(16))))
    four = alj.adaptive_scaled(optax.sgd(0.1), alj.adaptive(groups="module", factor=4.0))
    report("4 a transformation and a state of different scalers",
           lambda: step(four, tx.init(PARAMS)))
    outside = optax.MultiSteps(tx, 4).gradient_transformation()
    report("13 optax.MultiSteps around the scaler", lambda: step(outside, outside.init(PARAMS)))


if __name__ == "__main__":
    main()
