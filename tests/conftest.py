"""Test set-up: 8 CPU devices for the sharding tests, seeded randomness."""

import os

# Must happen before jax initialises its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    yield


@pytest.fixture(scope="module")
def mesh():
    """A one-axis ("data") mesh over the 8 CPU devices."""
    import jax

    if jax.device_count() < 8:
        pytest.fail(f"expected 8 CPU devices (XLA_FLAGS above), got {jax.device_count()}")
    return jax.make_mesh((8,), ("data",))


# Property tests really search: random examples, a new draw every run (failures are
# kept in hypothesis's database and replayed first). The fast tier draws a few per test,
# CI (CI=true) more. No shrinking: every example compiles programs, and the strategies
# are small choices that a failure report already names.
def _hypothesis_profiles():
    from hypothesis import Phase, settings

    phases = (Phase.explicit, Phase.reuse, Phase.generate)
    settings.register_profile("fast", max_examples=4, deadline=None, phases=phases)
    settings.register_profile("ci", max_examples=12, deadline=None, phases=phases)
    settings.load_profile("ci" if os.environ.get("CI") else "fast")


_hypothesis_profiles()
