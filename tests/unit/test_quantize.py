"""int8 through torch.export + torchao PT2E: accuracy, modes, save/load, failures, the CLI."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import digits_recipe, run_cli, write_recipe
from torch import nn

from compress.data import DataBundle, Examples
from compress.errors import CaptureError
from compress.evaluate import logits_of
from compress.models import ModelBundle, load_saved, save_model
from compress.quantization import load_quantized, quantize, save_quantized
from compress.stages.quantize_spec import QuantizeConfig
from compress.state import StageContext
from compress.zoo import mlp

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
                       factory="compress.zoo:mlp", input_shape=[1, 8, 8])


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


@pytest.fixture(scope="module")
def text_bundle(tiny_bert: Path) -> ModelBundle:
    from transformers import AutoTokenizer, BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(tiny_bert).eval()
    return ModelBundle(model, "hf", ["0", "1"], tokenizer=AutoTokenizer.from_pretrained(tiny_bert))


@pytest.fixture(scope="module")
def text_data() -> DataBundle:
    texts = SENTENCES * 4
    examples = Examples(labels=[i % 2 for i in range(len(texts))], texts=texts)
    return DataBundle("text", {"calibration": examples, "train": examples}, ["0", "1"])


@pytest.fixture(scope="module")
def static_text(text_bundle, text_data, tmp_path_factory) -> tuple[ModelBundle, dict]:
    cfg = QuantizeConfig(mode="static", compile=False,
                         calibration={"samples": 16, "batch_size": 8})
    return _quantize(text_bundle, cfg, _context(tmp_path_factory.mktemp("q"), text_data))


def _encode(tokenizer, texts: list[str], length: int | None = None) -> dict:
    padding = "max_length" if length else True
    return dict(tokenizer(texts, padding=padding, max_length=length, truncation=True,
                          return_tensors="pt"))


def _text_batches(tokenizer) -> list[dict]:
    """Batch 1 and 8, short and long sequences, with padding."""
    return [_encode(tokenizer, SENTENCES[:1]), _encode(tokenizer, SENTENCES),
            _encode(tokenizer, SENTENCES[:3], 40), _encode(tokenizer, SENTENCES, 128)]


@torch.inference_mode()
def test_static_text_int8_stays_close_to_fp32(text_bundle, static_text) -> None:
    quantized, metrics = static_text
    assert quantized.kind == "pt2e" and quantized.label_names == text_bundle.label_names
    assert metrics["quant_mode"] == "static" and metrics["calibration_samples"] == 16
    for inputs in _text_batches(text_bundle.tokenizer):
        ref = logits_of(text_bundle.model, inputs)
        got = logits_of(quantized.model, inputs)
        assert got.shape == ref.shape == (inputs["input_ids"].shape[0], 2)
        # measured with torchao 0.18 on held-out digits: mean |error| 0.45 against mean |logit|
    # 3.6 (issue 13 is about int8 accuracy); this bound catches a broken lowering (errors of
    # the logits' own size), not a small precision loss
    assert (got - ref).abs().mean() <= 0.2 * ref.abs().mean()
    graph_ops = {str(node.target) for node in quantized.model.graph.graph.nodes}
    assert "quantized_decomposed.dequantize_per_channel.default" in graph_ops


@torch.inference_mode()
def test_save_and_load_give_the_same_logits(text_bundle, static_text, tmp_path: Path) -> None:
    quantized, _ = static_text
    weights = save_model(quantized, tmp_path / "model")
    assert weights == tmp_path / "model" / "model.pt2" and weights.is_file()
    meta = json.loads((tmp_path / "model" / "model.json").read_text())
    assert meta["text"] is True and meta["label_names"] == ["0", "1"]
    loaded = load_saved(tmp_path / "model")
    assert loaded.kind == "pt2e" and loaded.is_text and loaded.label_names == ["0", "1"]
    plain = load_quantized(tmp_path / "model", compile=False)
    for inputs in _text_batches(loaded.tokenizer):
        expected = logits_of(quantized.model, inputs)
        assert torch.equal(logits_of(plain.model, inputs), expected)
    inputs = _encode(loaded.tokenizer, SENTENCES)
    without_types = {k: v for k, v in inputs.items() if k != "token_type_ids"}
    assert torch.equal(logits_of(plain.model, without_types), logits_of(plain.model, inputs))


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


def test_qat_trains_a_few_steps_and_converts(tmp_path: Path) -> None:
    torch.manual_seed(0)  # dropout checks the train/eval switch (conv-bn folding takes 20 s)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(32, 10))
    cfg = QuantizeConfig(mode="qat", compile=False,
                         qat={"max_steps": 3, "batch_size": 16, "learning_rate": 1e-3})
    quantized, metrics = _quantize(_image_bundle(model), cfg, _context(tmp_path, _digits_like()))
    assert metrics["quant_mode"] == "qat" and metrics["qat_steps"] == 3
    with torch.inference_mode():
        out = logits_of(quantized.model, torch.rand(1, 1, 8, 8))
        assert out.shape == (1, 10) and torch.isfinite(out).all()
        x = torch.rand(8, 1, 8, 8)
        assert torch.equal(logits_of(quantized.model, x), logits_of(quantized.model, x))  # eval
    ops = {str(node.target) for node in quantized.model.graph.graph.nodes}
    assert "quantized_decomposed.quantize_per_tensor.default" in ops


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


def test_cli_finetune_then_static_quantize_is_accurate_and_cached(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["data"]["calibration"] = {"split": "train", "max_samples": 128}
    raw["stages"].append({"kind": "quantize", "mode": "static",
                          "calibration": {"samples": 128, "batch_size": 64}})
    path = write_recipe(tmp_path / "r.yaml", raw)
    first = run_cli("run", str(path))
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "tiny_digits"
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    finetuned, quantized = stages[0]["metrics"], stages[1]["metrics"]
    assert stages[1]["status"] == "done" and quantized["quant_mode"] == "static"
    assert quantized["calibration_samples"] == 128 and quantized["compile_s"] > 0
    assert abs(quantized["accuracy"] - finetuned["accuracy"]) <= 0.03
    assert (run_dir / stages[1]["outputs"][0]["path"]).name == "model.pt2"
    again = run_cli("run", str(path))
    assert again.returncode == 0, again.stderr
    assert "[2/2] quantize: cached" in again.stderr


def test_cli_quantize_of_an_uncapturable_model_exits_1_naming_the_stage(tmp_path: Path) -> None:
    (tmp_path / "branchy.py").write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = torch.nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        "        x = x.flatten(1)\n"
        "        return self.linear(x) if x.sum() > 0 else -self.linear(x)\n"
        "def build():\n"
        "    return Branchy()\n")
    raw = digits_recipe(tmp_path / "runs")
    raw["model"] = {"source": "branchy:build"}
    raw["stages"] = [{"kind": "quantize", "mode": "dynamic"}]
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)),
                     env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage quantize failed: torch.export could not capture"), last
    assert "Traceback" not in result.stderr
    manifest = json.loads((tmp_path / "runs" / "tiny_digits" / "manifest.json").read_text())
    assert manifest["stages"][0]["status"] == "failed"
    assert manifest["stages"][0]["outputs"] == []
