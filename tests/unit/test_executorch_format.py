"""Format executorch on an MLP fitted to real digits: a float `.pte` that executorch.runtime
runs alike at any batch (sliced above its bound), XNNPACK's static int8 calibrated on real
digits, and what the format refuses, one line each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from builders import image_bundle, real_digits
from conftest import digits_recipe, write_recipe
from pydantic import ValidationError
from torch import nn

from compress.errors import UserError
from compress.recipe.kinds.export import ExportConfig
from compress.recipe.schema import load_recipe
from export.errors import ExportError
from export.executorch import MAX_BATCH
from export.folder import load_export, write_export

pytest.importorskip("executorch", reason="the executorch extra is not installed: "
                    "pip install 'compress-pipeline[executorch]'")

HELD_OUT = slice(200, 400)  # trained_mlp saw the first 256 digits; the test scores on these


def batches(x: torch.Tensor, size: int):
    return (x[i:i + size] for i in range(0, len(x), size))


@pytest.fixture(scope="module")
def float_pte(trained_mlp, tmp_path_factory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("et") / "executorch"
    return write_export(image_bundle(trained_mlp), ExportConfig(format="executorch"), folder,
                        log=lambda _: None)


def test_a_float_pte_runs_as_the_model_at_any_batch(trained_mlp, float_pte) -> None:
    path, facts = float_pte
    assert path.name == "model.pte" and facts["executorch_delegated"] >= 1
    meta = json.loads((path.parent / "export.json").read_text())
    assert meta["format"] == "executorch" and meta["executorch_max_batch"] == MAX_BATCH
    assert "executorch_quantize" not in meta
    x, _ = real_digits()
    x = x[HELD_OUT].reshape(-1, 1, 8, 8)
    with torch.no_grad():
        want = trained_mlp(x)
    exported = load_export(path.parent, threads=1)
    got = exported.model(x)  # 200 digits: above the bound, run in slices of 64
    assert got.shape == (200, 10)
    assert (got - want).abs().max() < 1e-5
    assert torch.equal(got.argmax(1), want.argmax(1))
    for batch in (1, 7, MAX_BATCH):
        assert torch.allclose(exported.model(x[:batch]), want[:batch], atol=1e-5)


def test_the_pte_runs_in_executorch_runtime_alone(trained_mlp, float_pte) -> None:
    from executorch.runtime import Runtime

    path, _ = float_pte
    method = Runtime.get().load_program(path).load_method("forward")
    x = real_digits()[0][HELD_OUT][:5].reshape(-1, 1, 8, 8)
    (out,) = method.execute([x])
    with torch.no_grad():
        assert torch.allclose(out, trained_mlp(x), atol=1e-5)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_xnnpack_int8_keeps_the_accuracy(trained_mlp, mode: str, tmp_path: Path) -> None:
    x, y = real_digits()
    x = x.reshape(-1, 1, 8, 8)
    cfg = ExportConfig(format="executorch", quantize=mode)
    path, facts = write_export(image_bundle(trained_mlp), cfg, tmp_path / "int8",
                               batches(x[:128], 32) if mode == "static" else None,
                               log=lambda _: None)
    assert facts["executorch_quantize"] == mode and facts["executorch_delegated"] >= 1
    if mode == "static":  # an MLP of ReLUs: no linear is fed by a GELU
        assert facts["calibration_samples"] == 128
        assert facts["executorch_dynamic_linears"] == 0
    else:
        assert "calibration_samples" not in facts
    program = path.read_bytes()
    assert b"XnnpackBackend" in program
    got = load_export(path.parent, threads=1).model(x[HELD_OUT])
    with torch.no_grad():
        want = trained_mlp(x[HELD_OUT])
    assert not torch.allclose(got, want, atol=1e-4)  # int8: it does round
    agreement = (got.argmax(1) == want.argmax(1)).float().mean().item()
    float_accuracy = (want.argmax(1) == y[HELD_OUT]).float().mean().item()
    int8_accuracy = (got.argmax(1) == y[HELD_OUT]).float().mean().item()
    assert agreement >= 0.97, agreement
    assert int8_accuracy >= float_accuracy - 0.02, (int8_accuracy, float_accuracy)


def test_refuses_a_pt2e_model(trained_mlp, tmp_path: Path) -> None:
    bundle = image_bundle(trained_mlp)
    bundle.kind = "pt2e"
    with pytest.raises(ExportError, match="executorch cannot hold a PT2E int8 model "
                       "quantized for x86.*quantize: static"):
        write_export(bundle, ExportConfig(format="executorch"), tmp_path / "x")


def test_refuses_static_int8_without_calibration(trained_mlp, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="needs the calibration split"):
        write_export(image_bundle(trained_mlp),
                     ExportConfig(format="executorch", quantize="static"), tmp_path / "x")


class Tail(nn.Module):
    """A linear layer, then `op`."""

    def __init__(self, op) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.linear(x.flatten(1)))


@pytest.mark.parametrize("op,message", [
    # a core ATen op that neither XNNPACK nor ExecuTorch's kernels run
    (lambda y: torch.sort(y, 1).values, r"executorch: XNNPACK does not take aten::sort\.values "
     "and ExecuTorch's runtime has no kernel for it; export with format aoti or onnx"),
    # an op outside core ATen: the edge dialect refuses it
    (torch.erfinv, r"executorch: lowering to XNNPACK failed: SpecViolationError: Operator "
     r"torch\._ops\.aten\.erfinv\.default is not in Core ATen opset.*; export with format "
     "aoti or onnx"),
])
def test_refuses_an_op_the_runtime_cannot_run(op, message: str, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=message):
        write_export(image_bundle(Tail(op)), ExportConfig(format="executorch"),
                     tmp_path / "x", log=lambda _: None)
    assert not (tmp_path / "x").exists()


def test_without_executorch_both_ways_name_the_extra(trained_mlp, float_pte, tmp_path: Path,
                                                     monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "executorch", None)  # import executorch: ImportError
    for name in [m for m in sys.modules if m.startswith("executorch.")]:
        monkeypatch.setitem(sys.modules, name, None)
    extra = r"pip install 'compress-pipeline\[executorch\]'"
    with pytest.raises(ExportError, match=f"format executorch needs ExecuTorch.*{extra}"):
        write_export(image_bundle(trained_mlp), ExportConfig(format="executorch"),
                     tmp_path / "x")
    path, _ = float_pte
    with pytest.raises(ExportError, match=f"cannot load .*model.pte: ImportError: an "
                       f"executorch file needs ExecuTorch.*{extra}"):
        load_export(path.parent)


@pytest.mark.parametrize("options,message", [
    ({"opset": 17}, "opset do not apply to format executorch"),
    ({"attention": "kernel"}, "attention do not apply to format executorch"),
    ({"keep_float": ["*"], "quantize": "static"},
     "keep_float do not apply to format executorch"),
])
def test_recipe_refuses_options_it_does_not_take(options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ExportConfig(format="executorch", **options)
    for mode in ("static", "dynamic"):
        cfg = ExportConfig(format="executorch", quantize=mode, calibration={"samples": 64})
        assert cfg.quantizes  # held to agreement and accuracy, not to a logit tolerance
    assert not ExportConfig(format="executorch").quantizes


def test_recipe_refuses_the_x86_int8_model(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["data"]["calibration"] = {"split": "train", "max_samples": 64}
    raw["stages"] += [{"kind": "quantize", "mode": "static"},
                      {"kind": "export", "format": "executorch"}]
    with pytest.raises(UserError, match=r"stages\.2\.format: executorch cannot hold the PT2E "
                       "int8 model .*set source to a stage before the quantize stage"):
        load_recipe(write_recipe(tmp_path / "r.yaml", raw))
    raw["stages"][2].update(source="finetune", quantize="static")
    load_recipe(write_recipe(tmp_path / "r.yaml", raw))  # the float model: XNNPACK int8
