"""The attention dropout of a captured graph, switched with the graph's train/eval mode.

A train-mode capture of Hugging Face attention passes its dropout as SDPA's `dropout_p`
argument, not as a dropout op, and torchao's `move_exported_model_to_eval` rewrites only
aten.dropout and batch norm; a prepared QAT graph needs this switch beside it."""

from __future__ import annotations

import torch

from export.random_ops import op_arguments

TRAIN_DROPOUT = "compress_train_dropout_p"  # node.meta: an attention node's captured dropout_p


def switch_attention_dropout(graph: torch.fx.GraphModule, train: bool) -> None:
    """Set the `dropout_p` argument of every attention node (SDPA and its kernels) to its
    captured value in train mode and to 0.0 in eval mode (left on, it stayed through
    `convert_pt2e`, every evaluation and every export)."""
    for node in graph.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        names = [arg.name for arg in node.target._schema.arguments]
        if "dropout_p" not in names:
            continue
        captured = node.meta.setdefault(
            TRAIN_DROPOUT, op_arguments(node.target, node.args, node.kwargs)["dropout_p"])
        index = names.index("dropout_p")
        if index < len(node.args):
            node.update_arg(index, captured if train else 0.0)
        else:
            node.update_kwarg("dropout_p", captured if train else 0.0)
    graph.recompile()
