"""The key-padding mask, read straight from the `attention_mask` input. An encoder's captured
graph builds its attention mask as a (batch, 1, length, length) bool tensor, once per layer
(transformers' mask functions: arange, index, bitwise_and, expand): Inductor writes it out
three times for three layers, in a loop of its own on one thread, ~1.3 ms of an 11.5 ms
forward at 8 x 128 on a Zen 5. Where that mask is only the padding of the input (row q of
sequence b keeps key k where `attention_mask[b, k]`), a (batch, 1, 1, length) view of the
input is the same mask, broadcast; compress's attention kernel reads it as such.

Whether a mask is that is checked, not assumed: the nodes that compute it are run on sample
inputs with padding and compared with the view, bit for bit."""

from __future__ import annotations

import torch

INPUT = "attention_mask"
# sample (batch, length) paddings the mask is checked on: full, ragged, one token
_SAMPLE_LENGTHS = ([7, 7, 7], [7, 4, 1], [3, 5, 2])


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, todo = {node}, [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _mask_function(graph_module: torch.fx.GraphModule, mask: torch.fx.Node
                   ) -> tuple[torch.fx.GraphModule, list[str]]:
    """The nodes that compute `mask` as a module of their own, and the names of the graph
    inputs it takes."""
    needed = _ancestors(mask)
    graph, copied = torch.fx.Graph(), {}
    for node in graph_module.graph.nodes:
        if node in needed:
            copied[node] = graph.node_copy(node, lambda n: copied[n])
    graph.output(copied[mask])
    inputs = [n.name for n in graph.nodes if n.op == "placeholder"]
    return torch.fx.GraphModule(graph_module, graph), inputs


def is_key_padding(graph_module: torch.fx.GraphModule, mask: torch.fx.Node,
                   user_inputs: list[str]) -> bool:
    """Whether `mask` (a bool tensor broadcastable to (batch, heads, length, length)) keeps
    exactly the keys that `attention_mask` keeps, for every query row, on sample inputs."""
    function, inputs = _mask_function(graph_module, mask)
    if INPUT not in inputs or not set(inputs) <= set(user_inputs):
        return False
    for lengths in _SAMPLE_LENGTHS:
        width = max(lengths)
        padding = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        samples = {name: torch.zeros_like(padding) for name in inputs}
        samples[INPUT] = padding
        try:
            got = function(*(samples[name] for name in inputs))
        except Exception:  # noqa: BLE001 - a mask we cannot evaluate is kept as it is
            return False
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.dim() != 4:
            return False
        want = padding.bool()[:, None, None, :]
        shape = torch.broadcast_shapes(got.shape, (len(lengths), 1, width, width))
        if not torch.equal(got.expand(shape), want.expand(shape)):
            return False
    return True


def padding_view(graph: torch.fx.Graph, user_input: torch.fx.Node) -> torch.fx.Node:
    """Nodes after `user_input` that make `attention_mask != 0` as (batch, 1, 1, length)."""
    aten = torch.ops.aten
    with graph.inserting_after(user_input):
        keep = graph.call_function(aten.ne.Scalar, (user_input, 0))
    with graph.inserting_after(keep):
        rows = graph.call_function(aten.unsqueeze.default, (keep, 1))
    with graph.inserting_after(rows):
        view = graph.call_function(aten.unsqueeze.default, (rows, 1))
    keep.meta["val"] = user_input.meta["val"] != 0
    rows.meta["val"] = keep.meta["val"].unsqueeze(1)
    view.meta["val"] = rows.meta["val"].unsqueeze(1)
    return view
