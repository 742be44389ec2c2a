"""An int8 encoder's `gelu -> SmoothQuant multiply -> quantize` on compress's kernel. With
SmoothQuant's per-feature multiply between an int8 linear's GELU and the uint8 quantization
of the next linear's input (compress/algorithms/smoothing.py), Inductor cannot fold that
quantization into the oneDNN GEMM: the GEMM computes GELU in its epilogue (~0.14 ms at
8 x 128 x 1536 on two Zen 5 cores, the erf of every output) and writes floats that a loop of
its own then multiplies and quantizes (~0.09 ms). This pass leaves the GEMM its plain float
answer and swaps the three nodes for `compress_encoder.gelu_quantize`
(serve/encoder_activation.cpp), which computes GELU, multiplies and quantizes each element in
one pass (~0.13 ms). A GELU with no multiply behind it is left alone: Inductor fuses it and
its quantization into the GEMM (export/flat_activations.py)."""

from __future__ import annotations

import torch

from export.graph_edits import add_node, is_channel_scale, is_uint8_quantize
from serve import encoder_attention

aten = torch.ops.aten


def _smoothed_chain(gelu: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(the per-feature multiply, the uint8 quantize) behind an exact float32 GELU, else None."""
    value = getattr(gelu.args[0], "meta", {}).get("val")
    approximate = gelu.kwargs.get("approximate", gelu.args[1] if len(gelu.args) > 1 else "none")
    if value is None or value.dtype != torch.float32 or approximate != "none" \
            or len(gelu.users) != 1:
        return None
    scale = next(iter(gelu.users))
    if not (is_channel_scale(scale) and scale.args[0] is gelu
            and isinstance(scale.args[1], torch.fx.Node)):
        return None
    quantize = next(iter(scale.users))
    return (scale, quantize) if is_uint8_quantize(quantize) else None


def fuse_gelus(program: torch.export.ExportedProgram) -> int:
    """Swap each `gelu -> per-feature multiply -> uint8 quantize` of `program` for the kernel
    in place; return how many (0 where the kernel cannot be built here)."""
    if not encoder_attention.load():
        return 0
    kernel = torch.ops.compress_encoder.gelu_quantize.default
    graph = program.graph_module.graph
    fused = 0
    for gelu in [n for n in graph.nodes if n.target == aten.gelu.default]:
        chain = _smoothed_chain(gelu)
        if chain is None:
            continue
        scale, quantize = chain
        quant_scale, zero_point, low, high = quantize.args[1:5]
        with graph.inserting_before(gelu):
            call = add_node(graph, kernel, (gelu.args[0], scale.args[1], float(quant_scale),
                                            int(zero_point), int(low), int(high)), gelu)
        quantize.replace_all_uses_with(call)
        for node in (quantize, scale, gelu):
            graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
        program.graph_module.recompile()
    return fused
