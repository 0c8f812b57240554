"""The class swap through which Equinox modules and NNX taps report their calls
(``adaloss_jax._swap``): its contract on any list of modules, whatever a front end's
walk yields."""

from __future__ import annotations

from adaloss_jax import _swap


class _Layer:
    def __call__(self, x):
        return x

    def helper(self, x):
        return x


def test_a_module_met_twice_keeps_its_first_path_and_later_modules_are_swapped():
    shared, last = _Layer(), _Layer()
    swapped = _swap.install([(("a",), shared), (("b",), shared), (("c",), last)],
                            frozenset())
    try:
        assert [m for m, _ in swapped] == [shared, last]
        assert shared._adaloss_path == ("a",)
        assert last._adaloss_path == ("c",)
        assert isinstance(shared, _Layer) and type(shared) is not _Layer
    finally:
        _swap.uninstall(swapped)
    assert type(shared) is _Layer and type(last) is _Layer


def test_swapping_a_swapped_class_again_swaps_from_the_original():
    layer = _Layer()
    first = _swap.install([(("a",), layer)], frozenset())
    again = _swap.install([(("b",), layer)], frozenset())
    assert type(layer).__mro__[1] is _Layer and layer._adaloss_path == ("b",)
    _swap.uninstall(again)
    _swap.uninstall(first)
    assert type(layer) is _Layer
