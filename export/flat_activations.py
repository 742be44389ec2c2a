"""Int8 linears whose GELU Inductor can fuse. Inductor folds `linear -> gelu -> quantize`
into one oneDNN int8 GEMM with GELU and the output quantization as its epilogue, but only
where the linear's input is 2-D or of fixed shape: an encoder's (batch, length, features)
input with dynamic batch and length leaves a view between the GEMM and the GELU, the
pattern misses, and a loop of its own computes GELU and quantizes (0.9 ms a layer at
8 x 128 on one Zen 5 core: a quarter of the layer's non-GEMM time).

This pass runs such a chain on (tokens, features): it views the int8 input as 2-D before
its dequantize, and the quantized output back to 3-D after. Quantize, dequantize and GELU
are elementwise, so the values are the same."""

from __future__ import annotations

import torch

aten = torch.ops.aten
_ACTIVATIONS = (aten.gelu.default,)


def _per_tensor(node: object, op: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and getattr(node.target, "__name__", "").startswith(f"{op}_per_tensor")


def _chain(activation: torch.fx.Node) -> tuple[torch.fx.Node, ...] | None:
    """(quantized input, its dequantize, the linear, the output quantize) of a 3-D
    `dq -> linear -> activation -> q` chain ending at `activation`, else None."""
    linear = activation.args[0]
    if not (isinstance(linear, torch.fx.Node) and linear.target == aten.linear.default
            and len(linear.users) == 1 and len(activation.users) == 1):
        return None
    dequantize, quantize = linear.args[0], next(iter(activation.users))
    if not (_per_tensor(dequantize, "dequantize") and _per_tensor(quantize, "quantize")):
        return None
    source = dequantize.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if value is None or value.dim() != 3:
        return None
    return source, dequantize, linear, quantize


def _node(graph: torch.fx.Graph, target, args: tuple, like: torch.fx.Node | None = None,
          kwargs: dict | None = None) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    values = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
    node.meta["val"] = target(*values, **(kwargs or {}))
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def flatten_activation_linears(program: torch.export.ExportedProgram) -> int:
    """Rewrite each 3-D `dq -> linear -> gelu -> q` chain of `program` to run on 2-D in
    place; return how many were rewritten."""
    graph = program.graph_module.graph
    done = 0
    for activation in [n for n in graph.nodes if n.target in _ACTIVATIONS]:
        chain = _chain(activation)
        if chain is None:
            continue
        source, dequantize, linear, quantize = chain
        batch, length, features = source.meta["val"].shape
        with graph.inserting_before(linear):
            flat = _node(graph, aten.view.default, (source, [-1, features]))
            flat_dq = _node(graph, dequantize.target, (flat, *dequantize.args[1:]),
                            dequantize, dequantize.kwargs)
            flat_linear = _node(graph, linear.target, (flat_dq, *linear.args[1:]), linear)
            flat_act = _node(graph, activation.target, (flat_linear, *activation.args[1:]),
                             activation, activation.kwargs)
            flat_q = _node(graph, quantize.target, (flat_act, *quantize.args[1:]), quantize,
                           quantize.kwargs)
            outputs = flat_q.meta["val"].shape[-1]
            sizes = [_node(graph, aten.sym_size.int, (source, d)) if not isinstance(s, int)
                     else s for d, s in enumerate((batch, length))]
            back = _node(graph, aten.view.default, (flat_q, [*sizes, outputs]))
        quantize.replace_all_uses_with(back)
        for node in (quantize, activation, linear):
            graph.erase_node(node)
        if not dequantize.users:
            graph.erase_node(dequantize)
        done += 1
    if done:
        graph.lint()
        program.graph_module.recompile()
    return done
