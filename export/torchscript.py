"""TorchScript: `torch.jit.trace` of the logits graph, loaded back with `torch.jit.load`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from export.errors import ExportError
from export.graphs import Bundle, graph_module, traced_inputs
from export.random_ops import refuse_random_ops, script_random_nodes

FILE = "model.ts"


def export(bundle: Bundle, cfg, folder: Path, calibration=None,
           log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Trace the model (HF models through a logits-only wrapper) and save `model.ts`."""
    if bundle.kind == "pt2e":
        raise ExportError("torchscript cannot hold a PT2E int8 model; export it with format "
                          "aoti, or export the float model (source: an earlier stage)")
    module = graph_module(bundle).eval()
    with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer and deprecation chatter; parity decides
        traced = torch.jit.trace(module, traced_inputs(bundle), strict=False,
                                 check_trace=False)
    refuse_random_ops(script_random_nodes(traced.inlined_graph), "the torchscript graph")
    path = folder / FILE
    torch.jit.save(traced, str(path))
    return path, {}
