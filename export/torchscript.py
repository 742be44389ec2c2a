"""TorchScript: `torch.jit.trace` of the logits graph, loaded back with `torch.jit.load`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from compress.errors import ExportError
from compress.graphs import graph_module, traced_inputs
from compress.models import ModelBundle
from export.random_ops import refuse_random_ops, script_random_nodes

FILE = "model.ts"


def export(bundle: ModelBundle, cfg, folder: Path, calibration=None, max_length: int = 128,
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


def load(path: Path, meta: dict[str, Any], threads: int) -> Callable[..., Any]:
    """The saved module, in eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location="cpu").eval()
