"""Stage configuration classes: one pydantic model per stage kind (no torch import here).

Each stage kind is one config class here plus one plain function
`run(state, cfg, ctx) -> state` in `compress/stages/<kind>.py`. A config may declare
`needs_before` (stage kinds that must come earlier) and `uses_splits` (data splits it reads).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StageName = Annotated[
    str | None, Field(description="Display name of the stage (default: its kind).")]


class StrictModel(BaseModel):
    """Frozen, unknown keys forbidden: the base of every recipe section."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainOptions(StrictModel):
    """Options of the shared training loop (finetune, distill, QAT)."""

    epochs: float = Field(1.0, gt=0, description="Passes over the train split (fractions allowed).")
    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps; when set, overrides epochs."
    )
    batch_size: int = Field(32, ge=1, le=4096, description="Examples per forward pass.")
    grad_accum_steps: int = Field(
        1, ge=1, description="Forward passes per optimizer step (batch_size x this per step)."
    )
    learning_rate: float = Field(5e-5, gt=0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(
        0.1, ge=0, le=1, description="Share of steps warming up linearly, then linear decay."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the gradient norm to this value (null: no clipping)."
    )
    bf16: bool = Field(False, description="Train under bfloat16 autocast (AVX512-BF16 / AMX).")
    checkpoint_every: int = Field(
        50, ge=1, description="Save a resumable checkpoint every N optimizer steps."
    )
    seed: int | None = Field(None, description="Seed of this stage (default: the recipe's seed).")


class FinetuneConfig(TrainOptions):
    """Supervised fine-tuning of the current model on the train split (cross-entropy)."""

    kind: Literal["finetune"] = "finetune"
    name: StageName = None

    uses_splits: ClassVar[tuple[str, ...]] = ("train",)


class StudentSpec(StrictModel):
    """The student of a distillation: exactly one of layers, layer_indices, factory, hf_config."""

    layers: int | None = Field(
        None, ge=1, description="Keep this many evenly spaced teacher layers.")
    layer_indices: list[int] | None = Field(
        None, min_length=1, description="Keep exactly these teacher layers (0-based).")
    factory: str | None = Field(None, description="`module:factory` building the student.")
    kwargs: dict = Field(default_factory=dict, description="Arguments of the factory.")
    hf_config: dict | None = Field(
        None, description="Overrides of the teacher's HF config (a fresh student).")

    @model_validator(mode="after")
    def _exactly_one(self) -> StudentSpec:
        given = [k for k in ("layers", "layer_indices", "factory", "hf_config")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of layers, layer_indices, factory, hf_config "
                             f"(got {', '.join(given) or 'none'})")
        indices = self.layer_indices
        if indices is not None and (min(indices) < 0 or len(set(indices)) != len(indices)):
            raise ValueError("layer_indices must be distinct and non-negative")
        return self


class DistillConfig(TrainOptions):
    """Knowledge distillation: the entering model is the frozen teacher of a smaller student."""

    kind: Literal["distill"] = "distill"
    name: StageName = None
    student: StudentSpec = Field(description="How the student is built.")
    temperature: float = Field(2.0, gt=0, description="Softmax temperature T of the KL term.")
    alpha: float = Field(
        0.5, ge=0, le=1,
        description="Weight of cross-entropy; (1 - alpha) * T^2 weighs the KL term.")

    uses_splits: ClassVar[tuple[str, ...]] = ("train",)


class PruneConfig(StrictModel):
    """Magnitude pruning: unstructured (per layer), global (one threshold), or structured."""

    kind: Literal["prune"] = "prune"
    name: StageName = None
    method: Literal["unstructured", "global", "structured"] = Field(
        "unstructured", description="unstructured: L1 per layer; global: one threshold across "
        "layers; structured: remove whole neurons, heads or channels.")
    amount: float = Field(0.5, gt=0, lt=1, description="Share of weights (or units) to remove.")
    target: Literal["ffn", "heads", "ffn+heads", "channels"] = Field(
        "ffn", description="Structured only: feed-forward neurons, heads, or CNN channels.")
    include: list[str] = Field(
        default_factory=lambda: ["*"], description="Module name patterns to prune (fnmatch).")
    exclude: list[str] = Field(
        default_factory=lambda: ["*embeddings*", "*classifier*", "*pooler*"],
        description="Module name patterns never pruned (embeddings and the head by default).")
    recovery: TrainOptions | None = Field(
        None, description="Fine-tune after pruning (masks kept) to recover accuracy.")
    gradual: bool = Field(
        False, description="Raise sparsity step by step over the recovery steps (needs recovery).")


    @property
    def uses_splits(self) -> tuple[str, ...]:
        return ("train",) if self.recovery else ()

    @model_validator(mode="after")
    def _gradual_needs_recovery(self) -> PruneConfig:
        if self.gradual and self.recovery is None:
            raise ValueError("gradual: true needs recovery (the steps over which sparsity rises)")
        if self.gradual and self.method == "structured":
            raise ValueError("gradual: true works with unstructured and global pruning only")
        return self


class CalibrationOptions(StrictModel):
    """Calibration of static quantization."""

    samples: int = Field(256, ge=1, description="Examples of the calibration split to observe.")
    batch_size: int = Field(32, ge=1, description="Batch size of the calibration passes.")


class QuantizeConfig(StrictModel):
    """int8 quantization through torch.export and torchao's PT2E flow (X86InductorQuantizer)."""

    kind: Literal["quantize"] = "quantize"
    name: StageName = None
    mode: Literal["dynamic", "static", "qat"] = Field(
        "static", description="dynamic activations, static (calibrated), or quantization-aware "
        "training.")
    per_channel: bool = Field(True, description="Per-channel weight scales.")
    keep_float: list[str] = Field(
        default_factory=list, description="Module name patterns left in float (fnmatch).")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    qat: TrainOptions = Field(
        default_factory=lambda: TrainOptions(max_steps=100, learning_rate=2e-5),
        description="Training options of mode qat.")
    compile: bool = Field(True, description="Evaluate through torch.compile with freezing.")


    @property
    def uses_splits(self) -> tuple[str, ...]:
        return {"dynamic": (), "static": ("calibration",),
                "qat": ("train", "calibration")}[self.mode]


class CompileConfig(StrictModel):
    """torch.compile of the current model; records compile time and latency after it."""

    kind: Literal["compile"] = "compile"
    name: StageName = None
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        Field("default", description="torch.compile mode."))
    dynamic: bool | None = Field(None, description="Dynamic shapes (null: let torch decide).")
    freezing: bool = Field(True, description="Inductor freezing (constant-folds weights).")


