"""Pruning: magnitude (per layer, global, gradual), structured BERT and CNN, reload, the stage;
a 2:4 wanda run on a tiny BERT recorded in the manifest and the report."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from builders import chosen, input_ids, logits, random_bert
from conftest import digits_recipe, minilm_folder, run_cli, text_recipe, write_recipe

from compress.algorithms.pruning import prune_structured
from compress.models.bundle import ModelBundle
from compress.models.folders import load_saved, save_model
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from compress.report.build import build_report


def test_hf_structure_round_trips_through_save_and_load(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    model = random_bert(tokenizer.vocab_size)
    bundle = ModelBundle(model, "hf", ["neg", "pos"], tokenizer=tokenizer)
    _, bundle.structure = prune_structured(model, chosen(model), "ffn+heads", 0.5)
    save_model(bundle, tmp_path / "model")
    loaded = load_saved(tmp_path / "model")
    ids = input_ids(tokenizer.vocab_size)
    heads = [layer.attention.self.num_attention_heads for layer in loaded.model.bert.encoder.layer]
    assert heads == [2, 2] and loaded.structure == bundle.structure
    assert torch.allclose(logits(loaded.model, ids), logits(model, ids), atol=1e-6)


# ---- the stage -------------------------------------------------------------------------------


def test_pipeline_finetune_then_prune_channels(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs", epochs=4, learning_rate=3e-3)
    raw["model"] = {"source": "compress.models.zoo:small_cnn", "kwargs": {"channels": 8}}
    raw["stages"].append({"kind": "prune", "method": "structured", "target": "channels",
                          "amount": 0.5, "recovery": {"epochs": 1, "batch_size": 32,
                                                      "learning_rate": 1e-3}})
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "tiny_digits"
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert stages[1]["metrics"]["params"] < stages[0]["metrics"]["params"]
    assert stages[1]["metrics"]["flops_after"] < stages[1]["metrics"]["flops_before"]
    assert stages[1]["metrics"]["accuracy"] > 0.85
    assert (run_dir / "01-prune" / "model" / "structure.json").is_file()


def test_a_bert_run_records_the_pattern_and_the_report_shows_it(
        tmp_path: Path, tiny_bert: Path) -> None:
    stages = [{"kind": "prune", "method": "semi_structured", "scoring": "wanda",
               "calibration": {"samples": 16, "batch_size": 8}, "recovery_distill": True,
               "recovery": {"max_steps": 2, "batch_size": 8}}]
    path = text_recipe(tmp_path, tiny_bert, stages)
    raw = path.read_text().replace("stages:", "evaluation:\n  latency:\n    enabled: false\n"
                                   "stages:")
    path.write_text(raw)
    run_dir = run_recipe(load_recipe(path), echo=lambda _: None)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    m = stage["metrics"]
    assert stage["status"] == "done" and m["pattern"] == "2:4" and m["sparsity_layers"] == 0.5
    assert m["pruned_layers"] == 12 and m["skipped_layers"] == 0 and "accuracy_pruned" in m
    row = next(r for r in build_report(run_dir)["rows"] if r["kind"] == "prune")
    assert row["runtime"] == "PyTorch eager (2:4 pruned, 50.0% of pruned weights zero)"
