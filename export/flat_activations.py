"""Int8 linears whose GELU Inductor can fuse. Inductor folds `linear -> gelu -> quantize`
into one oneDNN int8 GEMM with GELU and the output quantization as its epilogue, but only
where the linear's input is 2-D or of fixed shape: an encoder's (batch, length, features)
input with dynamic batch and length leaves a view between the GEMM and the GELU, the
pattern misses, and a loop of its own computes GELU and quantizes (0.9 ms a layer at
8 x 128 on one Zen 5 core: a quarter of the layer's non-GEMM time).

This pass runs such a chain on (tokens, features): it views the int8 input as 2-D before
its dequantize, and the quantized output back to 3-D after. Quantize, dequantize and GELU
are elementwise, so the values are the same. A SmoothQuant multiply between GELU and the
quantize (compress/algorithms/smoothing.py) comes along: GELU then still fuses into the GEMM
(float out) and the multiply and quantize run in one loop after it."""

from __future__ import annotations

import torch

from export.graph_edits import add_node, is_channel_scale, is_per_tensor

aten = torch.ops.aten
_ACTIVATIONS = (aten.gelu.default,)


def _chain(activation: torch.fx.Node) -> tuple[torch.fx.Node | None, ...] | None:
    """(quantized input, its dequantize, the linear, a per-feature multiply or None, the
    output quantize) of a 3-D `dq -> linear -> activation [-> mul] -> q` chain ending at
    `activation`, else None."""
    linear = activation.args[0]
    if not (isinstance(linear, torch.fx.Node) and linear.target == aten.linear.default
            and len(linear.users) == 1 and len(activation.users) == 1):
        return None
    dequantize, after = linear.args[0], next(iter(activation.users))
    scale = after if is_channel_scale(after) and after.args[0] is activation else None
    quantize = next(iter(scale.users)) if scale is not None else after
    if not (is_per_tensor(dequantize, "dequantize") and is_per_tensor(quantize, "quantize")):
        return None
    source = dequantize.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if value is None or value.dim() != 3:
        return None
    return source, dequantize, linear, scale, quantize


def flatten_activation_linears(program: torch.export.ExportedProgram) -> int:
    """Rewrite each 3-D `dq -> linear -> gelu [-> mul] -> q` chain of `program` to run on 2-D
    in place; return how many were rewritten."""
    graph = program.graph_module.graph
    done = 0
    for activation in [n for n in graph.nodes if n.target in _ACTIVATIONS]:
        chain = _chain(activation)
        if chain is None:
            continue
        source, dequantize, linear, scale, quantize = chain
        batch, length, features = source.meta["val"].shape
        with graph.inserting_before(linear):
            flat = add_node(graph, aten.view.default, (source, [-1, features]))
            flat_dq = add_node(graph, dequantize.target, (flat, *dequantize.args[1:]),
                               dequantize, dequantize.kwargs)
            flat_linear = add_node(graph, linear.target, (flat_dq, *linear.args[1:]), linear)
            flat_act = add_node(graph, activation.target, (flat_linear, *activation.args[1:]),
                                activation, activation.kwargs)
            if scale is not None:
                flat_act = add_node(graph, scale.target, (flat_act, scale.args[1]), scale)
            flat_q = add_node(graph, quantize.target, (flat_act, *quantize.args[1:]), quantize,
                              quantize.kwargs)
            outputs = flat_q.meta["val"].shape[-1]
            sizes = [add_node(graph, aten.sym_size.int, (source, d)) if not isinstance(s, int)
                     else s for d, s in enumerate((batch, length))]
            back = add_node(graph, aten.view.default, (flat_q, [*sizes, outputs]))
        quantize.replace_all_uses_with(back)
        for node in (quantize, scale, activation, linear):
            if node is not None:
                graph.erase_node(node)
        if not dequantize.users:
            graph.erase_node(dequantize)
        done += 1
    if done:
        graph.lint()
        program.graph_module.recompile()
    return done