class TensorRTShapes(StrictModel):
    """TensorRT optimisation profile: [batch, sequence] (or [batch] for images) at min/opt/max."""

    min: list[int] = Field(default_factory=lambda: [1, 8])
    opt: list[int] = Field(default_factory=lambda: [8, 128])
    max: list[int] = Field(default_factory=lambda: [32, 256])


ONNX_ONLY = ("opset", "exporter", "optimize", "quantize")
TENSORRT_ONLY = ("precision", "shapes")


class ExportConfig(StrictModel):
    """Export to TorchScript, ONNX (+ ONNX Runtime int8), AOTInductor or TensorRT, loaded
    back in its own runtime and checked against the model it came from.

    An export is a leaf: the stage after it continues from the model before it."""

    kind: Literal["export"] = "export"
    name: StageName = None
    format: Literal["torchscript", "onnx", "aoti", "tensorrt"] = Field(
        description="torchscript (.ts), onnx (.onnx), aoti (AOTInductor .pt2 package) or "
        "tensorrt (torch-tensorrt, CUDA only).")
    source: str | int | None = Field(
        None, description="Export the model of this earlier stage (name, kind or index) "
        "instead of the current one.")
    tolerance: float | None = Field(
        None, gt=0, description="Largest max-abs logit difference accepted (default: "
        "torchscript 1e-5, onnx and aoti 1e-4; none when the export quantizes).")
    min_agreement: float | None = Field(
        None, gt=0, le=1, description="Smallest share of equal argmax accepted (default: "
        "0.995, or 0.90 when the export itself quantizes).")
    max_accuracy_drop: float | None = Field(
        None, ge=0, description="Largest accuracy loss in points against the source model "
        "(default: 1.5 when the export itself quantizes, else unchecked).")
    parity_samples: int | None = Field(
        None, ge=1, description="Eval examples compared with the source model (default: all).")
    threads: int | None = Field(
        None, ge=1, description="Intra-op threads of the runtime (default: the latency threads).")
    opset: int = Field(18, ge=17, le=23, description="ONNX opset (18: the dynamo exporter's own).")
    exporter: Literal["auto", "dynamo", "torchscript"] = Field(
        "auto", description="ONNX exporter: auto tries dynamo, then the TorchScript-based one.")
    optimize: bool = Field(
        False, description="ONNX: fuse attention and layer norms with ONNX Runtime's "
        "transformer optimizer.")
    quantize: Literal["dynamic", "static"] | None = Field(
        None, description="ONNX: int8 with ONNX Runtime (dynamic, or static QDQ calibrated "
        "on the calibration split).")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    precision: Literal["fp32", "fp16", "int8"] = Field("fp32", description="TensorRT precision.")
    shapes: TensorRTShapes = Field(default_factory=TensorRTShapes)

    @property
    def uses_splits(self) -> tuple[str, ...]:
        calibrated = (self.format == "onnx" and self.quantize == "static") or (
            self.format == "tensorrt" and self.precision == "int8")
        return ("eval", "calibration") if calibrated else ("eval",)

    @property
    def quantizes(self) -> bool:
        """Whether the export itself changes the precision (its logits cannot match)."""
        return (self.format == "onnx" and self.quantize is not None) or (
            self.format == "tensorrt" and self.precision != "fp32")

    @model_validator(mode="after")
    def _options_fit_the_format(self) -> ExportConfig:
        own = {"onnx": ONNX_ONLY, "tensorrt": TENSORRT_ONLY}.get(self.format, ())
        stray = [k for k in (*ONNX_ONLY, *TENSORRT_ONLY, "calibration")
                 if k in self.model_fields_set and k not in own
                 and not (k == "calibration" and self.format in ("onnx", "tensorrt"))]
        if stray:
            raise ValueError(f"{', '.join(stray)} do not apply to format {self.format}")
        if self.optimize and self.quantize:
            raise ValueError("optimize works on float ONNX models only (ONNX Runtime's "
                             "quantizers fail on fused graphs); drop it: the session still "
                             "applies its own graph optimizations when it loads")
        return self


