"""Stage `quantize`: int8 through torch.export and torchao's PT2E flow (x86 Inductor)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.algorithms.quantization import quantize
from compress.models.graph_model import load_quantized
from compress.recipe.kinds.quantize import QuantizeConfig
from compress.stages.context import StageContext, State


def run(state: State, cfg: QuantizeConfig, ctx: StageContext) -> State:
    """Quantize the current model (dynamic, static or QAT), save `model.pt2`, record figures.

    Figures: quant_mode, calibration_samples (static), qat_steps, qat_weight_change,
    qat_loss_before_training and qat_loss_after_training (qat), quantize_s, and compile_s
    (the first, compiling inference call) when `compile` is on.
    """
    bundle, metrics = quantize(state.bundle, cfg, ctx.data.splits.get("calibration"),
                               setup=ctx.training() if cfg.mode == "qat" else None,
                               max_length=ctx.data.max_length)
    ctx.metrics.update(metrics)
    ctx.save_model(bundle)
    return State(bundle)


def reload(folder: Path, config: dict[str, Any], threads: int | None,
           override: int | None = None) -> Any:
    """The saved int8 model as the stage measured it: compiled with freezing (unless the
    stage had `compile` off), its first, compiling call made."""
    from compress.algorithms.quantization import warm_up
    from compress.models.folders import load_saved

    if not (folder / "model.pt2").is_file():
        return load_saved(folder)
    bundle = load_quantized(folder, compile=config.get("compile", True))
    if getattr(bundle.model, "compiled", None) is not None:
        warm_up(bundle.model.eval(), bundle)
    return bundle
