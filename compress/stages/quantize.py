"""Stage `quantize`: int8 through torch.export and torchao's PT2E flow (x86 Inductor)."""

from __future__ import annotations

from compress.quantization import quantize
from compress.stages.configs import QuantizeConfig
from compress.state import StageContext, State


def run(state: State, cfg: QuantizeConfig, ctx: StageContext) -> State:
    """Quantize the current model (dynamic, static or QAT), save `model.pt2`, record figures.

    Figures: quant_mode, calibration_samples (static), qat_steps (qat), quantize_s, and
    compile_s (the first, compiling inference call) when `compile` is on.
    """
    bundle, metrics = quantize(state.bundle, cfg, ctx)
    ctx.metrics.update(metrics)
    ctx.save_model(bundle)
    return State(bundle)
