"""Small pieces the graph passes share: reading a quantization or SmoothQuant node, adding a
node with its fake value and the source metadata Inductor's kernel names and profiles come
from, and merging repeated elementwise nodes."""

from __future__ import annotations

import torch

SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")
aten = torch.ops.aten


def is_per_tensor(node: object, op: str) -> bool:
    """Whether `node` calls `<op>_per_tensor` (op: "quantize" or "dequantize")."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" \
        and getattr(node.target, "__name__", "").startswith(f"{op}_per_tensor")


def is_uint8_quantize(node: torch.fx.Node) -> bool:
    """Whether `node` quantizes per tensor to uint8 with constant scale and zero point (the
    input of an int8 linear)."""
    return is_per_tensor(node, "quantize") and not isinstance(node.args[1], torch.fx.Node) \
        and node.args[-1] == torch.uint8


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


def is_channel_scale(node: torch.fx.Node) -> bool:
    """Whether `node` multiplies (one user) by a constant of one value or one per feature
    (SmoothQuant's division of the next Linear's input, compress/algorithms/smoothing.py)."""
    if node.op != "call_function" or node.target != aten.mul.Tensor or len(node.users) != 1:
        return False
    scale = node.args[1]
    value = scale.meta.get("val") if isinstance(scale, torch.fx.Node) else None
    return isinstance(scale, (int, float)) or (
        isinstance(scale, torch.fx.Node) and scale.op in ("placeholder", "get_attr")
        and value is not None and value.dim() <= 1)


def uint8_quantizes(node: torch.fx.Node) -> tuple[list[torch.fx.Node], torch.fx.Node | None]:
    """The uint8 quantizes of `node` with the first one's parameters (all reading it directly,
    or the one behind SmoothQuant's per-feature multiply), and that multiply (or None)."""
    direct = [u for u in node.users if is_uint8_quantize(u)]
    if direct:
        return [q for q in direct if q.args[1:] == direct[0].args[1:]], None
    for user in node.users:
        if is_channel_scale(user) and user.args[0] is node and not isinstance(
                user.args[1], (int, float)):
            after = next(iter(user.users))
            if is_uint8_quantize(after):
                return [after], user
    return [], None


def _key(value: object) -> object:
    return tuple(_key(v) for v in value) if isinstance(value, (list, tuple)) else value


def merge_repeats(graph: torch.fx.Graph) -> int:
    """Merge multiplies and quantizes that repeat another's arguments (three SmoothedLinears
    reading one tensor each multiply it by the same scale, and PT2E gives each product its
    own quantize); return how many nodes went. Dequantizes stay one a user, as PT2E leaves
    them for Inductor's int8 patterns."""
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not (
                node.target == aten.mul.Tensor or is_per_tensor(node, "quantize")):
            continue
        key = (node.target, _key(node.args), _key(sorted(node.kwargs.items())))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
            merged += 1
        else:
            seen[key] = node
    return merged
