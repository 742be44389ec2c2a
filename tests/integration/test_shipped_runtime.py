"""The classifier handler and the one set of runtime loaders it ships with (serve/runtimes.py)
run an export folder written by compress, in a Python that cannot import compress."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import import_alone

from compress.models.bundle import ModelBundle
from compress.models.zoo import mlp
from compress.recipe.kinds.export import ExportConfig
from compress.serving.archive import CLASSIFIER, code_tree
from compress.stages.export import export

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_the_shipped_handler_runs_an_export_folder_without_compress(fmt: str,
                                                                    tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = mlp(64, 16, 10).eval()
    bundle = ModelBundle(model, "factory", [str(i) for i in range(10)],
                         factory="compress.models.zoo:mlp", input_shape=[1, 8, 8])
    folder = tmp_path / fmt
    export(bundle, ExportConfig(format=fmt), folder)
    tree, entry = code_tree(tmp_path / "code", CLASSIFIER)  # what an archive's root holds
    shutil.copytree(tree, folder, dirs_exist_ok=True)
    shutil.copy(entry, folder / entry.name)
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    (folder / "x.json").write_text(json.dumps(x.tolist()))
    reach, project, shown = import_alone(
        folder, "handler, serve.runtimes, torch",
        "meta = json.load(open('export.json')); "
        "run = serve.runtimes.load_runtime('.', meta, 1, spinning=False); "
        "out(run(torch.tensor(json.load(open('x.json')))).tolist())")
    assert reach == [] and project == []
    served = torch.tensor(shown[0])
    with torch.inference_mode():
        expected = model(x)
    assert served.shape == (5, 10)
    assert (served - expected).abs().max().item() <= 1e-4
