"""The train/eval switch of a prepared (QAT) graph: torchao's `move_exported_model_to_train`
and `move_exported_model_to_eval`, with the aten patterns they rewrite exported once a
process instead of at every switch.

torchao exports four dropout patterns and two batch-norm ones (a strict torch.export each,
about 0.1 s) every time a graph changes mode, and a QAT run changes it around every
evaluation; the patterns do not depend on the graph (only batch norm's on the device), so
one copy of each serves every switch."""

from __future__ import annotations

import copy
import functools

import torch
from torch.fx.subgraph_rewriter import replace_pattern_with_filters
from torch.nn import functional as F
from torchao.quantization.pt2e.export_utils import _EXPORTED_TRAINING_ATTR, WrapperModule
from torchao.quantization.pt2e.utils import _get_aten_graph_module_for_pattern
from torchao.utils import _assert_and_get_unique_device


def move_to_train(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph`'s dropout and batch norm switched to their train-mode ops (a no-op where it
    is in train mode already), as torchao's `move_exported_model_to_train`."""
    if not getattr(graph, _EXPORTED_TRAINING_ATTR, False):
        setattr(graph, _EXPORTED_TRAINING_ATTR, True)
        _switch(graph, train=True)
    return graph


def move_to_eval(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`graph`'s dropout and batch norm switched to their eval-mode ops (a no-op where it is
    in eval mode already), as torchao's `move_exported_model_to_eval`."""
    if getattr(graph, _EXPORTED_TRAINING_ATTR, True):
        setattr(graph, _EXPORTED_TRAINING_ATTR, False)
        _switch(graph, train=False)
    return graph


def _switch(graph: torch.fx.GraphModule, train: bool) -> None:
    """Rewrite the other mode's dropout (both in-place kinds) and batch-norm patterns into
    this mode's, in torchao's order."""
    device = _assert_and_get_unique_device(graph)
    on_cuda = device is not None and device.type == "cuda"
    pairs = [(_dropout_pattern(not train, inplace), _dropout_pattern(train, inplace))
             for inplace in (False, True)]
    pairs.append((_batch_norm_pattern(not train, on_cuda), _batch_norm_pattern(train, on_cuda)))
    for match, replacement in pairs:
        graph.graph.eliminate_dead_code()  # a match must be self-contained
        graph.recompile()
        # copies: the rewriter must not share nodes or attributes between graphs
        replace_pattern_with_filters(graph, copy.deepcopy(match), copy.deepcopy(replacement),
                                     match_filters=[], ignore_literals=True)
        graph.recompile()


@functools.cache
def _dropout_pattern(training: bool, inplace: bool) -> torch.fx.GraphModule:
    """The aten graph of F.dropout in one mode (its p is a literal the match ignores)."""

    def dropout(x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, p=0.5, training=training, inplace=inplace)

    return _get_aten_graph_module_for_pattern(WrapperModule(dropout), (torch.randn(1),))


@functools.cache
def _batch_norm_pattern(training: bool, on_cuda: bool) -> torch.fx.GraphModule:
    """The aten graph of F.batch_norm in one mode, on the CPU or CUDA."""

    def batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   running_mean: torch.Tensor, running_var: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, running_mean, running_var, weight, bias, training=training)

    inputs = (torch.randn(1, 1, 3, 3), torch.randn(1), torch.randn(1), torch.randn(1),
              torch.randn(1))
    return _get_aten_graph_module_for_pattern(WrapperModule(batch_norm), inputs, on_cuda)
