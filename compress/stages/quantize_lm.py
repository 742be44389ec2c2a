"""Stage `quantize` on a causal LM: a torchao weight scheme on every Linear (the tied
output projection included), activations in bfloat16 where the CPU computes it natively."""

from __future__ import annotations

import time

from compress.causal_lm import quantize_weights
from compress.models import ModelBundle
from compress.stages.quantize_spec import QuantizeConfig
from compress.state import StageContext, State
from serve.lm_runtime import DTYPES


def activation_dtype(choice: str) -> str:
    """The activation dtype of `choice` on this machine (auto: bfloat16 with native bf16:
    `_weight_int8pack_mm` and the int4 kernels are several times faster with bf16 inputs
    than with float32 ones on AVX512-BF16 CPUs)."""
    if choice != "auto":
        return choice
    from compress.runfolder import bf16_supported

    return "bfloat16" if bf16_supported() else "float32"


def run(state: State, cfg: QuantizeConfig, ctx: StageContext) -> State:
    """Quantize the current causal LM's weights, save it, record the scheme and timing."""
    source = state.bundle
    dtype = activation_dtype(cfg.activations)
    began = time.perf_counter()
    model = source.model
    for parameter in model.parameters():  # buffers (rotary inv_freq) stay float32, as in a
        parameter.data = parameter.data.to(DTYPES[dtype])  # model loaded in that dtype
    quantize_weights(model, cfg.scheme, cfg.group_size)
    facts = {**(source.lm or {}), "scheme": cfg.scheme, "dtype": dtype,
             "group_size": cfg.group_size}
    bundle = ModelBundle(model.eval(), "causal-lm", [], tokenizer=source.tokenizer, lm=facts)
    ctx.metrics.update({"scheme": cfg.scheme, "activation_dtype": dtype,
                        "quantize_s": round(time.perf_counter() - began, 2)})
    ctx.save_model(bundle)
    return State(bundle)
