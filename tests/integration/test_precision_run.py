"""A bf16 run end to end on a tiny BERT: precision -> AOTInductor export, through the
pipeline (the CPU check is stubbed: without native bf16 the math is emulated, still exact)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import text_recipe

import compress
from compress.recipe.registry import HARDWARE


def test_bf16_run_halves_the_weights_and_exports_to_aoti(tiny_bert: Path, tmp_path,
                                                         monkeypatch) -> None:
    text, _ = HARDWARE["bf16_cpu"]
    monkeypatch.setitem(HARDWARE, "bf16_cpu", (text, lambda: True))
    path = text_recipe(tmp_path, tiny_bert, [
        {"kind": "precision"}, {"kind": "export", "format": "aoti", "name": "bf16_aoti"}])
    compress.run(str(path), ["evaluation.latency.batch_sizes=[8]", "evaluation.latency.iters=2",
                             "evaluation.latency.warmup=1"])
    manifest = json.loads((tmp_path / "runs/bf16/manifest.json").read_text())
    base = manifest["baseline"]["metrics"]
    cast, aoti = (s["metrics"] for s in manifest["stages"])
    assert cast["dtype"] == "bf16" and 0.45 < cast["size_mb"] / base["size_mb"] < 0.55
    assert abs(cast["accuracy"] - base["accuracy"]) <= 0.05
    assert aoti["parity_argmax_agreement"] >= 0.98 and aoti["parity_tolerance"] is None
    assert aoti["latency_ms_b8"] > 0 and aoti["latency_ms_b8_real"] > 0
    assert (tmp_path / "runs/bf16" / manifest["stages"][1]["outputs"][0]["path"]).is_file()
