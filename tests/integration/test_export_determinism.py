"""Every format the pipeline writes is deterministic (DESIGN 8): the loaded artifact gives
bitwise-identical logits for the same input on every call and on a second load. The QAT
int8 .pt2 agrees with its in-process model (attention dropout once stayed on in it).

In-process on a tiny BERT fine-tuned on the word-sentiment table; each artifact is built
once per module, on first use (an AOTInductor compile takes 15-30 s here)."""

from __future__ import annotations

import copy
import random
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NEGATIVE, POSITIVE

from compress.algorithms.quantization import quantize
from compress.api import load_model
from compress.data.datasets import Examples
from compress.measure import parity
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.export import ExportConfig
from compress.recipe.kinds.quantize import QuantizeConfig
from compress.recipe.options import TrainOptions
from compress.stages.export import export
from compress.train.loop import TrainSetup
from export.folder import load_export

pytest.importorskip("onnxruntime")
MAX_LENGTH = 32
# artifact -> (model it exports, export options), as the shipped recipes write them
ARTIFACTS: dict[str, tuple[str, dict[str, Any]]] = {
    "torchscript": ("fp32", {"format": "torchscript"}),
    "onnx": ("fp32", {"format": "onnx", "optimize": True}),
    "onnx_int8_dynamic": ("fp32", {"format": "onnx", "quantize": "dynamic"}),
    "onnx_int8_static": ("fp32", {"format": "onnx", "quantize": "static",
                                  "calibration": {"samples": 64, "batch_size": 16}}),
    "aoti_fp32": ("fp32", {"format": "aoti"}),
    "aoti_bf16": ("bf16", {"format": "aoti"}),
    "aoti_ptq_int8": ("static", {"format": "aoti"}),
    "aoti_qat_int8": ("qat", {"format": "aoti"}),
}


def sentences(n: int, seed: int, mixed: bool = False) -> Examples:
    """Word-sentiment sentences (conftest's words); `mixed` ones hold two words of each
    side, so the model's margins are small and an argmax flips under little noise."""
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        label = i % 2
        words = rng.choices(POSITIVE if label else NEGATIVE, k=3 if not mixed else 2)
        if mixed:
            words += rng.choices(NEGATIVE if label else POSITIVE, k=2)
        rng.shuffle(words)
        texts.append(" ".join(words + ["movie"]))
        labels.append(label)
    return Examples(labels=labels, texts=texts)


class Builds:
    """The fine-tuned float model, its quantized and bf16 variants and their exports, each
    made once on first use."""

    def __init__(self, tiny_bert: Path, folder: Path):
        self.folder = folder
        self.train = sentences(240, seed=0)
        self.models: dict[str, ModelBundle] = {}
        self.exports: dict[str, Path] = {}
        fp32 = load_model(tiny_bert, ["negative", "positive"])
        TrainSetup(self.train, MAX_LENGTH).run(
            fp32.model, TrainOptions(epochs=6, batch_size=16, learning_rate=1e-3),
            fp32.tokenizer)
        self.models["fp32"] = fp32

    def model(self, name: str) -> ModelBundle:
        if name not in self.models:
            fp32 = self.models["fp32"]
            if name == "bf16":
                model = copy.deepcopy(fp32.model).to(torch.bfloat16).eval()
                self.models[name] = ModelBundle(model, "hf", fp32.label_names,
                                                tokenizer=fp32.tokenizer)
            else:
                # the static model is only exported: not compiled for evaluation as well
                # (the QAT one is, as test_the_qat_int8_package_agrees... compares to it)
                cfg = QuantizeConfig(mode=name, calibration={"samples": 64, "batch_size": 16},
                                     qat={"max_steps": 30, "batch_size": 16,
                                          "learning_rate": 2e-5}, compile=name == "qat")
                self.models[name], _ = quantize(
                    fp32, cfg, self.train, setup=TrainSetup(self.train, MAX_LENGTH),
                    max_length=MAX_LENGTH)
        return self.models[name]

    def export(self, artifact: str) -> Path:
        if artifact not in self.exports:
            source, options = ARTIFACTS[artifact]
            export(self.model(source), ExportConfig(**options), self.folder / artifact,
                   self.train, MAX_LENGTH)
            self.exports[artifact] = self.folder / artifact
        return self.exports[artifact]


