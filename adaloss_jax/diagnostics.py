"""What a scaler state says about training, and a step recomputed in fp32: the one-line
status, the per-group table, its health with the fix, and a gradient check.

>>> import adaloss_jax as alj
>>> alj.diagnostics.check_health(alj.dynamic().init())
[]
"""

from adaloss_jax._check import GradientCheck, check_gradients
from adaloss_jax._diagnostics import check_health, scale_summary, scale_table, status_line
from adaloss_jax._state import Health

__all__ = ["GradientCheck", "Health", "check_gradients", "check_health", "scale_summary",
           "scale_table", "status_line"]
