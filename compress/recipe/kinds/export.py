"""Stage kind `export`: its config and spec (no torch import; run module: export.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from compress.recipe.options import CalibrationOptions, StageName, StrictModel
from compress.recipe.parallel import (
    PARALLEL,
    ExpertParallel,
    Oversubscribe,
    PipelineParallel,
    TensorParallel,
    parallel_fits_the_config,
    parallel_problems,
)
from compress.recipe.registry import StageSpec, register

ONNX_ONLY = ("opset", "exporter", "optimize", "quantize", "keep_float")
TENSORRT_ONLY = ("precision", "shapes")
AOTI_ONLY = ("autocast", "attention")
EXECUTORCH_ONLY = ("quantize",)  # XNNPACK's int8
EXECUTORCH_FORMAT = "executorch"  # a causal LM's too: compress.families.causal_lm.executorch
# a causal LM's .pte: XNNPACK's int8 dynamic activations with int4 (per 32) / int8 weights
EXECUTORCH_LM_SCHEMES = ("8da4w", "8da8w")
EXECUTORCH_LM_MODELS = (None, "int8_grouped", "int4_grouped")  # float, or groups dequantized
RUNTIMES = {"torchscript": "TorchScript", "onnx": "ONNX Runtime", "aoti": "AOTInductor",
            "tensorrt": "TensorRT", "transformers": "transformers + torchao (causal_lm.runtime)",
            "gguf": "llama.cpp (GGUF)", "executorch": "ExecuTorch (XNNPACK)",
            "compressed_tensors": "transformers / vLLM (compressed-tensors)"}
CAUSAL_LM_FORMAT = "transformers"  # a causal LM's folder with its runtime
GGUF_FORMAT = "gguf"  # a causal LM as one GGUF file, for llama.cpp and Ollama
GGUF_SCHEMES = (None, "int8_grouped", "int4_grouped")  # float, Q8_0, Q4_1
# a causal LM as a compressed-tensors checkpoint, for vLLM, SGLang and transformers
COMPRESSED_TENSORS_FORMAT = "compressed_tensors"
COMPRESSED_TENSORS_SCHEMES = ("int8_grouped", "int4_grouped")  # pack-quantized int8, int4
# the causal-LM formats besides the runtime folder, and the weight schemes each holds
FILE_SCHEMES = {GGUF_FORMAT: GGUF_SCHEMES, COMPRESSED_TENSORS_FORMAT: COMPRESSED_TENSORS_SCHEMES}
CAUSAL_LM_FORMATS = (CAUSAL_LM_FORMAT, *FILE_SCHEMES)  # the formats a causal LM exports to
# every option a causal-LM export accepts (the rest are a classifier's)
CAUSAL_LM_EXPORT_OPTIONS = ("kind", "name", "format", "source", "min_agreement",
                            "parity_samples", *PARALLEL, "tolerance")
CLASSIFIER_PARITY = ("min_agreement", "max_accuracy_drop")  # by argmax and accuracy
# each family's parity bounds besides `tolerance`, and how its exports are held
PARITY_BOUNDS = {
    "classification": (CLASSIFIER_PARITY, "a classifier export is held to tolerance, "
                       "min_agreement and max_accuracy_drop"),
    "embedding": (("min_fidelity",), "an embedding export is held to min_fidelity and "
                  "tolerance"),
    "reranking": (("min_kendall_tau",), "a reranker export is held to tolerance and "
                  "min_kendall_tau"),
}


class TensorRTShapes(StrictModel):
    """TensorRT optimisation profile: [batch, sequence] (or [batch] for images) at min/opt/max."""

    min: list[int] = Field(default_factory=lambda: [1, 8])
    opt: list[int] = Field(default_factory=lambda: [8, 128])
    max: list[int] = Field(default_factory=lambda: [32, 256])


class ExportConfig(StrictModel):
    """Export to TorchScript, ONNX (+ ONNX Runtime int8), AOTInductor or TensorRT (a causal
    LM: its folder with a standalone runtime), loaded back and checked against the model.

    An export is a leaf: the stage after it continues from the model before it."""

    kind: Literal["export"] = "export"
    name: StageName = None
    format: Literal["torchscript", "onnx", "aoti", "tensorrt", "executorch", "transformers",
                    "gguf", "compressed_tensors"] = Field(
        description="torchscript (.ts), onnx (.onnx), aoti (AOTInductor .pt2 package), "
        "tensorrt (torch-tensorrt, CUDA only), executorch (.pte with XNNPACK); causal LMs: "
        "transformers (the model folder that plain transformers + torchao load, with the "
        "causal_lm.runtime package to decode it), gguf (one file for llama.cpp and Ollama) or "
        "compressed_tensors (the checkpoint vLLM, SGLang and transformers load).")
    source: str | int | None = Field(
        None, description="Export the model of this earlier stage (name, kind or index) "
        "instead of the current one.")
    tolerance: float | None = Field(
        None, gt=0, description="Largest max-abs logit difference accepted (default: "
        "torchscript 1e-5, onnx and aoti 1e-4; none when the export quantizes).")
    min_agreement: float | None = Field(
        None, gt=0, le=1, description="Smallest share of equal argmax accepted (default: "
        "0.995, or 0.90 when the export itself quantizes; causal LMs: of equal greedy "
        "tokens on the prompts, default 1.0).")
    max_accuracy_drop: float | None = Field(
        None, ge=0, le=100, description="Largest accuracy loss in points against the source "
        "model (default: 1.5 when the export itself quantizes, else unchecked).")
    min_fidelity: float | None = Field(
        None, gt=0, le=1, description="Embedding models: smallest mean cosine accepted "
        "between the file's embeddings and the source model's (default: 0.99999, or 0.99 "
        "when the file or the model is int8 or bf16).")
    min_kendall_tau: float | None = Field(
        None, ge=-1, le=1, description="Rerankers: smallest Kendall's tau accepted between "
        "the file's scores and the source model's, per query then averaged over the eval "
        "queries (near-ties of the source, within 0.001, not counted; default: 0.9 when the "
        "file or the model is int8 or bf16, else unchecked: a lossless file is held to "
        "tolerance).")
    parity_samples: int | None = Field(
        None, ge=1, description="Eval examples (causal LMs: prompts) compared with the source "
        "model (default: all).")
    threads: int | None = Field(
        None, ge=1, le=4096,
        description="Intra-op threads of the runtime (default: the latency threads).")
    opset: int = Field(18, ge=17, le=23, description="ONNX opset.")
    exporter: Literal["auto", "dynamo", "torchscript"] = Field(
        "auto", description="ONNX exporter: auto tries the TorchScript-based one (the graph "
        "ONNX Runtime runs fastest), then dynamo.")
    optimize: bool = Field(
        False, description="ONNX: fuse attention and layer norms with ONNX Runtime's "
        "transformer optimizer.")
    quantize: Literal["dynamic", "static", "8da4w", "8da8w"] | None = Field(
        None, description="ONNX: int8 with ONNX Runtime (dynamic, or static QDQ calibrated "
        "on the calibration split). ExecuTorch: XNNPACK's int8 of the linear layers, "
        "weights per channel; static calibrates their activation scales (those fed by a "
        "GELU: dynamic), dynamic takes them at each call. A causal LM's ExecuTorch export: "
        "8da4w (int8 activations scaled per token at each call, int4 weights per group of "
        "32, the output projection's int8) or 8da8w (int8 weights per channel); none: "
        "float32.")
    keep_float: list[str] = Field(
        default_factory=list, description="ONNX Runtime int8: module name patterns (fnmatch) "
        "whose MatMul and Gemm nodes stay in float.")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    precision: Literal["fp32", "fp16", "int8"] = Field("fp32", description="TensorRT precision.")
    autocast: Literal["bf16"] | None = Field(
        None, description="AOTInductor: compile the graph's float ops in bfloat16 (for a "
        "PT2E int8 model: int8 layers, everything else in bf16). Needs a bf16 CPU.")
    attention: Literal["sdpa", "kernel", "packed"] = Field(
        "sdpa", description="AOTInductor, encoders: sdpa (aten's float32 attention) or "
        "kernel (compress's own, serve/encoder_attention.cpp: bfloat16 products with float32 "
        "softmax on AVX512-BF16, ~2x sdpa at 8 x 128 on MiniLM; float32 elsewhere); packed "
        "(sentence encoders): the same kernel over the real tokens of a batch only, packed "
        "into one sequence inside the graph (no padding, one pass a batch; an int8 model "
        "must be quantized packed: the search's pt2e_static_packed_aoti). The package then "
        "needs that operator, which the served archive builds or carries.")
    shapes: TensorRTShapes = Field(default_factory=TensorRTShapes)
    tensor_parallel: TensorParallel = None
    pipeline_parallel: PipelineParallel = None
    expert_parallel: ExpertParallel = None
    oversubscribe: Oversubscribe = False

    @property
    def quantizes(self) -> bool:
        """Whether the export itself changes the precision (its logits cannot match)."""
        return (self.format == "onnx" and self.quantize is not None) or (
            self.format == "tensorrt" and self.precision != "fp32") or (
            self.format == "aoti" and (self.autocast is not None or self.attention != "sdpa")) or (
            self.format == "executorch" and self.quantize is not None)

    @model_validator(mode="after")
    def _options_fit_the_format(self) -> ExportConfig:
        own = {"onnx": ONNX_ONLY, "tensorrt": TENSORRT_ONLY, "aoti": AOTI_ONLY,
               "executorch": EXECUTORCH_ONLY}.get(self.format, ())
        stray = [k for k in (*ONNX_ONLY, *TENSORRT_ONLY, *AOTI_ONLY, "calibration")
                 if k in self.model_fields_set and k not in own
                 and not (k == "calibration"
                          and self.format in ("onnx", "tensorrt", "executorch"))]
        if stray:
            raise ValueError(f"{', '.join(stray)} do not apply to format {self.format}")
        if self.quantize in EXECUTORCH_LM_SCHEMES and self.format != EXECUTORCH_FORMAT:
            raise ValueError(f"quantize: {self.quantize} is a causal LM's scheme of format "
                             "executorch; ONNX Runtime int8 is dynamic or static")
        if self.keep_float and not self.quantize:
            raise ValueError("keep_float applies to ONNX Runtime int8 only; set quantize")
        if self.optimize and self.quantize:
            raise ValueError("optimize works on float ONNX models only (ONNX Runtime's "
                             "quantizers fail on fused graphs); drop it: the session still "
                             "applies its own graph optimizations when it loads")
        return self


def _splits(cfg: ExportConfig) -> tuple[str, ...]:
    calibrated = (cfg.format in ("onnx", "executorch") and cfg.quantize == "static") or (
        cfg.format == "tensorrt" and cfg.precision == "int8")
    return ("eval", "calibration") if calibrated else ("eval",)


def _runtime(config: dict[str, Any], metrics: dict[str, Any]) -> str:
    fmt = config.get("format") or metrics.get("runtime") or "?"
    extra = {"onnx": f" int8 {config['quantize']}" if config.get("quantize") else "",
             "tensorrt": f" {config.get('precision', 'fp32')}",
             "aoti": f" {config['autocast']} autocast" if config.get("autocast") else "",
             "executorch": "" if not config.get("quantize") else
             f" {config['quantize']}" if config["quantize"] in EXECUTORCH_LM_SCHEMES
             else " int8"}.get(fmt, "")
    return RUNTIMES.get(fmt, fmt) + extra


def _file_precision(cfg: ExportConfig) -> str | None:
    """The precision of the written file when the export itself changes it."""
    if cfg.format in ("onnx", "executorch") and cfg.quantize:
        return "int4" if cfg.quantize == "8da4w" else "int8"
    if cfg.format == "aoti" and cfg.autocast:
        return cfg.autocast
    return cfg.precision if cfg.format == "tensorrt" and cfg.precision != "fp32" else None


def _fits_the_model(recipe: Any, i: int) -> list[str]:
    """The format can hold the model it exports (TorchScript and ONNX cannot hold PT2E int8,
    TensorRT takes a float model)."""
    from compress.recipe.chain import chain_precision, model_chain

    stage = recipe.stages[i]
    lm_executorch = _executorch_lm_problems(recipe, i) if stage.format == EXECUTORCH_FORMAT \
        else None
    if lm_executorch is not None:
        return lm_executorch
    if stage.format in FILE_SCHEMES:  # llama.cpp's blocks, compressed-tensors' packing
        schemes = [getattr(recipe.stages[j], "scheme", None) for j in model_chain(recipe, i)]
        scheme = next((s for s in reversed(schemes) if s), None)
        if scheme not in FILE_SCHEMES[stage.format]:
            held = ("float, int8_grouped (Q8_0) and int4_grouped (Q4_1) weights"
                    if stage.format == GGUF_FORMAT else
                    "int8_grouped and int4_grouped weights (nothing to compress in a float "
                    "model)")
            return [f"stages.{i}.format: {stage.format} holds {held}, not "
                    f"{scheme or 'float'}; quantize "
                    "with one of those, or export format transformers"]
        return []
    if chain_precision(recipe, i) != "int8" or stage.format == CAUSAL_LM_FORMAT or any(
            getattr(recipe.stages[j], "scheme", None) for j in model_chain(recipe, i)):
        return []  # a causal LM's weight scheme: the family check speaks for it
    if stage.format in ("torchscript", "onnx"):
        return [f"stages.{i}.format: {stage.format} cannot hold the PT2E int8 model it would "
                f"export; use format aoti for it, or set source to a stage before the "
                f"quantize stage to export the float model"]
    if stage.format == "tensorrt":
        return [f"stages.{i}.format: tensorrt takes a float model; set source to a stage "
                f"before the quantize stage"]
    if stage.format == "executorch":
        return [f"stages.{i}.format: executorch cannot hold the PT2E int8 model (quantized "
                f"for x86) it would export; set source to a stage before the quantize stage "
                f"and quantize: static for XNNPACK's own int8, or use format aoti"]
    return []


def _executorch_lm_problems(recipe: Any, i: int) -> list[str] | None:
    """What a causal LM's .pte cannot hold of the model stage i exports: experts, 2:4 and
    torchao's schemes (float or the grouped schemes, dequantized and re-rounded by 8da4w /
    8da8w, it takes); None when the chain made no causal LM's layers (a classifier's
    checks follow)."""
    from compress.recipe.chain import model_chain
    from compress.recipe.parallel import MAKES_EXPERTS

    chain = [recipe.stages[j] for j in model_chain(recipe, i)]
    experts = next((s for s in chain if s.kind in MAKES_EXPERTS), None)
    if experts is not None:
        return [f"stages.{i}.format: executorch does not hold mixture-of-experts layers (made "
                f"by the {experts.kind} stage); set source to a stage before it, or export "
                "format transformers"]
    scheme = next((s.scheme for s in reversed(chain) if getattr(s, "scheme", None)), None)
    if scheme is None:
        return None
    if scheme not in EXECUTORCH_LM_MODELS:
        return [f"stages.{i}.format: executorch takes a float causal LM or int8_grouped / "
                f"int4_grouped layers (re-rounded by quantize: 8da4w or 8da8w), not "
                f"{scheme}; set source to a stage before the quantize stage, or export "
                "format transformers"]
    return []


def _executorch_lm_options(cfg: ExportConfig, where: str) -> list[str]:
    """A causal LM's .pte: quantize 8da4w, 8da8w or none, in one process."""
    problems = []
    if cfg.quantize is not None and cfg.quantize not in EXECUTORCH_LM_SCHEMES:
        problems.append(f"{where}.quantize: a causal LM's executorch export takes 8da4w or "
                        "8da8w (XNNPACK's int8 dynamic activations, int4 or int8 weights) or "
                        f"none (float32), not {cfg.quantize}")
    problems += [f"{where}.{o}: a .pte runs in one process; export format transformers to "
                 "split a causal LM" for o in PARALLEL if o in cfg.model_fields_set]
    return problems + [
        f"{where}.{o}: a classifier export option; a causal LM's executorch export takes "
        "quantize, min_agreement and parity_samples"
        for o in sorted(cfg.model_fields_set - {*CAUSAL_LM_EXPORT_OPTIONS, "quantize"})]


