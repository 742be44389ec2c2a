"""Small pieces the graph passes share: reading a quantization node, and adding a node with
its fake value and the source metadata Inductor's kernel names and profiles come from."""

from __future__ import annotations

import torch

SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def is_per_tensor(node: object, op: str) -> bool:
    """Whether `node` calls `<op>_per_tensor` (op: "quantize" or "dequantize")."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and getattr(node.target, "__name__", "").startswith(f"{op}_per_tensor")


def add_node(graph: torch.fx.Graph, target, args: tuple, like: torch.fx.Node | None = None,
             kwargs: dict | None = None) -> torch.fx.Node:
    """A `call_function` node of `target` at the graph's insertion point, its "val" computed
    from its arguments' and its source metadata copied from `like`."""
    node = graph.call_function(target, args, kwargs or {})
    values = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
    node.meta["val"] = target(*values, **(kwargs or {}))
    if like is not None:
        for key in SOURCE_META:
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node
