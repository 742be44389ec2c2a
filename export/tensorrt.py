"""TensorRT through torch-tensorrt (dynamo frontend): fp32, fp16 or int8 with a min / opt /
max shape profile, saved as an ExportedProgram. Needs a CUDA GPU and the `tensorrt` extra;
torch-tensorrt is imported here only, when the stage runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from export.errors import ExportError
from export.graphs import Bundle, export_inputs, graph_module
from export.random_ops import fx_random_nodes, refuse_random_ops

FILE = "model.trt.ep"
NO_GPU = "TensorRT export needs a CUDA GPU (none found)"


def export(bundle: Bundle, cfg, folder: Path, calibration=None,
           log: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """Compile with torch-tensorrt for the recipe's shape profile and save the program."""
    if not torch.cuda.is_available():
        raise ExportError(NO_GPU)
    try:
        import torch_tensorrt
    except ImportError:
        raise ExportError("torch-tensorrt is not installed: pip install -e '.[tensorrt]'"
                          ) from None
    if cfg.precision == "int8":
        raise ExportError("TensorRT int8 needs a model quantized with NVIDIA ModelOpt, which "
                          "compress does not do yet; use precision fp16")
    module = graph_module(bundle).eval().cuda()
    shapes = cfg.shapes
    if bundle.is_text:
        inputs = [torch_tensorrt.Input(min_shape=shapes.min, opt_shape=shapes.opt,
                                       max_shape=shapes.max, dtype=torch.int64)
                  for _ in range(3)]
    else:
        inputs = [torch_tensorrt.Input(
            min_shape=[shapes.min[0], *bundle.input_shape],
            opt_shape=[shapes.opt[0], *bundle.input_shape],
            max_shape=[shapes.max[0], *bundle.input_shape], dtype=torch.float32)]
    precision = {"fp32": torch.float32, "fp16": torch.float16}[cfg.precision]
    compiled = torch_tensorrt.compile(module, ir="dynamo", inputs=inputs,
                                      enabled_precisions={precision})
    if isinstance(compiled, torch.fx.GraphModule):  # the ops TensorRT left to torch
        refuse_random_ops(fx_random_nodes(compiled.graph), "the tensorrt graph")
    path = folder / FILE
    example = [t.cuda() for t in export_inputs(bundle)]
    torch_tensorrt.save(compiled, str(path), output_format="exported_program", inputs=example)
    return path, {"trt_precision": cfg.precision}