def _check_task(cfg: ExportConfig, task: str, index: int) -> list[str]:
    """A causal LM exports with format transformers and only its options; a classifier or
    an embedding model with any other format, each with its own parity bounds."""
    where = f"stages.{index}"
    if task != "causal-lm":
        split = [o for o in PARALLEL if o in cfg.model_fields_set]
        if split:
            return [f"{where}.{split[0]}: splits a causal LM's decoder layers across "
                    "processes; this model exports whole"]
        if cfg.format in CAUSAL_LM_FORMATS:
            return [f"{where}.format: {cfg.format} exports a causal LM; this model exports "
                    "with torchscript, onnx, aoti, tensorrt or executorch"]
        if cfg.quantize in EXECUTORCH_LM_SCHEMES:
            return [f"{where}.quantize: {cfg.quantize} is a causal LM's executorch scheme; "
                    "this model's takes static or dynamic (XNNPACK int8)"]
        own, held = PARITY_BOUNDS[task]
        theirs = [o for bounds, _ in PARITY_BOUNDS.values() for o in bounds if o not in own]
        return [f"{where}.{o}: not a parity bound of this model (model.task: {task}); {held}"
                for o in theirs if o in cfg.model_fields_set]
    if cfg.format == EXECUTORCH_FORMAT:
        return _executorch_lm_options(cfg, where)
    if cfg.format not in CAUSAL_LM_FORMATS:
        return [f"{where}.format: {cfg.format} exports a classifier's forward pass; a causal "
                f"LM exports with format: {CAUSAL_LM_FORMAT} (its folder with the "
                "causal_lm.runtime package, which decodes it with torch, transformers and "
                f"torchao alone), {GGUF_FORMAT} (one file for llama.cpp and Ollama), "
                f"{COMPRESSED_TENSORS_FORMAT} (the checkpoint vLLM and transformers load) or "
                f"{EXECUTORCH_FORMAT} (a .pte for ExecuTorch, quantize: 8da4w or 8da8w)"]
    return [f"{where}.{o}: a classifier export option; a causal LM's export is checked by "
            "greedy token agreement on the prompts (min_agreement, parity_samples)"
            for o in sorted(cfg.model_fields_set - set(CAUSAL_LM_EXPORT_OPTIONS))]


SPEC = register(StageSpec(
    kind="export", config=ExportConfig, runner="compress.stages.export:run", order=60,
    makes_model=False, splits=_splits, runtime=_runtime,
    check=lambda recipe, i: _fits_the_model(recipe, i) + parallel_problems(recipe, i),
    check_model=parallel_fits_the_config,
    reload="compress.stages.export:reload", precision=_file_precision,
    needs=lambda cfg: ("cuda",) if cfg.format == "tensorrt" else (
        ("bf16_cpu",) if cfg.autocast else ()),
    export_formats=lambda cfg: (cfg.format,),
    check_task=_check_task,
    shipped_code={"causal-lm": ("serve.causal_lm.runtime",)},  # its folder's `causal_lm/`
))
