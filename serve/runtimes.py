"""An exported file loaded in its own runtime, called with the positional input tensors.

The one set of loaders: the served handler runs them inside TorchServe (so this module
imports only torch and, per format, that format's runtime), and compress's export stage
loads every file it writes through them too (export.folder.load_export).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from serve import aoti_package

Runner = Callable[..., Any]


def load_torchscript(path: Path, meta: dict[str, Any], threads: int, spinning: bool) -> Runner:
    """The saved TorchScript module, in eval mode."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location="cpu").eval()


def load_aoti(path: Path, meta: dict[str, Any], threads: int, spinning: bool) -> Runner:
    """The AOTInductor package, callable with the positional input tensors (the operators
    its export.json names under `aoti_operators` registered first), extracted into this
    process's own temporary folder (`serve.worker_temp`: a killed worker's goes at the next
    one's start)."""
    if "compress_encoder" in meta.get("aoti_operators", ()):
        from serve import encoder_attention

        if not encoder_attention.load(path.parent):  # its library for this CPU may lie beside
            raise RuntimeError(f"{path.name} calls compress's attention kernel, which could "
                               f"not be built here: {encoder_attention.error()}")
    return aoti_package.load(path)  # its library and weights: in this process's own folder


def load_onnx(path: Path, meta: dict[str, Any], threads: int, spinning: bool) -> Runner:
    """An `onnxruntime.InferenceSession` (CPU) with `threads` intra-op threads. Without
    `spinning` its pool sleeps between runs: a served worker's own Python (tokenizing,
    JSON) needs the cores between two batches, and a spinning pool took them."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    names, outputs = meta["inputs"], meta.get("outputs", ["logits"])[:1]

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        feed = {n: t.cpu().numpy() for n, t in zip(names, tensors, strict=True) if n in wanted}
        return torch.from_numpy(session.run(outputs, feed)[0])

    return run


def load_tensorrt(path: Path, meta: dict[str, Any], threads: int, spinning: bool) -> Runner:
    """The saved TensorRT program on the GPU; inputs go to CUDA and logits come back."""
    if not torch.cuda.is_available():
        raise RuntimeError("a tensorrt file runs on a CUDA GPU, and none is visible")
    import torch_tensorrt  # noqa: F401  (registers the TensorRT runtime ops)

    module = torch.export.load(str(path)).module()

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        return module(*(t.cuda() for t in tensors)).float().cpu()

    return run


LOADERS = {"torchscript": load_torchscript, "aoti": load_aoti, "onnx": load_onnx,
           "tensorrt": load_tensorrt}


def load_runtime(folder: Path, meta: dict[str, Any], threads: int,
                 spinning: bool = True) -> Runner:
    """A callable running the exported file of `folder` (named by its `export.json`, given
    as `meta`) with positional input tensors."""
    fmt = meta["format"]
    if fmt not in LOADERS:
        raise RuntimeError(f"export format {fmt} has no loader here; known: {sorted(LOADERS)}")
    return LOADERS[fmt](Path(folder) / meta["file"], meta, threads, spinning)
