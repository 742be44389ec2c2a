"""Encoder attention on compress's own kernel: a pass over a captured graph that swaps each
bidirectional `scaled_dot_product_attention` for `compress_encoder.attention`
(serve/encoder_attention.cpp: bfloat16 products on AVX512-BF16, float32 elsewhere), which
the AOTInductor package then calls. The serving process registers the operator before it
loads the package (serve/runtimes.py, from export.json's `aoti_operators`)."""

from __future__ import annotations

import torch

from export.errors import CaptureError
from export.padding_mask import INPUT, is_key_padding, padding_view
from serve import encoder_attention

OPERATOR = encoder_attention.NAMESPACE
SDPA = (torch.ops.aten.scaled_dot_product_attention.default,)
HEAD_DIMS = (16, 32, 64)  # the kernel's bfloat16 blocks


def _swappable(node: torch.fx.Node) -> bool:
    """Bidirectional float32 attention without dropout or grouped heads, of a head the
    kernel blocks."""
    if node.op != "call_function" or node.target not in SDPA:
        return False
    query, key = (arg.meta.get("val") for arg in node.args[:2])
    args = dict(zip(("attn_mask", "dropout_p", "is_causal"), node.args[3:], strict=False))
    args.update(node.kwargs)
    return (query is not None and key is not None and query.dim() == 4
            and query.dtype == torch.float32 and query.shape[1] == key.shape[1]
            and isinstance(query.shape[-1], int) and query.shape[-1] in HEAD_DIMS
            and not args.get("dropout_p") and not args.get("is_causal")
            and not args.get("enable_gqa"))


def use_attention_kernel(program: torch.export.ExportedProgram) -> int:
    """Swap the program's encoder attention for the kernel in place; return how many calls
    were swapped (other attention, of other heads or causal, keeps aten's). Raises
    CaptureError where the kernel cannot be built here or nothing was swapped."""
    if not encoder_attention.load():
        raise CaptureError(f"attention: kernel needs compress's attention kernel, which could "
                           f"not be built here ({encoder_attention.error()}); use attention: "
                           f"sdpa")
    kernel = getattr(torch.ops, OPERATOR).attention.default
    graph = program.graph_module.graph
    swapped = 0
    for node in list(graph.nodes):
        if not _swappable(node):
            continue
        query, key, value = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        scale = node.kwargs.get("scale") or query.meta["val"].shape[-1] ** -0.5
        with graph.inserting_before(node):
            out = graph.call_function(kernel, (query, key, value, mask, float(scale)))
            heads_first = graph.call_function(torch.ops.aten.transpose.int, (out, 1, 2))
        out.meta["val"] = kernel(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a
                                   for a in out.args))
        heads_first.meta["val"] = out.meta["val"].transpose(1, 2)
        node.replace_all_uses_with(heads_first)
        graph.erase_node(node)
        swapped += 1
    if not swapped:
        raise CaptureError("attention: kernel found no bidirectional float32 attention "
                           f"(scaled_dot_product_attention, heads of {HEAD_DIMS}) in the "
                           "graph to run on it; use attention: sdpa for this model")
    _read_padding_from_input(program)
    graph.lint()
    program.graph_module.recompile()
    return swapped


def _read_padding_from_input(program: torch.export.ExportedProgram) -> int:
    """Give the kernel calls whose mask is only the input's padding a (batch, 1, 1, length)
    view of `attention_mask` instead (export/padding_mask.py); the nodes that built the
    full mask go. Returns how many calls changed."""
    graph = program.graph_module.graph
    user_inputs = list(program.graph_signature.user_inputs)
    source = next((n for n in graph.nodes if n.op == "placeholder" and n.name == INPUT), None)
    kernel = getattr(torch.ops, OPERATOR).attention.default
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target == kernel
             and isinstance(n.args[3], torch.fx.Node)]
    if source is None or not calls:
        return 0
    verdicts: dict[torch.fx.Node, bool] = {}
    view, changed = None, 0
    for call in calls:
        mask = call.args[3]
        if mask not in verdicts:
            verdicts[mask] = is_key_padding(program.graph_module, mask, user_inputs)
        if verdicts[mask]:
            view = view or padding_view(graph, source)
            call.update_arg(3, view)
            changed += 1
    if changed:
        graph.eliminate_dead_code()
    return changed
