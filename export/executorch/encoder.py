"""ExecuTorch for classifiers, embedders and rerankers: `torch.export` with dynamic batch
and sequence, lowered to the XNNPACK delegate (export.executorch.lowering) and written as
one `model.pte` program, which `executorch.runtime` runs on a CPU (serve.runtimes.load_executorch);
the ops XNNPACK does not take (layer norm, embedding lookups, the mask) run on ExecuTorch's
portable kernels.

A program plans its memory for the largest shapes it accepts, so its batch is bounded
(`MAX_BATCH`; the loader runs a bigger batch in slices) and so is its sequence (the model's
position table); both are written to export.json. Hugging Face attention is captured in its
eager form: the SDPA path builds a batch x sequence x sequence mask on portable kernels
(MiniLM bounded at 64 x 512: 17 s to load against 1.2 s, 38 s against 13 s for a 64 x 512
batch, on 2 busy Xeon cores).

`quantize` quantizes the float graph's linear layers with XNNPACK's own PT2E quantizer
(symmetric int8 weights, one scale per output channel), as ONNX Runtime int8 quantizes
MatMul/Gemm only (calibrating every add takes in the attention mask's huge negative fill).
`static`: activation scales calibrated on the calibration split, except for the linears fed
by a GELU (a transformer's FFN down-projection), whose inputs' outliers a fixed scale could
not hold: they take their scale at each call (XNNPACK's dynamic int8). all-MiniLM-L6-v2's
embeddings of 256 SST-2 sentences kept a mean cosine of 0.948 with fp32's when those were
static too, 0.991 so (0.994 with them float). `dynamic`: every linear so. A PT2E model
quantized earlier for x86 (the quantize stage) is refused: its quantize/dequantize pairs are
Inductor's.
ExecuTorch is the `executorch` extra, imported when the stage runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from export.errors import CaptureError, ExportError, one_line
from export.executorch.lowering import EXTRA, FILE, Lower, lowering
from export.graphs import (
    Bundle,
    export_inputs,
    graph_module,
    max_sequence,
    positional_inputs,
)
from export.onnx import eager_attention
from export.random_ops import fx_random_nodes, refuse_random_ops

MAX_BATCH = 64  # the largest batch one call takes (the loader slices bigger ones)
QUANTIZED = ("static", "dynamic")  # the `quantize` modes of this format


def export(bundle: Bundle, cfg, folder: Path, calibration: Iterable[Any] | None = None,
           log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Capture the model, quantize it with XNNPACK's quantizer when `cfg.quantize` says so,
    lower it to XNNPACK and write `model.pte`; return it and what was done."""
    if bundle.kind == "pt2e":
        raise ExportError("executorch cannot hold a PT2E int8 model quantized for x86 (the "
                          "quantize stage's, run by Inductor); export the float model "
                          "(source: a stage before the quantize stage) with quantize: static "
                          "or dynamic for XNNPACK's own int8, or this model with format aoti")
    quantize = getattr(cfg, "quantize", None)
    if quantize is not None and quantize not in QUANTIZED:
        raise ExportError(f"executorch quantize: {quantize} is not supported; use "
                          "quantize: static or dynamic (XNNPACK int8)")
    lower, quantizer = _executorch()
    max_seq = max_sequence(bundle.model) if bundle.is_text else None
    facts: dict[str, Any] = {"executorch_max_batch": MAX_BATCH}
    if max_seq:
        facts["executorch_max_seq"] = max_seq
    module = graph_module(bundle).eval()
    with eager_attention(attention_owner(bundle.model)), torch.no_grad():
        program = capture(module, export_inputs(bundle), bundle.is_text, max_seq)
    if quantize:
        if quantize == "static" and calibration is None:
            raise ExportError("executorch quantize: static needs the calibration split "
                              "(data.calibration)")
        graph = program.module()
        fed_by_gelu = sum(map(after_gelu, graph.graph.nodes))
        program, samples = quantized(graph, quantizer(quantize),
                                     calibration if quantize == "static" else None,
                                     bundle, max_seq)
        facts["executorch_quantize"] = quantize
        if quantize == "static":
            facts.update(calibration_samples=samples, executorch_dynamic_linears=fed_by_gelu)
        log(f"quantized the linear layers to int8 with XNNPACK's quantizer ({quantize}"
            + (f", {samples} calibration samples, {fed_by_gelu} linears fed by a GELU "
               "with dynamic activation scales)" if quantize == "static" else ")"))
    refuse_random_ops(fx_random_nodes(program.graph), "the executorch graph")
    buffer, delegated, missing = lower(program)
    if missing:
        raise ExportError(f"executorch: XNNPACK does not take {', '.join(missing)} and "
                          "ExecuTorch's runtime has no kernel for it; export with format aoti "
                          "or onnx, or replace that op in the model")
    if not delegated:
        log("XNNPACK took no op of this graph: the program runs on portable kernels only")
    path = folder / FILE
    path.write_bytes(buffer)
    facts["executorch_delegated"] = delegated
    return path, facts


