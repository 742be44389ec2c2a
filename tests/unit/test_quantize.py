"""int8 through torch.export + torchao PT2E: accuracy, modes, save/load, failures, the CLI."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from compress.algorithms.quantization import quantize
from compress.data.datasets import DataBundle, Examples
from compress.errors import CaptureError
from compress.measure.evaluate import logits_of
from compress.models.bundle import ModelBundle
from compress.models.folders import load_saved
from compress.models.graph_model import save_quantized
from compress.models.zoo import mlp
from compress.recipe.kinds.quantize import QuantizeConfig
from compress.stages.context import StageContext

SENTENCES = ["a good movie", "an awful, dull and boring film that never ends at all",
             "superb", "warm and happy and brilliant, a lovely story", "cold",
             "fine", "the plot is poor but the actors are great", "sad"]


def _quantize(bundle, cfg, ctx):
    """The library call as the quantize stage makes it, from a stage context."""
    return quantize(bundle, cfg, ctx.data.splits.get("calibration"),
                    setup=ctx.training() if cfg.mode == "qat" else None,
                    max_length=ctx.data.max_length)


def _context(tmp_path: Path, data: DataBundle) -> StageContext:
    return StageContext(0, "quantize", tmp_path / "stage", tmp_path, None, data, "key", 0,
                        log=lambda _: None)


def _digits_like(n: int = 64, seed: int = 0) -> DataBundle:
    gen = torch.Generator().manual_seed(seed)
    examples = Examples(labels=[i % 10 for i in range(n)],
                        inputs=torch.rand(n, 1, 8, 8, generator=gen))
    splits = {"calibration": examples, "train": examples}
    return DataBundle("image", splits, [str(i) for i in range(10)], input_shape=[1, 8, 8])


def _image_bundle(model: nn.Module) -> ModelBundle:
    return ModelBundle(model.eval(), "factory", [str(i) for i in range(10)],
                       factory="compress.models.zoo:mlp", input_shape=[1, 8, 8])


def _digits(n: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    """Real scikit-learn digits (8x8, scaled to [0, 1]) and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images[:n] / 16.0, dtype=torch.float32).unsqueeze(1)
    return x, torch.tensor(digits.target[:n])


@pytest.fixture(scope="module")
def trained_mlp() -> nn.Module:
    """An MLP fitted for a moment to real digits: confident, input-dependent logits."""
    torch.manual_seed(0)
    model = mlp(64, 32, 10)
    x, y = _digits(256)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(60):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


@torch.inference_mode()
def test_static_mlp_agrees_with_fp32_and_compiles_for_batch_1_and_8(
        trained_mlp: nn.Module, tmp_path: Path) -> None:
    model = trained_mlp
    bundle = _image_bundle(model)
    cfg = QuantizeConfig(mode="static", calibration={"samples": 64, "batch_size": 16})
    images, labels = _digits(64)
    calibration = Examples(labels=labels.tolist(), inputs=images)
    data = DataBundle("image", {"calibration": calibration}, [str(i) for i in range(10)],
                      input_shape=[1, 8, 8])
    quantized, metrics = _quantize(bundle, cfg, _context(tmp_path, data))
    assert metrics["compile_s"] > 0 and quantized.model.compiled is not None
    x = _digits(400)[0][200:]  # digits the MLP was not fitted on
    ref = model(x)
    got = torch.cat([logits_of(quantized.model, x[:8]), logits_of(quantized.model, x[8:9]),
                     logits_of(quantized.model, x[9:])])
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # measured with torchao 0.18 on held-out digits: mean |error| 0.45 against mean |logit|
    # 3.6 (issue 13 is about int8 accuracy); this bound catches a broken lowering (errors of
    # the logits' own size), not a small precision loss
    assert (got - ref).abs().mean() <= 0.2 * ref.abs().mean()
    path = save_quantized(quantized, tmp_path / "saved")
    loaded = load_saved(path.parent)
    assert torch.allclose(logits_of(loaded.model, x[:8]), got[:8], atol=1e-5)
    assert loaded.input_shape == [1, 8, 8] and not loaded.is_text


@torch.inference_mode()
@pytest.mark.parametrize("per_channel", [True, False])
def test_dynamic_mode_and_per_tensor_weights(per_channel: bool, trained_mlp: nn.Module,
                                             tmp_path: Path) -> None:
    model = trained_mlp
    cfg = QuantizeConfig(mode="dynamic", per_channel=per_channel, compile=False)
    quantized, metrics = _quantize(_image_bundle(model), cfg, _context(tmp_path, _digits_like()))
    assert metrics["quant_mode"] == "dynamic" and "calibration_samples" not in metrics
    x = torch.rand(100, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    ref, got = model(x), logits_of(quantized.model, x)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    weight_dequant = "per_channel" if per_channel else "per_tensor"
    ops = {str(node.target) for node in quantized.model.graph.graph.nodes}
    assert f"quantized_decomposed.dequantize_{weight_dequant}.default" in ops


def test_keep_float_leaves_matching_modules_unquantized(tmp_path: Path) -> None:
    def weight_dequants(keep: list[str]) -> int:
        cfg = QuantizeConfig(mode="dynamic", keep_float=keep, compile=False)
        quantized, _ = _quantize(_image_bundle(mlp()), cfg, _context(tmp_path, _digits_like()))
        return sum("dequantize_per_channel" in str(node.target)
                   for node in quantized.model.graph.graph.nodes)

    assert weight_dequants([]) == 2
    assert weight_dequants(["3"]) == 1


class _DataDependent(nn.Module):
    """Branches on a tensor's value: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


def test_uncapturable_model_is_a_one_line_capture_error(tmp_path: Path) -> None:
    bundle = _image_bundle(_DataDependent())
    with pytest.raises(CaptureError) as info:
        _quantize(bundle, QuantizeConfig(mode="dynamic"), _context(tmp_path, _digits_like()))
    assert str(info.value).startswith("torch.export could not capture the model: ")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_the_deprecated_quantization_api_is_not_used(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = QuantizeConfig(mode="static", compile=False,
                             calibration={"samples": 8, "batch_size": 8})
        _quantize(_image_bundle(mlp()), cfg, _context(tmp_path, _digits_like()))
    assert "torch.ao.quantization.quantize_fx" not in sys.modules


