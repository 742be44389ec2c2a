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


def load_executorch(path: Path, meta: dict[str, Any], threads: int, spinning: bool) -> Runner:
    """The `.pte` program's `forward` in ExecuTorch's runtime (XNNPACK on `threads` threads:
    its pool is the process's one). A batch above the program's `executorch_max_batch` runs
    in slices; a sequence above its `executorch_max_seq` is refused in one line."""
    try:
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime
    except ImportError as exc:
        raise ImportError(f"an executorch file needs ExecuTorch ({exc}): "
                          "pip install 'compress-pipeline[executorch]'") from None
    if threads and portable_lib._threadpool_get_thread_count() != threads:
        portable_lib._unsafe_reset_threadpool(threads)  # before any call of this worker
    method = Runtime.get().load_program(path).load_method("forward")
    max_batch = int(meta.get("executorch_max_batch") or 0)
    max_seq = meta.get("executorch_max_seq")

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        if max_seq and tensors[0].dim() > 1 and tensors[0].shape[1] > max_seq:
            raise RuntimeError(f"{path.name} takes sequences of at most {max_seq} tokens (its "
                               f"export bound), got {tensors[0].shape[1]}; truncate the input")
        step = max_batch or len(tensors[0])
        outs = [method.execute([t[i:i + step].contiguous() for t in tensors])[0].clone()
                for i in range(0, len(tensors[0]), step)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    return run


LOADERS = {"torchscript": load_torchscript, "aoti": load_aoti, "onnx": load_onnx,
           "tensorrt": load_tensorrt, "executorch": load_executorch}


def load_runtime(folder: Path, meta: dict[str, Any], threads: int,
                 spinning: bool = True) -> Runner:
    """A callable running the exported file of `folder` (named by its `export.json`, given
    as `meta`) with positional input tensors."""
    fmt = meta["format"]
    if fmt not in LOADERS:
        raise RuntimeError(f"export format {fmt} has no loader here; known: {sorted(LOADERS)}")
    return LOADERS[fmt](Path(folder) / meta["file"], meta, threads, spinning)
