"""Export stages: each format written, loaded in its own runtime, and proven against the
model it came from; leaf semantics in the pipeline; bad input refused clearly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import digits_recipe, run_cli, write_recipe

from compress.recipe.registry import cuda_device_present

pytest.importorskip("onnxruntime")


def _validate(tmp_path: Path, stages: list[dict]):
    raw = digits_recipe(tmp_path / "runs")
    raw["stages"] += stages
    return run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))


@pytest.mark.parametrize("stages,message", [
    ([{"kind": "quantize", "mode": "dynamic"}, {"kind": "export", "format": "torchscript"}],
     "stages.2.format: torchscript cannot hold the PT2E int8 model"),
    ([{"kind": "export", "format": "onnx", "source": "distill"}],
     "stages.1.source: 'distill' is not an earlier stage that makes a model "
     "(choices: 0 (finetune))"),
    ([{"kind": "export", "format": "aoti", "quantize": "dynamic"}],
     "quantize do not apply to format aoti"),
    ([{"kind": "export", "format": "onnx", "quantize": "static", "optimize": True}],
     "optimize works on float ONNX models only"),
])
def test_bad_export_stages_fail_validation(tmp_path: Path, stages, message) -> None:
    result = _validate(tmp_path, stages)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a CUDA GPU is present")
@pytest.mark.skipif(cuda_device_present(), reason="a CUDA GPU is present here")
def test_tensorrt_without_a_gpu_stops_before_any_work(tmp_path: Path) -> None:
    result = _validate(tmp_path, [{"kind": "export", "format": "tensorrt",
                                   "precision": "fp16"}])
    assert result.returncode == 0, result.stderr
    assert "note: the run will need a CUDA GPU (stages.1 export)" in result.stdout
    ran = run_cli("run", str(tmp_path / "r.yaml"))
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.strip() == ("error: stages.1: this stage needs a CUDA GPU, and none is "
                                  "found on this machine; run the recipe where there is one")
    assert not (tmp_path / "runs").exists()


