"""An export folder: the exported file, `export.json` (format, file, inputs, labels) and, for
text models, the tokenizer files. `write_export` builds one under a temporary name and
renames it when complete; `load_export` reads one back with its format's own runtime
(serve.runtimes, the loaders the served handler uses too).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from export.errors import ExportError, one_line
from export.graphs import TEXT_INPUTS, Bundle, output_name, positional_inputs
from serve.runtimes import load_runtime

META = "export.json"
FORMAT_MODULES = {"torchscript": "export.torchscript", "onnx": "export.onnx",
                  "aoti": "export.aoti", "tensorrt": "export.tensorrt",
                  "executorch": "export.executorch"}


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


def write_meta(folder: Path, fmt: str, file: str, bundle: Bundle, **extra: Any) -> None:
    """`export.json` and the tokenizer files beside an exported file."""
    meta = {"format": fmt, "file": file, "text": bundle.is_text,
            "inputs": list(TEXT_INPUTS) if bundle.is_text else ["input"],
            "outputs": [output_name(bundle)],
            "label_names": bundle.label_names, "input_shape": bundle.input_shape, **extra}
    (folder / META).write_text(json.dumps(meta, indent=2))
    if bundle.is_text:
        bundle.tokenizer.save_pretrained(folder)


def write_export(bundle: Bundle, cfg: Any, folder: Path, calibration: Any = None,
                 log: Callable[[str], None] = print, meta: dict[str, Any] | None = None
                 ) -> tuple[Path, dict[str, Any]]:
    """Write `bundle` in `cfg.format` into `folder` (built under a temporary name, then
    renamed) with `export.json`; the exported file and what was done. `calibration` (an
    iterable of input batches) feeds ONNX Runtime static int8; `meta` goes into
    `export.json` beside the facts (what a server of the file must know). ExportError /
    CaptureError on failure."""
    folder = Path(folder)
    module = format_module(cfg.format)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    began = time.perf_counter()
    path, facts = module.export(bundle, cfg, tmp, calibration, log)
    write_meta(tmp, cfg.format, path.name, bundle, source_kind=bundle.kind,
               **facts, **(meta or {}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder / path.name, {**facts, "export_s": round(time.perf_counter() - began, 3)}


@dataclass
class LoadedExport:
    """An exported file in its runtime, with what calling it needs (a `Bundle`)."""

    model: RuntimeModel
    label_names: list[str]
    tokenizer: Any = None
    input_shape: list[int] = field(default_factory=list)
    kind: str = "runtime"

    @property
    def is_text(self) -> bool:
        return self.tokenizer is not None


def load_export(folder: str | Path, threads: int | None = None) -> LoadedExport:
    """The exported model of `folder` in its runtime."""
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    threads = threads or os.cpu_count() or 1
    try:
        run = load_runtime(folder, meta, threads)
    except (RuntimeError, ImportError) as exc:
        raise ExportError(f"cannot load {folder / meta['file']}: {one_line(exc)}") from None
    tokenizer = None
    if meta["text"]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedExport(RuntimeModel(run, meta["text"], meta["format"]), meta["label_names"],
                        tokenizer=tokenizer, input_shape=meta["input_shape"])
