"""The GPU path of 2:4 sparsity: a classifier's 2:4 Linears as PyTorch semi-structured
sparse tensors (`torch.sparse.to_sparse_semi_structured`), whose products run on the
sparse tensor cores of NVIDIA GPUs of compute capability 8.0 or newer (A100, H100, ...).

The backend is PyTorch's default: cuSPARSELt (`SparseSemiStructuredTensorCUSPARSELT`),
unless `torch.sparse.SparseSemiStructuredTensor._FORCE_CUTLASS` is set, which selects
CUTLASS. Each backend accepts only some dtypes and shapes; the weight (out, in) must be
2-D, contiguous and, as PyTorch 2.x documents them:

    backend     dtype            out (rows) multiple of   in (columns) multiple of
    cuSPARSELt  fp16, bf16       16                       16   (also int8, fp8: 32, 32)
    CUTLASS     fp16, bf16       32                       64   (also fp32: 32, 32; int8: 16, 128)

The activations are padded by PyTorch to the backend's dense minimum (8 rows and columns
for fp16 and bf16), so any batch and sequence length works. The tables are read from the
backend class at run time, so a later PyTorch's constraints are the ones applied.

Eager calls are slow: on an H200 with torch 2.11 and cuSPARSELt 0.8 each product spends
about 0.5 ms of host time in `aten::_cslt_sparse_mm` (cuSPARSELt's plan set up per call),
while its kernel runs 8 us on 1024 x 384 x 384 and the dense product takes 15 us in all
(torch.profiler, benchmarks/gpu/sparse24.py). `graphed` captures a converted model's call in
a CUDA graph, whose replay launches the kernels alone: that is how the sparse products pay.

Conversion is for inference: the sparse weight is an nn.Parameter with requires_grad False,
and a converted model is neither trained further nor saved by compress's exporters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.algorithms.semi_structured import group_nonzeros
from compress.errors import CompressError

NEEDS = "a CUDA GPU of compute capability 8.0 or newer (A100, H100 or later)"


@dataclass(frozen=True)
class Conversion:
    """The Linears whose weight became semi-structured, and the others with why not."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def sparse_backend() -> type:
    """The class `to_sparse_semi_structured` builds: cuSPARSELt unless CUTLASS is forced."""
    base = torch.sparse.SparseSemiStructuredTensor
    return (torch.sparse.SparseSemiStructuredTensorCUTLASS if base._FORCE_CUTLASS
            else torch.sparse.SparseSemiStructuredTensorCUSPARSELT)


def require_sparse_gpu() -> None:
    """Raise a one-line CompressError unless this process sees a GPU that runs 2:4 products
    with the backend PyTorch would pick."""
    if not torch.cuda.is_available():
        raise CompressError(f"2:4 semi-structured tensors need {NEEDS}; torch sees no CUDA "
                            "device")
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise CompressError(f"2:4 semi-structured tensors need {NEEDS}; "
                            f"{torch.cuda.get_device_name()} is {major}.{minor}")
    if sparse_backend().BACKEND == "cusparselt" and not torch.backends.cusparselt.is_available():
        raise CompressError("this torch build has no cuSPARSELt (PyTorch's default 2:4 backend); "
                            "set torch.sparse.SparseSemiStructuredTensor._FORCE_CUTLASS = True "
                            "to use CUTLASS")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def why_not(weight: torch.Tensor, backend: type) -> str | None:
    """Why `weight` cannot become a semi-structured tensor of `backend`; None when it can."""
    if isinstance(weight, torch.sparse.SparseSemiStructuredTensor):
        return "already semi-structured"
    if weight.dim() != 2:
        return f"weight has {weight.dim()} dimensions, not 2"
    if not weight.is_cuda:
        return f"weight is on {weight.device}, not CUDA (move the model first)"
    limits = backend._DTYPE_SHAPE_CONSTRAINTS.get(weight.dtype)
    if limits is None:
        accepted = ", ".join(_dtype(d) for d in backend._DTYPE_SHAPE_CONSTRAINTS)
        return (f"{backend.BACKEND} does not take {_dtype(weight.dtype)} (it takes {accepted}; "
                "cast the model to float16 or bfloat16)")
    rows, columns = weight.shape
    if rows % limits.sparse_min_rows or columns % limits.sparse_min_cols:
        return (f"shape {rows}x{columns}: {backend.BACKEND} needs out a multiple of "
                f"{limits.sparse_min_rows} and in a multiple of {limits.sparse_min_cols}")
    if columns % 4 or int(group_nonzeros(weight, 4).max()) > 2:
        return "not 2:4 along its inputs (more than 2 non-zeros in some group of 4)"
    return None


@torch.no_grad()
def to_semi_structured(model: nn.Module) -> Conversion:
    """Replace, in place, the weight of every nn.Linear of `model` that is 2:4 along its
    input dimension (at most 2 non-zeros in each group of 4 consecutive inputs) and whose
    dtype and shape the backend accepts by `torch.sparse.to_sparse_semi_structured(weight)`,
    as an nn.Parameter with requires_grad False; the bias stays dense. Returns the names
    converted and the names left dense with why. The model must already be on the GPU in
    float16 or bfloat16; without a CUDA GPU of compute capability 8.0+ this raises a
    CompressError before touching anything."""
    require_sparse_gpu()
    backend = sparse_backend()
    result = Conversion()
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Linear):
            continue
        reason = why_not(layer.weight, backend)
        if reason is not None:
            result.skipped[name] = reason
            continue
        sparse = torch.sparse.to_sparse_semi_structured(layer.weight.detach().contiguous())
        layer.weight = nn.Parameter(sparse, requires_grad=False)
        result.converted.append(name)
    return result


def graphed(call: Callable[[torch.Tensor], torch.Tensor],
            example: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """`call` captured in a CUDA graph for inputs shaped like `example` (warmed up on a side
    stream first, as CUDA graph capture requires). The returned function copies its input
    into the captured one and replays the graph; its output tensor is the captured one,
    overwritten by the next replay. An input of another shape or dtype is refused."""
    static_input = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            call(static_input)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_output = call(static_input)

    def replay(inputs: torch.Tensor) -> torch.Tensor:
        if inputs.shape != static_input.shape or inputs.dtype != static_input.dtype:
            raise CompressError(f"the CUDA graph was captured for {tuple(static_input.shape)} "
                                f"{_dtype(static_input.dtype)} inputs, not "
                                f"{tuple(inputs.shape)} {_dtype(inputs.dtype)}; capture one "
                                "per shape")
        static_input.copy_(inputs)
        graph.replay()
        return static_output

    return replay
