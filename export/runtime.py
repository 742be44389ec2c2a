"""An exported file loaded back in its own runtime and called like the model it came from.

Every export folder holds the exported file, `export.json` (format, file, inputs, labels)
and, for text models, the tokenizer files. `load_export` reads such a folder with the
runtime of its format only (torch.jit, onnxruntime, AOTInductor, torch-tensorrt).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.graphs import TEXT_INPUTS, positional_inputs
from compress.models import ModelBundle

META = "export.json"
FORMAT_MODULES = {"torchscript": "export.torchscript", "onnx": "export.onnx",
                  "aoti": "export.aoti", "tensorrt": "export.tensorrt"}


class RuntimeModel(nn.Module):
    """Calls `run(*positional tensors)` for `model(x)` or `model(**tokenizer_output)`."""

    def __init__(self, run: Callable[..., Any], text: bool, runtime: str):
        super().__init__()
        self.__dict__["run"] = run  # a plain attribute: never a submodule or state
        self.text = text
        self.runtime = runtime

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.run(*positional_inputs(self.text, args, kwargs))
        return out[0] if isinstance(out, list | tuple) else out


def format_module(fmt: str):
    """The module of one export format (imported on demand: each has its own runtime)."""
    return importlib.import_module(FORMAT_MODULES[fmt])


def write_meta(folder: Path, fmt: str, file: str, bundle: ModelBundle, **extra: Any) -> None:
    """`export.json` and the tokenizer files beside an exported file."""
    meta = {"format": fmt, "file": file, "text": bundle.is_text,
            "inputs": list(TEXT_INPUTS) if bundle.is_text else ["input"], "outputs": ["logits"],
            "label_names": bundle.label_names, "input_shape": bundle.input_shape, **extra}
    (folder / META).write_text(json.dumps(meta, indent=2))
    if bundle.is_text:
        bundle.tokenizer.save_pretrained(folder)


def load_export(folder: str | Path, threads: int | None = None) -> ModelBundle:
    """The exported model of `folder` in its runtime, as a bundle ("runtime" kind)."""
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    threads = threads or os.cpu_count() or 1
    run = format_module(meta["format"]).load(folder / meta["file"], meta, threads)
    tokenizer = None
    if meta["text"]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    return ModelBundle(RuntimeModel(run, meta["text"], meta["format"]), "runtime",
                       meta["label_names"], tokenizer=tokenizer, input_shape=meta["input_shape"])
