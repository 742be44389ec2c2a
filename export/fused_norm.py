"""An int8 encoder's `add -> layer_norm -> quantize` on compress's kernel. In a PT2E graph each
post-LayerNorm block ends in the residual add, the norm, and the uint8 quantization of the
next int8 linear's input; Inductor lowers that into three loops over the rows with a serial
division between them (~0.1 ms a norm at 8 x 128 on two Zen 5 cores). This pass swaps each
such norm for `compress_encoder.add_layer_norm` (serve/encoder_norm.cpp), which returns the
float answer (the next residual) and its quantized copy from one pass over each row. The
first norm, whose input is a sum of embedding lookups (word, position, token type), goes to
`compress_encoder.embed_layer_norm`, which gathers the rows itself, prefetching ahead.

A norm is swapped only where a per-tensor uint8 quantization reads it, directly or through
SmoothQuant's per-feature multiply (the kernel applies it to the quantized copy only); its
add is folded in where it adds two tensors of the norm's shape. Eval-mode dropout (the
identity) is dropped first, so a quantization behind it is seen."""

from __future__ import annotations

import operator

import torch

from export.graph_edits import add_node, uint8_quantizes
from serve import encoder_attention

aten = torch.ops.aten


def _value(node: object) -> torch.Tensor | None:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _residual_pair(node: torch.fx.Node, shape: torch.Size) -> tuple[torch.fx.Node, ...] | None:
    """(x, residual) where `node` is an add of two float32 tensors of `shape` that only the
    norm reads, else None."""
    if node.target != aten.add.Tensor or node.kwargs or len(node.users) != 1:
        return None
    values = [_value(a) for a in node.args]
    if any(v is None or v.dtype != torch.float32 or v.shape != shape for v in values):
        return None
    return tuple(node.args)


def _embedding_sum(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The `aten.embedding` lookups of float32 rows whose sum `node` is (one lookup, or an add
    tree of them, each read only by the tree), else None."""
    if len(node.users) != 1 or node.kwargs:
        return None
    if node.target == aten.embedding.default:
        table = _value(node.args[0])
        return [node] if table is not None and table.dtype == torch.float32 else None
    if node.target != aten.add.Tensor or not all(isinstance(a, torch.fx.Node) for a in node.args):
        return None
    parts = [_embedding_sum(a) for a in node.args]
    return None if None in parts else parts[0] + parts[1]


def _add_tree(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the adds under it, parents first."""
    if node.target != aten.add.Tensor:
        return []
    return [node] + [n for a in node.args for n in _add_tree(a)]


def drop_eval_dropout(graph: torch.fx.Graph) -> int:
    """Remove `dropout(x, p, train=False)` nodes (the identity); return how many."""
    dropped = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten.dropout.default \
                and len(node.args) > 2 and node.args[2] is False:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped += 1
    return dropped


def fuse_norms(program: torch.export.ExportedProgram) -> int:
    """Swap each `[add ->] layer_norm -> uint8 quantize` of `program` for the kernel in place,
    a norm of summed embedding lookups for the embedding kernel; return how many norms were
    swapped (0 where the kernel cannot be built here)."""
    if not encoder_attention.load():
        return 0
    kernel = torch.ops.compress_encoder.add_layer_norm.default
    embed_kernel = torch.ops.compress_encoder.embed_layer_norm.default
    graph = program.graph_module.graph
    drop_eval_dropout(graph)
    fused = 0
    for norm in [n for n in graph.nodes if n.target == aten.layer_norm.default]:
        source, shape, weight, bias = (list(norm.args) + [None] * 4)[:4]
        eps = norm.args[4] if len(norm.args) > 4 else norm.kwargs.get("eps", 1e-5)
        value = _value(source)
        same, smooth = uint8_quantizes(norm)
        if (weight is None or bias is None or value is None or value.dtype != torch.float32
                or len(shape) != 1 or not same):
            continue
        scale, zero_point, low, high = same[0].args[1:5]
        quantization = (float(eps), smooth.args[1] if smooth else None, float(scale),
                        int(zero_point), int(low), int(high))
        lookups = _embedding_sum(source)
        pair = None if lookups else _residual_pair(source, value.shape)
        x, residual = pair if pair else (source, None)
        with graph.inserting_before(norm):
            if lookups:
                call = add_node(graph, embed_kernel, (
                    [e.args[0] for e in lookups], [e.args[1] for e in lookups], weight, bias,
                    *quantization), like=norm)
            else:
                call = add_node(graph, kernel, (x, residual, weight, bias, *quantization),
                                like=norm)
            answer = graph.call_function(operator.getitem, (call, 0))
            quantized = graph.call_function(operator.getitem, (call, 1))
        answer.meta["val"], quantized.meta["val"] = call.meta["val"]
        for quantize in same:
            quantize.replace_all_uses_with(quantized)
            graph.erase_node(quantize)
        if smooth is not None:
            graph.erase_node(smooth)
        norm.replace_all_uses_with(answer)
        graph.erase_node(norm)
        erased = _add_tree(source) + lookups if lookups else [source] if pair else []
        for node in erased:  # parents first
            graph.erase_node(node)
        fused += 1
    graph.lint()
    program.graph_module.recompile()
    return fused
