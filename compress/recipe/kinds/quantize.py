"""Stage kind `quantize`: its config and spec (no torch import; run module: quantize.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compress.recipe.options import CalibrationOptions, StageName, StrictModel, TrainOptions
from compress.recipe.registry import StageSpec, register

WEIGHT_SCHEMES = ("int8_weight_only", "int4_weight_only", "int8_dynamic", "int8_grouped",
                  "int4_grouped", "int8_sparse24", "int4_sparse24")
GROUPED = ("int8_grouped", "int4_grouped")
SPARSE24 = ("int8_sparse24", "int4_sparse24")  # 2:4 weights, compress's sparse kernel
PT2E_OPTIONS = ("per_channel", "keep_float", "calibration", "compile", "smoothing")
CAUSAL_LM_ONLY_OPTIONS = ("scheme", "group_size", "head_scheme", "activations", "equalize",
                          "grid")


class QuantizeConfig(StrictModel):
    """int8 quantization: PT2E (X86InductorQuantizer) for classifiers, torchao `quantize_`
    weight schemes for causal LMs."""

    kind: Literal["quantize"] = "quantize"
    name: StageName = None
    scheme: Literal["int8_weight_only", "int4_weight_only", "int8_dynamic",
                    "int8_grouped", "int4_grouped", "int8_sparse24", "int4_sparse24"
                    ] | None = Field(
        None, description="Causal LMs: weight scheme. torchao's: int8 or int4 weights with "
        "float activations, or int8 weights and per-token int8 activations; compress's "
        "int8_grouped: int8 weights with a float32 scale and offset per group of "
        "`group_size` inputs and float32 activations (serve/causal_lm/runtime/grouped.py), which "
        "keeps greedy tokens where bfloat16 activations flip near-ties; int4_grouped: the "
        "same with 4-bit codes on 16 affine levels per 32 inputs (a GGUF's Q4_1 exactly); "
        "int8_sparse24 and int4_sparse24: 2:4 sparse weights (every Linear pruned with the "
        "n:m pattern 2:4 first), the 2 kept values of each 4 inputs as int8 or 4-bit codes on "
        "a symmetric grid per 32 inputs plus their 2-bit positions, float32 activations "
        "(serve/causal_lm/runtime/sparse24.py; the output projection int8_grouped).")
    group_size: int = Field(32, description="Causal LMs, int4 and int8_grouped: weights per "
                            "scale group (int8_grouped: it must divide every Linear's inputs).")
    grid: Literal["free", "gguf", "compressed_tensors"] = Field(
        "free", description="Causal LMs, grouped schemes: free (each int8 group on the better "
        "of an affine and a symmetric grid, float32 scales), gguf (int8 groups on llama.cpp's "
        "Q8_0 grid: symmetric, a float16 scale per 32 inputs; int4 is Q4_1's grid either way) "
        "or compressed_tensors (int8 as gguf; int4 affine with an integer zero point and a "
        "float16 step), so that an export to format gguf or compressed_tensors holds the "
        "weights exactly.")
    head_scheme: Literal["auto", "int8_weight_only", "int4_weight_only", "int8_dynamic",
                         "int8_grouped", "float"] = Field(
        "auto", description="Causal LMs: scheme of the output projection (auto: int8 "
        "weight-only under int4, else the model's scheme; float keeps it in float).")
    activations: Literal["auto", "bfloat16", "float32", "int8", "bf16", "int8_where_vnni"] = Field(
        "auto", description="Causal LMs: activation dtype (auto: bfloat16 for the weight-only "
        "schemes, whose compiled int8/int4 kernels take bf16 inputs, and for int8_dynamic on "
        "a CPU that computes bf16 natively; else float32). The grouped schemes take float32 "
        "(exact), or int8: an opt-in mode that rounds every row's activations to int8 per "
        "group of 32 (llama.cpp's Q8_0 blocks) for VNNI integer products, several times "
        "faster prefills on a VNNI CPU (slower than float32 without VNNI), at the price of "
        "some tokens; or bf16: an opt-in mode that rounds them to bfloat16 for AVX512-BF16's "
        "vdpbf16ps (prefills about 1.8x float32's on such a CPU, fewer tokens changed than "
        "int8; exact float32 on a CPU without it); or int8_where_vnni: int8 where the CPU "
        "that runs the stage multiplies int8 into int32 in one instruction (AVX512-VNNI, "
        "AVX-VNNI, AMX), float32 elsewhere (the shipped LLM recipes' mode). Every mode is "
        "batch-invariant: a row's tokens are the same alone and in any batch. (bfloat16 casts "
        "the model for torchao's schemes.)")
    equalize: bool = Field(
        False, description="Causal LMs, weight-only schemes: activation-aware scaling (AWQ) "
        "before quantizing: each Linear's input channels scaled by mean|x|^alpha (alpha searched "
        "per layer on train text) and the inverse folded into the norm or Linear before it, so "
        "the float model is unchanged and salient channels get more of the grid.")
    mode: Literal["dynamic", "static", "qat"] = Field(
        "static", description="dynamic activations, static (calibrated), or quantization-aware "
        "training (a causal LM takes qat only: its weights trained on the scheme's grid "
        "against the entering model's next-token distributions).")
    per_channel: bool = Field(True, description="Per-channel weight scales.")
    keep_float: list[str] = Field(
        default_factory=list, description="Module name patterns left in float (fnmatch).")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    smoothing: float | None = Field(
        None, ge=0.0, le=1.0, description="Static mode: SmoothQuant's alpha. Each Linear's "
        "input channels are divided by max|x|^alpha / max|W|^(1 - alpha) (observed on the "
        "calibration examples) and its weight columns multiplied by the same, so activation "
        "outliers move into the per-channel weights (compress/algorithms/smoothing.py). "
        "MiniLM embeddings, every Linear int8: 0.8 keeps recall@10 at 0.93 against 0.85 "
        "without. None: no smoothing.")
    qat: TrainOptions = Field(
        default_factory=lambda: TrainOptions(max_steps=100, learning_rate=2e-5),
        description="Training options of mode qat.")
    compile: bool = Field(True, description="Evaluate through torch.compile with freezing.")


def _splits(cfg: QuantizeConfig) -> tuple[str, ...]:
    if cfg.scheme is not None:
        return ("train",) if cfg.mode == "qat" or cfg.equalize else ()
    return {"dynamic": (), "static": ("calibration",), "qat": ("train", "calibration")}[cfg.mode]


def _check_task(cfg: QuantizeConfig, task: str, index: int) -> list[str]:
    """PT2E options on a causal LM, or a weight scheme on a classifier."""
    where = f"stages.{index}"
    if task == "causal-lm":
        wrong = [o for o in PT2E_OPTIONS if o in cfg.model_fields_set]
        problems = [f"{where}.{o}: a PT2E option for classifiers; a causal LM is quantized by "
                    f"`scheme` ({', '.join(WEIGHT_SCHEMES)})" for o in wrong]
        if "mode" in cfg.model_fields_set and cfg.mode != "qat":
            problems.append(f"{where}.mode: {cfg.mode} is a PT2E mode for classifiers; a "
                            "causal LM takes `mode: qat` or no mode (post-training)")
        if cfg.scheme is None:
            problems.append(f"{where}.scheme: a causal LM needs a weight scheme: "
                            f"{', '.join(WEIGHT_SCHEMES)}")
        if cfg.equalize and cfg.scheme == "int8_dynamic":
            problems.append(f"{where}.equalize: activation-aware scaling is for the weight-only "
                            "schemes (it enlarges the activations int8_dynamic quantizes)")
        if cfg.scheme in GROUPED and cfg.activations == "bfloat16":
            problems.append(f"{where}.activations: {cfg.scheme} computes in float32 (its point "
                            "is float32 activations), or in the opt-in modes int8 and bf16 "
                            "(its kernels round float32 activations); drop `activations`, "
                            "use `activations: bf16`, or use int8_weight_only")
        if cfg.activations in ("int8", "int8_where_vnni") and cfg.scheme not in GROUPED:
            problems.append(f"{where}.activations: {cfg.activations} activations are a mode of "
                            f"the grouped schemes ({', '.join(GROUPED)}), not of {cfg.scheme}; "
                            "int8_dynamic quantizes activations per token")
        if cfg.activations == "bf16" and cfg.scheme not in GROUPED:
            problems.append(f"{where}.activations: bf16 activations are a mode of the grouped "
                            f"schemes ({', '.join(GROUPED)}), not of {cfg.scheme}; "
                            "torchao's schemes compute in bfloat16 with `activations: "
                            "bfloat16`")
        if cfg.scheme in SPARSE24:
            problems += _check_sparse24(cfg, where)
        if cfg.scheme == "int4_grouped" and cfg.group_size != 32:
            problems.append(f"{where}.group_size: int4_grouped packs groups of 32 (a GGUF's Q4 "
                            f"blocks), not {cfg.group_size}; drop group_size")
        if cfg.group_size < 1:
            problems.append(f"{where}.group_size: {cfg.group_size} must be positive")
        if cfg.grid != "free" and cfg.scheme not in GROUPED:
            problems.append(f"{where}.grid: {cfg.grid} fits the grouped schemes' groups "
                            f"({', '.join(GROUPED)}), not {cfg.scheme}'s")
        elif cfg.grid == "gguf" and cfg.group_size != 32:
            problems.append(f"{where}.group_size: llama.cpp's blocks hold 32 inputs, so grid "
                            f"gguf needs group_size 32, not {cfg.group_size}")
        if cfg.scheme == "int4_weight_only" and cfg.group_size not in (32, 64, 128, 256):
            problems.append(f"{where}.group_size: {cfg.group_size} is not one of 32, 64, "
                            "128, 256 (torchao's int4 CPU packing)")
        return problems
    causal_lm_only = [o for o in CAUSAL_LM_ONLY_OPTIONS if o in cfg.model_fields_set]
    problems = [f"{where}.{o}: only a causal LM takes this option; this model is "
                "quantized through PT2E (`mode`: dynamic, static or qat)" for o in causal_lm_only]
    if task == "reranking" and cfg.mode == "qat":
        problems.append(f"{where}.mode: a reranker is quantized after training (dynamic or "
                        "static); quantization-aware training of cross-encoders is not built "
                        "yet")
    if cfg.smoothing is not None and cfg.mode != "static":
        problems.append(f"{where}.smoothing: SmoothQuant's scales come from the calibration "
                        f"of static mode, not {cfg.mode}; use `mode: static` or drop "
                        "smoothing")
    return problems


def _check_sparse24(cfg: QuantizeConfig, where: str) -> list[str]:
    """What a 2:4 scheme does not take: other activations, group sizes, QAT, equalize."""
    problems = []
    if cfg.activations not in ("auto", "float32"):
        problems.append(f"{where}.activations: {cfg.scheme} computes in float32 only; drop "
                        "`activations`")
    if cfg.group_size != 32:
        problems.append(f"{where}.group_size: {cfg.scheme} scales groups of 32 inputs, not "
                        f"{cfg.group_size}; drop group_size")
    if cfg.mode == "qat" or cfg.equalize:
        problems.append(f"{where}: {cfg.scheme} is post-training only (no `mode: qat`, no "
                        "`equalize`); recover accuracy before it, in the pruning stages")
    return problems


def _precision(cfg: QuantizeConfig) -> str:
    return "int4" if cfg.scheme in ("int4_weight_only", "int4_grouped", "int4_sparse24") \
        else "int8"


def _runtime(config: dict, metrics: dict) -> str:
    if config.get("scheme") in GROUPED:
        chosen = config.get("activations")
        acts = chosen if chosen in ("int8", "bf16") else "float32"
        return f"{config['scheme']} (compress, {acts} activations), compiled decode"
    if config.get("scheme") in SPARSE24:
        return f"{config['scheme']} (compress 2:4 kernel, float32 activations), compiled decode"
    if config.get("scheme"):
        return f"torchao {config['scheme']}, compiled decode"
    compiled = ", torch.compile" if config.get("compile", True) else ""
    smoothing = (f", SmoothQuant alpha {config['smoothing']}"
                 if config.get("smoothing") is not None else "")
    return f"PT2E int8 {config.get('mode', 'static')}{smoothing}{compiled}"


SPEC = register(StageSpec(
    kind="quantize", config=QuantizeConfig, runner="compress.stages.quantize:run", order=40,
    splits=_splits, refused_before=("quantize", "precision"), precision=_precision,
    runtime=_runtime, reload="compress.stages.quantize:reload",
    check_task=_check_task,
))