def _executorch() -> tuple[Lower, Callable[[str], Any]]:
    """(lower, quantizer): ExecuTorch's lowering and XNNPACK's quantizer, imported now;
    ExportError naming the extra when ExecuTorch is missing."""
    lower = lowering()
    try:
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e.quantizer import ComposableQuantizer
    except ImportError as exc:
        raise ExportError(f"format executorch needs ExecuTorch ({one_line(exc)}): {EXTRA}"
                          ) from None

    class LinearQuantizer(XNNPACKQuantizer):
        """XNNPACK's quantizer on linear layers only. Its own first pass turns the scalar
        operand of every add and mul into a float tensor (for quantizing those), which
        also made the integer position-id arithmetic of BERT float: skipped, since no add
        or mul is quantized here."""

        def transform_for_annotation(self, model: torch.fx.GraphModule
                                     ) -> torch.fx.GraphModule:
            return model

    def linears(dynamic: bool, which: Callable[[torch.fx.Node], bool]) -> Any:
        """int8 of the linears `which` picks: symmetric weights per channel, activations
        calibrated or (`dynamic`) scaled at each call."""
        config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=dynamic)
        quantizer = LinearQuantizer().set_operator_type(torch.ops.aten.linear.default, config)
        quantizer.set_filter_function(which)
        return quantizer

    def quantizer(mode: str) -> Any:
        """`static`: calibrated linears, those fed by a GELU dynamic; `dynamic`: all."""
        if mode == "dynamic":
            return linears(True, lambda node: True)
        return ComposableQuantizer([linears(False, lambda node: not after_gelu(node)),
                                    linears(True, after_gelu)])

    return lower, quantizer


PASS_THROUGH = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                torch.ops.aten.dropout.default, torch.ops.aten.clone.default}


def after_gelu(node: torch.fx.Node) -> bool:
    """Whether `node` is a linear whose input is a GELU's output (through views)."""
    if node.op != "call_function" or node.target != torch.ops.aten.linear.default:
        return False
    source = node.args[0]
    while isinstance(source, torch.fx.Node) and source.op == "call_function" \
            and source.target in PASS_THROUGH:
        source = source.args[0]
    return isinstance(source, torch.fx.Node) and source.op == "call_function" \
        and source.target == torch.ops.aten.gelu.default


def attention_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside `model` whose attention can be switched (a sentence
    encoder's transformer), else `model` itself."""
    return next((m for m in model.modules() if hasattr(m, "set_attn_implementation")), model)


def dynamic_shapes(text: bool, max_seq: int | None) -> tuple[dict[int, Any], ...]:
    """Batch dynamic up to MAX_BATCH; for text the sequence too, from 2 to `max_seq`."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    if not text:
        return ({0: batch},)
    seq = torch.export.Dim("seq", min=2, max=max_seq)
    return tuple({0: batch, 1: seq} for _ in range(3))


def capture(module: torch.nn.Module, args: tuple[torch.Tensor, ...], text: bool,
            max_seq: int | None) -> torch.export.ExportedProgram:
    """`torch.export` with this format's bounded dynamic dims; CaptureError in one line."""
    try:
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes(text, max_seq))
    except Exception as exc:  # any capture failure: user code, guards, unsupported ops
        raise CaptureError(f"torch.export could not capture the model: {one_line(exc)}"
                           ) from None


def quantized(graph: torch.fx.GraphModule, quantizer: Any, calibration: Iterable[Any] | None,
              bundle: Bundle, max_seq: int | None) -> tuple[torch.export.ExportedProgram, int]:
    """The captured graph quantized with `quantizer` (PT2E: prepare, observe the
    calibration batches, or one example batch when there are none, convert), captured
    again; and how many calibration samples it observed."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    prepared = prepare_pt2e(graph, quantizer)
    samples = 0
    with torch.no_grad():
        if calibration is None:  # dynamic scales: one pass, so that every observer has run
            prepared(*export_inputs(bundle))
        for inputs in calibration or ():
            tensors = positional_inputs(True, (), dict(inputs)) if bundle.is_text \
                else (inputs,)
            for start in range(0, len(tensors[0]), MAX_BATCH):
                prepared(*(t[start:start + MAX_BATCH] for t in tensors))
            samples += len(tensors[0])
    if calibration is not None and not samples:
        raise ExportError("executorch quantize: static got an empty calibration split")
    converted = convert_pt2e(prepared)
    with torch.no_grad():
        return capture(converted, export_inputs(bundle), bundle.is_text, max_seq), samples
