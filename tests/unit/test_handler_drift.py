"""The handler's self-contained loaders (serve/handler.py, which runs inside TorchServe
without compress) and compress's own (export/*) give the same logits for one file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compress.stages.export import export
from compress.stages.export_spec import ExportConfig
from compress.zoo import mlp
from export.runtime import load_export
from serve.handler import load_runtime

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_handler_loader_matches_compress_loader(fmt: str, tmp_path: Path) -> None:
    from compress.models import ModelBundle

    torch.manual_seed(0)
    model = mlp(64, 16, 10).eval()
    bundle = ModelBundle(model, "factory", [str(i) for i in range(10)],
                         factory="compress.zoo:mlp", input_shape=[1, 8, 8])
    path, _ = export(bundle, ExportConfig(format=fmt), tmp_path / fmt)
    meta = json.loads((tmp_path / fmt / "export.json").read_text())
    ours = load_export(tmp_path / fmt, threads=1).model
    theirs = load_runtime(tmp_path / fmt, meta, threads=1)
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = model(x)
        mine, served = ours(x), theirs(x)
    assert path.is_file() and mine.shape == served.shape == (5, 10)
    assert (mine - served).abs().max().item() <= 1e-5
    assert (mine - expected).abs().max().item() <= 1e-4
