"""Bench configurations: a compute dtype and a way of scaling the loss.

Every configuration trains the same model definition (fp32 master weights) with only the
compute dtype and the scaler switched. Dynamic global scaling starts at 2^15 and doubles
after 200 finite steps (jmp's ``period=200``; flax ``DynamicScale(growth_interval=199)``
is the same trajectory, one step later), halving and skipping on overflow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

import adaloss_jax as alj

DYNAMIC_START = 2.0**15
DYNAMIC_PERIOD = 200


@dataclasses.dataclass(frozen=True)
class Config:
    """``kind``: "global" (a global scaler), "adaptive", "flax" (flax's DynamicScale) or
    "fp8" (an fp8 recipe in every dense layer, ``fp8``: "delayed", "current", "qwix" or
    "mxfp8", :mod:`adaloss_jax.bench._fp8_peers`)."""

    name: str
    description: str
    dtype: Any
    kind: str
    adaptive: dict | None = None  # keyword arguments of alj.adaptive()
    make_scaler: Callable[[], Any] = alj.no_scaling  # the scaler of kind "global"
    fp8: str | None = None  # the recipe of kind "fp8"

    def available(self) -> str | None:
        """``None`` when the config can run here, else the message saying what to install
        (fp8-qwix needs qwix)."""
        if self.fp8 == "qwix":
            from adaloss_jax.bench import _fp8_peers

            return _fp8_peers.qwix_missing()
        return None

    def spec(self) -> str:
        """What a run of this config depends on beyond its name: an adaptive config's
        resolved options (a bench result file keeps runs by it, so a run made under
        another default is not taken for one of this config)."""
        return repr(self.scaler()) if self.kind == "adaptive" else ""

    def scaler(self) -> Any:
        """The config's scaler: global (kind "global") or adaptive."""
        if self.kind == "adaptive":
            return alj.adaptive(**self.adaptive)
        return self.make_scaler()


def _ada(name, description, **kwargs) -> Config:
    return Config(name, description, jnp.float16, "adaptive", kwargs)


_E5M2 = {"grad_dtype": jnp.float8_e5m2, "simulate": True}
_E4M3 = {"grad_dtype": jnp.float8_e4m3fn, "simulate": True}

CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("fp32", "float32 compute, no scaling (the reference)", jnp.float32, "global"),
        Config("bf16", "bfloat16 compute, no scaling (fp32's exponent range)", jnp.bfloat16,
               "global"),
        Config("fp16-none", "float16 compute, no loss scaling", jnp.float16, "global"),
        Config("fp16-dynamic", "float16, dynamic global scaling (alj.dynamic, period 200)",
               jnp.float16, "global", make_scaler=lambda: alj.dynamic(
                   initial_scale=DYNAMIC_START, period=DYNAMIC_PERIOD)),
        Config("fp16-flax", "float16, flax DynamicScale (growth_interval 199): the anchor",
               jnp.float16, "flax"),
        _ada("fp16-ada-global", "float16, one statistics-driven scale (adaptive, amax rule)",
             groups="global"),
        _ada("fp16-ada-module", "float16, adaptive per-module scales, amax rule, chosen in "
             "the backward pass from the cotangent in hand (same-step, the default)",
             groups="module"),
        _ada("fp16-ada-gauss", "float16, adaptive per-module scales, the reference's "
             "Gaussian rule", groups="module", statistic="gaussian"),
        _ada("fp16-ada-quant", "float16, adaptive per-module scales, quantile rule (at most "
             "1e-3 of cotangents below 2 u_min)", groups="module", statistic="quantile"),
        _ada("e5m2-global", "float16 model, cotangents rounded to fp8 e5m2 at module "
             "outputs; one statistics-driven scale", groups="global", **_E5M2),
        _ada("e5m2-module", "as e5m2-global with per-module scales", groups="module", **_E5M2),
        _ada("e4m3-global", "float16 model, cotangents rounded to fp8 e4m3fn at module "
             "outputs; one statistics-driven scale", groups="global", **_E4M3),
        _ada("e4m3-module", "as e4m3-global with per-module scales (same-step, the default)",
             groups="module", **_E4M3),
        _ada("fp16-ada-delayed", "as fp16-ada-module with every scale set by the rule from "
             "the steps before (same_step=False)", groups="module", same_step=False),
        _ada("e4m3-delayed", "as e4m3-module with every scale set by the rule from the steps "
             "before (same_step=False)", groups="module", same_step=False, **_E4M3),
        _ada("fp16-ada-module-retry", "as fp16-ada-module with up to 4 passes retried "
             "inside a step (retries=4: a step the rule refuses is computed again, step 0 "
             "included)", groups="module", retries=4),
        _ada("e4m3-module-retry", "as e4m3-module with up to 4 passes retried inside a step "
             "(retries=4: a step the rule refuses is computed again, step 0 included)",
             groups="module", retries=4, **_E4M3),
        _ada("fp16-ada-block", "float16, adaptive per-layer scales, one per top-level module "
             "(a transformer block), points only at their boundaries", groups="module",
             max_depth=1),
        Config("fp8-flax", "bfloat16 model, flax's Fp8DirectDotGeneralOp in every Dense "
               "(e4m3 inputs and kernels, e5m2 output gradients, per-tensor delayed scaling "
               "from a 1024-step amax history); no loss scaling", jnp.bfloat16, "fp8",
               fp8="delayed"),
        Config("fp8-current", "bfloat16 model, per-tensor current fp8 scaling in every Dense "
               "(each tensor scaled from its own amax in the same step, as "
               "TransformerEngine's current scaling and torchao's tensorwise recipe; e4m3 "
               "inputs and kernels, e5m2 output gradients); no loss scaling", jnp.bfloat16,
               "fp8", fp8="current"),
        Config("fp8-qwix", "bfloat16 model, Google's qwix quantized training with MaxText's "
               "fp8_full rule on every Dense (e4m3 inputs and kernels, e5m2 output "
               "gradients, absmax scales per row of the inputs and per output channel of "
               "the kernels, from the same step); no loss scaling", jnp.bfloat16, "fp8",
               fp8="qwix"),
        Config("fp8-mxfp8", "bfloat16 model, MXFP8 as jax.nn.scaled_dot_general does it, "
               "simulated, in every Dense (e4m3 inputs, kernels and output gradients in "
               "blocks of 32 along each product's contraction, one power-of-two scale per "
               "block rounded up from its amax); no loss scaling", jnp.bfloat16, "fp8",
               fp8="mxfp8"),
    )
}

