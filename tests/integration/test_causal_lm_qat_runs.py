"""`quantize` mode qat on a causal LM through the pipeline: training on the grid moves the
weights and brings the fake-quantized model's next-token distributions closer to the float
model's than the untrained grid has them, then the weights are quantized."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from builders import causal_lm_recipe
from torch import nn

from compress.models.folders import load_saved
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe

QAT_STEPS = 10


def test_a_causal_lm_quantize_stage_trains_on_the_grid_then_quantizes(
        tmp_path: Path, varied_llama_folder: Path) -> None:
    """On a Llama whose greedy tokens vary (std 0.1 init: the default 0.02 one's KL to its
    int4 grid is 1e-5, all but nothing to train), QAT moves the weights
    (qat_weight_change > 0) and its KL to the float model on the first train batch, with the
    weights on the int4 grid, falls below 0.85x that of the untrained grid (the no-training
    control the stage records); the saved model is int4 with an int8 head."""
    # lr 1e-4 with 10 steps of 4 blocks: the KL falls by a third (3e-5 by a fifth); at 1e-3
    # Adam overshoots the 4-bit grid and the KL quadruples
    stages = [{"kind": "quantize", "scheme": "int4_weight_only", "mode": "qat",
               "qat": {"max_steps": QAT_STEPS, "batch_size": 4, "learning_rate": 1e-4}}]
    path = causal_lm_recipe(tmp_path, varied_llama_folder, stages, train_samples=40)
    run_dir = run_recipe(load_recipe(path, check_sources=True), echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    metrics = manifest["stages"][0]["metrics"]
    assert metrics["train_steps"] == QAT_STEPS and metrics["qat_linears"] == 2 * 7 + 1
    assert metrics["head_scheme"] == "int8_weight_only" and metrics["train_blocks"] > 0
    assert torch.isfinite(torch.tensor(metrics["train_loss"]))
    assert metrics["qat_weight_change"] > 1e-5, metrics["qat_weight_change"]
    before, after = metrics["qat_loss_before_training"], metrics["qat_loss_after_training"]
    assert 0 < after < 0.85 * before, (before, after)
    folder = run_dir / manifest["stages"][0]["outputs"][0]["model_dir"]
    facts = json.loads((folder / "causal_lm.json").read_text())
    assert (facts["scheme"], facts["head_scheme"]) == ("int4_weight_only", "int8_weight_only")
    saved = load_saved(folder).model
    kinds = {type(m.weight).__name__ for n, m in saved.named_modules()
             if isinstance(m, nn.Linear) and n != "lm_head"}
    assert kinds == {"Int4OpaqueTensor"}, kinds
    assert type(saved.lm_head.weight).__name__ != "Int4OpaqueTensor"
