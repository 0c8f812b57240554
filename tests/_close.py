"""The tolerance for "the same fp32 gradient": power-of-two scales are exact, but a scaled
graph is a different XLA program, whose fusions may sum the same terms in another order
(a tied embedding's two uses, a reused block, q/k/v fan-in). So a leaf may differ from
the reference by fp32 rounding of its largest terms: a few ulps of the leaf's largest
magnitude, not of each element (an element that is a near-cancelled sum of larger terms
keeps their absolute error), and never below ``atol`` (a leaf whose exact gradient is zero,
such as a conv bias before BatchNorm, is rounding noise of its terms, which the tests'
LLVM -O0 sums in another order than -O2 does). A wrong
scale on any contribution is a factor of two or more, far outside this."""

import jax
import numpy as np


def assert_fp32_trees_close(got, ref, rtol: float = 2e-5, atol: float = 4e-7,
                            ulps_of_max: float = 64.0) -> None:
    got_leaves, ref_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)
    assert len(got_leaves) == len(ref_leaves)
    for (path, r), g in zip(jax.tree_util.tree_flatten_with_path(ref)[0], got_leaves):
        r = np.asarray(r, np.float32)
        largest = float(np.max(np.abs(r), initial=0.0))
        leaf_atol = ulps_of_max * float(np.finfo(np.float32).eps) * largest
        np.testing.assert_allclose(np.asarray(g), r, rtol=rtol, atol=max(atol, leaf_atol),
                                   err_msg=jax.tree_util.keystr(path))