class PackageConfig(StrictModel):
    """A TorchServe archive (.mar) of an exported file with compress's batching handler.

    A leaf like export: it adds `<model_name>.mar` and hands nothing on."""

    kind: Literal["package"] = "package"
    name: StageName = None
    artifact: str | int | None = Field(
        None, description="The export stage to package (name or index; default: the latest "
        "export before this stage).")
    model_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name served at /predictions/<name> (default: the recipe's name).")
    version: str = Field("1.0", pattern=r"^[0-9][0-9A-Za-z.]*$", description="Model version.")
    batch_size: int = Field(
        8, ge=1, le=1024, description="Largest batch TorchServe forms from waiting requests.")
    max_batch_delay_ms: int = Field(
        20, ge=0, le=10_000, description="How long TorchServe waits to fill a batch.")
    workers: int = Field(1, ge=1, le=64, description="Worker processes (min = max workers).")
    threads: int | None = Field(
        None, ge=1, description="Intra-op threads per worker (default: cores / workers; "
        "workers x threads is capped at the cores).")
    response_timeout_s: int = Field(
        120, ge=1, description="Seconds before TorchServe gives up on a batch.")
    max_text_chars: int = Field(
        10_000, ge=1, description="Longer texts are refused with a 400 (tokens past the "
        "recipe's max_length are truncated).")

    measured: ClassVar[bool] = False
    code_modules: ClassVar[tuple[str, ...]] = ("serve.handler", "serve.package")


STAGE_CONFIGS: dict[str, type[StrictModel]] = {
    "finetune": FinetuneConfig,
    "distill": DistillConfig,
    "prune": PruneConfig,
    "quantize": QuantizeConfig,
    "compile": CompileConfig,
    "export": ExportConfig,
    "package": PackageConfig,
}

# Kinds whose output is a file, not the next model: the stage after one continues from the
# model that entered it.
LEAF_KINDS = frozenset({"export", "package"})
SERVABLE_FORMATS = ("torchscript", "onnx", "aoti")

# kind -> "module:function", imported only when the stage runs (keeps `validate` torch-free).
STAGE_RUNNERS: dict[str, str] = {
    "finetune": "compress.stages.finetune:run",
    "distill": "compress.stages.distill:run",
    "prune": "compress.stages.prune:run",
    "quantize": "compress.stages.quantize:run",
    "compile": "compress.stages.compile:run",
    "export": "compress.stages.export:run",
    "package": "compress.stages.package:run",
}


def stage_doc(kind: str) -> str:
    """The one-line description of a stage kind."""
    doc = STAGE_CONFIGS[kind].__doc__ or ""
    return doc.strip().splitlines()[0]
