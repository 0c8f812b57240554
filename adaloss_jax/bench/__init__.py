"""The adaloss_jax bench: what loss scaling buys, measured on vision and language tasks.

Run ``python -m adaloss_jax.bench --quick`` (the README's main job) or ``--help``. Tasks
are in :mod:`adaloss_jax.bench._tasks`, configurations in :mod:`adaloss_jax.bench._configs`.
"""

from adaloss_jax.bench._cli import main
from adaloss_jax.bench._configs import CONFIGS, Config
from adaloss_jax.bench._data import DataUnavailable
from adaloss_jax.bench._models import GPT, DeepMLP, ResNet
from adaloss_jax.bench._runner import REGIMES, Runner
from adaloss_jax.bench._tasks import TASKS, Task

__all__ = ["CONFIGS", "Config", "DataUnavailable", "DeepMLP", "GPT", "REGIMES", "ResNet",
           "Runner", "TASKS", "Task", "main"]
