"""ExecuTorch's lowering, shared by every model this format writes: an exported program
handed to `to_edge_transform_and_lower` with the XNNPACK partitioner (the ops XNNPACK does
not take stay on ExecuTorch's portable kernels), memory-planned into one program's bytes,
with the ops ExecuTorch's runtime has no kernel for named before the file is written.
ExecuTorch is the `executorch` extra, imported here only, when a stage runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from export.errors import ExportError, one_line

FILE = "model.pte"
EXTRA = "pip install 'compress-pipeline[executorch]'"

Lower = Callable[..., tuple[bytes, int, list[str]]]


def lowering(instead: str = "format aoti or onnx") -> Lower:
    """`lower(program, constant_methods=None) -> (bytes, XNNPACK calls, ops without a
    kernel)`, ExecuTorch imported now; ExportError naming the extra when it is missing.
    `constant_methods` become methods of the program that return those values (what a
    runner reads before it calls `forward`); a failed lowering's error suggests `instead`."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
    except ImportError as exc:
        raise ExportError(f"format executorch needs ExecuTorch ({one_line(exc)}): {EXTRA}"
                          ) from None

    def lower(program: torch.export.ExportedProgram,
              constant_methods: dict[str, Any] | None = None) -> tuple[bytes, int, list[str]]:
        """The program's bytes, its XNNPACK calls, and the ops the runtime has no kernel for."""
        try:
            edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                               constant_methods=constant_methods)
            delegated = sum(node.op == "call_function"
                            and getattr(node.target, "__name__", "") == "executorch_call_delegate"
                            for node in edge.exported_program().graph.nodes)
            made = edge.to_executorch()
        except Exception as exc:  # lowering or memory planning of an op it cannot hold
            raise ExportError(f"executorch: lowering to XNNPACK failed: {one_line(exc)}; "
                              f"export with {instead}") from None
        known = Runtime.get().operator_registry.operator_names
        missing = sorted({name for plan in made.executorch_program.execution_plan
                          for op in plan.operators
                          if (name := f"{op.name}.{op.overload}" if op.overload else op.name)
                          not in known})
        return made.buffer, delegated, missing

    return lower
