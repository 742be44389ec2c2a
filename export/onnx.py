"""ONNX: `torch.onnx.export` (the TorchScript-based exporter, falling back to dynamo) with
dynamic batch and sequence axes, `onnx.checker`, optional ONNX Runtime transformer fusion,
and optional ONNX Runtime int8 (dynamic, or static QDQ calibrated on real batches).

Hugging Face models are exported with their eager attention: the SDPA graph the dynamo
exporter writes guards the attention scores with IsNaN/Where and leaves GELU as Erf, which
ONNX Runtime does not fuse (MiniLM at 8 x 128: 226 ms against 187 ms, profiled with ORT's
profiler: 20 ms in Where alone). This is the graph Hugging Face Optimum writes too.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from export.errors import ExportError
from export.graphs import (
    TEXT_INPUTS,
    Bundle,
    dynamic_shapes,
    graph_module,
    max_sequence,
    one_line,
    output_name,
    traced_inputs,
)
from export.random_ops import onnx_random_nodes, refuse_random_ops

FILE = "model.onnx"


def export(bundle: Bundle, cfg, folder: Path, calibration=None,
           log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Write `model.onnx` (optimized and int8 per `cfg`); return it and what was done."""
    if bundle.kind == "pt2e":
        raise ExportError("onnx cannot hold a PT2E int8 model; export it with format aoti, "
                          "or export the float model and set quantize: static for ONNX "
                          "Runtime int8")
    import onnx

    path = folder / FILE
    float_path = folder / "model.fp32.onnx" if cfg.quantize else path
    exporter = write_onnx(bundle, float_path, cfg.opset, cfg.exporter, log)
    onnx.checker.check_model(str(float_path))
    refuse_random_ops(onnx_random_nodes(onnx.load(str(float_path), load_external_data=False)),
                      "the onnx graph")
    facts: dict[str, Any] = {"onnx_exporter": exporter, "onnx_opset": cfg.opset}
    if cfg.optimize:
        facts["onnx_fused_ops"] = optimize(float_path, bundle)
    if cfg.quantize:
        excluded = float_nodes(float_path, cfg.keep_float)
        quantize(float_path, path, cfg.quantize, bundle, calibration, excluded)
        float_path.unlink()
        onnx.checker.check_model(str(path))
        facts["onnx_quantize"] = cfg.quantize
        if cfg.keep_float:
            facts["onnx_float_nodes"] = len(excluded)
    return path, facts


def write_onnx(bundle: Bundle, path: Path, opset: int, exporter: str,
               log: Callable[[str], None] = print) -> str:
    """Export with the dynamo exporter or the TorchScript-based one; return which worked."""
    module = graph_module(bundle).eval()
    args = traced_inputs(bundle)
    names = list(TEXT_INPUTS) if bundle.is_text else ["input"]
    output = output_name(bundle)
    order = ["torchscript", "dynamo"] if exporter == "auto" else [exporter]
    failures = []
    for name in order:
        try:
            with warnings.catch_warnings(), _quiet_onnx_logs(), eager_attention(bundle.model):
                warnings.simplefilter("ignore")
                if name == "dynamo":
                    shapes = dynamic_shapes(bundle.is_text, max_sequence(bundle.model))
                    torch.onnx.export(module, args, str(path), dynamo=True, external_data=False,
                                      opset_version=opset, input_names=names,
                                      output_names=[output], dynamic_shapes=shapes,
                                      verbose=False)
                else:
                    axes = {n: ({0: "batch", 1: "sequence"} if bundle.is_text else {0: "batch"})
                            for n in names}
                    axes[output] = {0: "batch"}
                    torch.onnx.export(module, args, str(path), dynamo=False, opset_version=opset,
                                      input_names=names, output_names=[output],
                                      dynamic_axes=axes)
            return name
        except Exception as exc:  # an exporter's failure: try the next, report all
            failures.append(f"{name}: {one_line(exc, 200)}")
            if name != order[-1]:
                log(f"the {name} ONNX exporter failed ({one_line(exc, 200)}); "
                    f"trying the next one")
    raise ExportError("ONNX export failed: " + "; ".join(failures))


