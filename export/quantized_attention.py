"""The attention kernel writes the next int8 linear's input. In an int8 encoder each attention
answer is reshaped to (tokens, heads x head_dim), multiplied by SmoothQuant's per-feature
scale where there is one, and quantized to uint8 for the output projection: Inductor does that
in a loop of its own over the float answer the kernel wrote (1.5 MB at 8 x 128 for MiniLM).
This pass has the kernel quantize each block of answers while it is in L1
(`compress_encoder.attention_quantized` / `packed_attention_quantized`,
serve/encoder_attention.cpp): the float answer is never written. The reshapes between are
replayed on the uint8 answer."""

from __future__ import annotations

import torch

from export.graph_edits import add_node, uint8_quantizes
from serve import encoder_attention

aten = torch.ops.aten
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int)


def _views_after(call: torch.fx.Node) -> list[torch.fx.Node]:
    """The reshapes and transposes read one after another from `call` (each the only user)."""
    chain, end = [], call
    while len(end.users) == 1 and next(iter(end.users)).target in VIEWS:
        end = next(iter(end.users))
        chain.append(end)
    return chain


def _row_major_features(end: torch.fx.Node, call: torch.fx.Node) -> bool:
    """Whether `end` lays the kernel's (..., heads, head_dim) answer out row-major with
    heads x head_dim features last: what the quantization's per-feature scale indexes."""
    answer, value = call.meta.get("val"), end.meta.get("val")
    if answer is None or value is None:
        return False
    try:
        features = answer.shape[-2] * answer.shape[-1]
        return bool(value.is_contiguous()) and value.shape[-1] == features
    except RuntimeError:  # a layout that depends on the data
        return False


def quantize_attention_answers(program: torch.export.ExportedProgram) -> int:
    """Swap each attention kernel call whose answer is only quantized to uint8 (through
    reshapes, and SmoothQuant's multiply) for its quantizing twin, in place; return how many."""
    if not encoder_attention.load():
        return 0
    ops = getattr(torch.ops, encoder_attention.NAMESPACE)
    twins = {ops.attention.default: ops.attention_quantized.default,
             ops.packed_attention.default: ops.packed_attention_quantized.default}
    graph = program.graph_module.graph
    swapped = 0
    for call in [n for n in graph.nodes if n.op == "call_function" and n.target in twins]:
        chain = _views_after(call)
        end = chain[-1] if chain else call
        same, smooth = uint8_quantizes(end)
        only_quantized = len(end.users) == (1 if smooth is not None else len(same))
        if not same or not only_quantized or not _row_major_features(end, call):
            continue
        scale, zero_point, low, high = same[0].args[1:5]
        with graph.inserting_before(call):
            answer = add_node(graph, twins[call.target], (
                *call.args, smooth.args[1] if smooth else None, float(scale), int(zero_point),
                int(low), int(high)), like=call)
            for view in chain:  # the same reshapes, on uint8
                answer = add_node(graph, view.target, (answer, *view.args[1:]), like=view,
                                  kwargs=dict(view.kwargs))
        for quantize in same:
            quantize.replace_all_uses_with(answer)
            graph.erase_node(quantize)
        if smooth is not None:
            graph.erase_node(smooth)
        for node in [*reversed(chain), call]:
            graph.erase_node(node)
        swapped += 1
    graph.lint()
    program.graph_module.recompile()
    return swapped