@pytest.fixture(scope="module")
def builds(tiny_bert: Path, tmp_path_factory) -> Builds:
    return Builds(tiny_bert, tmp_path_factory.mktemp("determinism"))


@pytest.mark.parametrize("artifact", list(ARTIFACTS))
def test_an_artifact_gives_the_same_logits_on_every_call_and_load(builds: Builds,
                                                                  artifact: str) -> None:
    folder = builds.export(artifact)
    tokenizer = builds.models["fp32"].tokenizer
    texts = sentences(6, seed=1).texts + sentences(6, seed=2, mixed=True).texts
    inputs = dict(tokenizer(texts, padding=True, return_tensors="pt"))  # lengths vary
    runs = []
    for _ in range(2):  # two loads
        model = load_export(folder, threads=2).model
        with torch.inference_mode():
            runs += [model(**inputs) for _ in range(3)]
    assert runs[0].shape == (12, 2) and torch.isfinite(runs[0]).all()
    worst = max(float((run.float() - runs[0].float()).abs().max()) for run in runs)
    assert all(torch.equal(run, runs[0]) for run in runs), f"logits moved by up to {worst:.3g}"


def test_the_qat_int8_package_agrees_with_the_in_process_qat_model(builds: Builds) -> None:
    """The .pt2 against the QAT model as the pipeline evaluates it (compiled, freezing on):
    both run the same Inductor lowering, and gave identical logits here (max |diff| 0.0 on
    these 200 sentences, torch 2.13 / torchao 0.18). With attention dropout left on, the
    logits differed on every call, which the logit bound catches."""
    qat = builds.model("qat")
    exported = load_export(builds.export("aoti_qat_int8"), threads=2)
    plain, mixed = sentences(80, 3), sentences(120, 4, mixed=True)
    examples = Examples(labels=plain.labels + mixed.labels, texts=plain.texts + mixed.texts)
    figures = parity.compare(qat.model, exported.model, examples, 16, qat.tokenizer,
                             MAX_LENGTH, 2)
    assert figures["parity_samples"] == 200
    assert figures["parity_argmax_agreement"] >= 0.995, figures
    assert figures["parity_max_abs_diff"] <= 1e-5, figures


def kernel_calls(package: Path) -> Counter:
    """How often the package's generated wrapper calls each ATen / oneDNN kernel."""
    with zipfile.ZipFile(package) as archive:
        code = "".join(archive.read(name).decode() for name in archive.namelist()
                       if name.endswith(".wrapper.cpp"))
    return Counter(re.findall(r"aoti_torch_cpu_(\w+?)\(", code))


def test_the_qat_package_runs_the_int8_kernels_of_the_ptq_package(builds: Builds) -> None:
    """Both int8 graphs lower alike: int8 Linears (oneDNN qlinear) and the fused CPU flash
    attention. With the attention dropout left on, the QAT package computed attention in
    float (4 bmm, a random mask from randint, no flash kernel) and ran at 0.95x fp32 on the
    pruned MiniLM student instead of 0.37x."""
    qat = kernel_calls(builds.export("aoti_qat_int8") / "model.aoti.pt2")
    ptq = kernel_calls(builds.export("aoti_ptq_int8") / "model.aoti.pt2")
    assert qat == ptq, (qat, ptq)
    # 2 layers x 4 int8 GEMMs (query, key and value as one: export/fused_projections.py)
    # and the pooler
    assert qat["_qlinear_pointwise_tensor"] >= 9
    assert qat["_scaled_dot_product_flash_attention_for_cpu"] >= 1
    assert not {"bmm_out", "randint_low_out"} & set(qat)