@contextlib.contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[None]:
    """A Hugging Face model's attention set to "eager" for the block (the graph ONNX Runtime
    fuses best), then restored; other models are left as they are."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@contextlib.contextmanager
def _quiet_onnx_logs() -> Iterator[None]:
    """Silence the exporter's INFO chatter for the block."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def optimize(path: Path, bundle: Bundle) -> dict[str, int]:
    """Fuse attention, layer norm and GELU with ONNX Runtime's transformer optimizer (BERT
    models; heads and width are detected from the graph, so pruned models work)."""
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = getattr(getattr(bundle.model, "config", None), "model_type", "bert")
    optimized = optimize_model(str(path), model_type=model_type if model_type in (
        "bert", "roberta", "distilbert", "albert") else "bert", num_heads=0, hidden_size=0)
    optimized.save_model_to_file(str(path))
    return {k: int(v) for k, v in optimized.get_fused_operator_statistics().items() if v}


def float_nodes(path: Path, patterns: list[str]) -> list[str]:
    """Names of the MatMul and Gemm nodes of the modules matching any fnmatch pattern (the
    exporter names a node by its module path: /model/bert/encoder/layer.0/.../MatMul)."""
    import fnmatch

    import onnx

    if not patterns:
        return []
    names = []
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        scope = node.name.strip("/").rpartition("/")[0].replace("/", ".")
        module = scope.removeprefix("model.")  # the TextLogits wrapper of text models
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            names.append(node.name)
    return names


def quantize(float_path: Path, path: Path, mode: str, bundle: Bundle,
             calibration: Iterable[Any] | None, excluded: list[str] | None = None) -> None:
    """ONNX Runtime int8: dynamic (weights int8, activations at run time), or static QDQ
    of the MatMul and Gemm ops with activations calibrated on the `calibration` batches;
    the nodes named in `excluded` stay in float."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    _drop_value_info(float_path)
    if mode == "dynamic":
        # per-tensor weight scales, and the attention's two activation-by-activation
        # MatMuls in int8 too (MatMulConstBOnly off), as Optimum's --avx512_vnni does. On
        # the bert_int8 MiniLM (Zen, AVX512-VNNI): 87.73% SST-2 at 27.7 ms (8 x 128)
        # against 86.93% at 32.2 ms for per-channel weight-only MatMuls. An embedding
        # model's weights are scaled per channel: per tensor, all-MiniLM-L6-v2's embeddings
        # of 64 SST-2 sentences kept a mean cosine of 0.957 with fp32's, per channel 0.991;
        # a reranker's too: all-MiniLM-L6-v2 with a random one-label head on 59 known-item
        # SST-2 queries kept Kendall's tau 0.976 with fp32's scores, per tensor 0.922
        quantize_dynamic(str(float_path), str(path), weight_type=QuantType.QInt8,
                         per_channel=bundle.kind in ("embedding", "reranker"),
                         nodes_to_exclude=excluded or [],
                         extra_options={"MatMulConstBOnly": False})
        return
    pre = float_path.with_name("model.pre.onnx")
    quant_pre_process(str(float_path), str(pre), skip_symbolic_shape=True)
    reader = _CalibrationReader(_feeds(bundle, calibration))
    # MatMul and Gemm only: calibrating every op takes in the attention mask's huge
    # negative fill, and BERT then agreed with fp32 on 77% of SST-2 (86.5% accuracy here)
    quantize_static(str(pre), str(path), reader, quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul", "Gemm"], per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    nodes_to_exclude=excluded or [])
    pre.unlink()


def _drop_value_info(path: Path) -> None:
    """Remove the exporter's intermediate shape annotations, which ONNX Runtime's quantizer
    re-infers (the dynamo exporter's clash with its inference on BERT graphs)."""
    import onnx

    model = onnx.load(str(path))
    del model.graph.value_info[:]
    onnx.save(model, str(path))


def _feeds(bundle: Bundle, batches: Iterable[Any] | None) -> Iterator[dict[str, Any]]:
    """ONNX Runtime feeds of the calibration batches (token dicts, or image tensors)."""
    if batches is None:
        raise ValueError("static ONNX Runtime quantization needs the calibration split")
    for inputs in batches:
        if not bundle.is_text:
            yield {"input": inputs.numpy()}
            continue
        feed = {n: inputs[n].numpy() for n in TEXT_INPUTS if n in inputs}
        feed.setdefault("token_type_ids", torch.zeros_like(inputs["input_ids"]).numpy())
        yield feed


class _CalibrationReader:
    """ONNX Runtime's CalibrationDataReader protocol over our batches."""

    def __init__(self, batches: Iterator[dict[str, Any]]):
        self.batches = batches

    def get_next(self) -> dict[str, Any] | None:
        return next(self.batches, None)

    def rewind(self) -> None:  # the calibrator reads once
        pass
