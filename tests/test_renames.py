"""0.3's renames: the old names warn for one release and still work; the new ones are
the only ones the library, its docs and its tests use (``pyproject.toml`` turns our own
deprecation warnings into errors, so an old name used anywhere the tests reach fails)."""

from __future__ import annotations

import pytest

import adaloss_jax as alj


@pytest.mark.parametrize("space", ["diagnostics", "formats", "checkpoint"])
def test_names_moved_into_a_namespace_warn_at_the_top_level(space):
    module = getattr(alj, space)
    assert module.__all__ and not set(module.__all__) & set(alj.__all__)
    for name in module.__all__:
        with pytest.warns(DeprecationWarning, match=rf"adaloss_jax\.{space}\.{name}\b"):
            assert getattr(alj, name) is getattr(module, name)


def test_the_training_path_stays_at_the_top_without_a_warning():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in alj.__all__:
            getattr(alj, name)
    with pytest.raises(AttributeError, match="no_such_name"):
        alj.no_such_name  # noqa: B018


def test_a_renamed_front_end_function_warns_with_both_names():
    """The warning names the old spelling the user wrote and the new one to write."""
    from adaloss_jax import flax as alj_flax

    with pytest.warns(DeprecationWarning) as caught:
        assert alj_flax.train_step is alj_flax.linen_train_step
    (message,) = [str(w.message) for w in caught]
    assert "adaloss_jax.flax.train_step" in message
    assert "adaloss_jax.flax.linen_train_step" in message
