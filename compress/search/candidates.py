"""The search's candidates, each built from stages compress already has: a `quantize` or
`precision` config applied to a copy of the model, then an `export` config writing the
folder that is measured and, for the winner, packaged."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.models.bundle import ModelBundle
from compress.recipe.kinds.export import ExportConfig
from compress.recipe.kinds.precision import PrecisionConfig
from compress.recipe.kinds.quantize import QuantizeConfig
from compress.recipe.kinds.search import CANDIDATES, SearchConfig, not_applicable
from compress.recipe.options import CalibrationOptions, StrictModel
from compress.runfolder.files import bf16_supported


def candidate_stages(name: str, float_layers: list[str], calibration: CalibrationOptions,
                     smoothing: float | None = None) -> list[StrictModel]:
    """The stage configs that build candidate `name`, with `float_layers` (module names)
    left in float by the quantizing step, and PT2E static int8 smoothed by SmoothQuant's
    `smoothing` alpha where given."""
    keep = list(float_layers)
    quantized = {"calibration": calibration, "keep_float": keep}
    static = {**quantized, **({"smoothing": smoothing} if smoothing is not None else {})}
    recipes: dict[str, Callable[[], list[StrictModel]]] = {
        "pt2e_static_aoti": lambda: [QuantizeConfig(mode="static", compile=False, **static),
                                     ExportConfig(format="aoti")],
        "pt2e_dynamic_aoti": lambda: [QuantizeConfig(mode="dynamic", compile=False,
                                                     keep_float=keep),
                                      ExportConfig(format="aoti")],
        "pt2e_static_bf16_aoti": lambda: [
            QuantizeConfig(mode="static", compile=False, **static),
            ExportConfig(format="aoti", autocast="bf16")],
        "pt2e_static_bf16_attention_aoti": lambda: [
            QuantizeConfig(mode="static", compile=False, **static),
            ExportConfig(format="aoti", attention="kernel")],
        "pt2e_static_packed_aoti": lambda: [
            QuantizeConfig(mode="static", compile=False, **static),
            ExportConfig(format="aoti", attention="packed")],
        "bf16_aoti": lambda: [PrecisionConfig(), ExportConfig(format="aoti")],
        "ort_dynamic_int8": lambda: [ExportConfig(format="onnx", quantize="dynamic",
                                                  **({"keep_float": keep} if keep else {}))],
        "ort_static_int8": lambda: [ExportConfig(format="onnx", quantize="static",
                                                 **{k: v for k, v in quantized.items()
                                                    if v or k == "calibration"})],
        "onnx_fp32": lambda: [ExportConfig(format="onnx")],
        "aoti_fp32": lambda: [ExportConfig(format="aoti")],
    }
    return recipes[name]()


def build(bundle: ModelBundle, stages: list[StrictModel], folder: Path, calibration,
          max_length: int, log: Callable[[str], None], meta: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """Apply `stages` to a copy of `bundle` and write the export into `folder` (built
    under a temporary name, then renamed; `meta` goes into its export.json); the figures
    of the steps."""
    from compress.algorithms.quantization import quantize
    from compress.stages.export import export
    from compress.stages.precision import cast

    current, facts = bundle, {}
    if getattr(stages[-1], "attention", None) == "packed" and len(stages) > 1:
        current = packed_bundle(current)  # packed before it is captured and quantized
    for cfg in stages[:-1]:
        if isinstance(cfg, QuantizeConfig):
            current, figures = quantize(current, cfg, calibration, max_length=max_length)
            facts.update(figures)
        elif isinstance(cfg, PrecisionConfig):
            current = cast(copy_bundle(current), cfg)
        else:
            raise TypeError(f"a search candidate cannot apply a {cfg.kind} stage")
    path, figures = export(current, stages[-1], folder, calibration, max_length, log, meta)
    return {**facts, **figures, "file": path.name}


def packed_bundle(bundle: ModelBundle) -> ModelBundle:
    """The bundle with a packed copy of its sentence encoder; CaptureError for another
    model."""
    from export.aoti import packed_model

    return dataclasses.replace(bundle, model=packed_model(bundle.model))


def copy_bundle(bundle: ModelBundle) -> ModelBundle:
    """The bundle with its own copy of the model (a cast must not change the original)."""
    return dataclasses.replace(bundle, model=copy.deepcopy(bundle.model))


def applicable(bundle: ModelBundle, cfg: SearchConfig) -> tuple[list[str], dict[str, str]]:
    """(the candidates of `cfg` to try on `bundle` on this CPU, {candidate: why it is
    skipped})."""
    names = cfg.candidates or list(CANDIDATES)
    bf16 = bf16_supported()
    skipped = {n: why for n in names
               if (why := not_applicable(n, bundle.kind == "hf", bf16)) is not None}
    return [n for n in names if n not in skipped], skipped