# What --quick runs (on code-gpt, tiny regime) and what the full suite runs per regime.
QUICK = ("fp32", "bf16", "fp16-none", "fp16-dynamic", "fp16-ada-global", "fp16-ada-module")
FULL = {
    "ordinary": ("fp32", "bf16", "fp16-none", "fp16-dynamic", "fp16-ada-global",
                 "fp16-ada-module"),
    "tiny": tuple(c for c in CONFIGS if CONFIGS[c].kind != "fp8"
                  and c not in ("fp16-ada-block", "fp16-ada-delayed", "e4m3-delayed",
                                "fp16-ada-module-retry", "e4m3-module-retry")),
}
# The deep tasks (code-gpt-deep, fmnist-sigmoid): where per-layer scales matter, and the
# fp8 peers. Their suite runs these, tiny regime only.
# fp16-ada-block (max_depth=1) only here, where depth is the question. No fp8 block
# config: with max_depth a simulated format rounds only at group boundaries, a weaker
# simulation than the module configs', so the two would not be comparable.
DEPTH = ("fp32", "bf16", "fp16-dynamic", "fp16-ada-global", "fp16-ada-module",
         "fp16-ada-block", "fp16-ada-delayed", "e5m2-global", "e5m2-module",
         "e4m3-global", "e4m3-module", "e4m3-delayed", "fp8-flax", "fp8-current", "fp8-qwix",
         "fp8-mxfp8")
# The scanned deep tasks (code-gpt-deep-scan, fmnist-sigmoid-scan): what a user of a
# scanned model gets, against the fp8 peers (qwix quantizes inside nn.scan too).
SCANNED = ("fp32", "fp16-dynamic", "fp16-ada-global", "fp16-ada-module", "fp16-ada-delayed",
           "e4m3-global", "e4m3-module", "e4m3-delayed", "fp8-flax", "fp8-current", "fp8-qwix",
           "fp8-mxfp8")
