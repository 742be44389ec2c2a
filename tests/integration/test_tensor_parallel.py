"""Tensor-parallel export of a causal LM: torchrun splits a tiny random Llama's decoder
layers across 2 processes (gloo) and its logits, tokens and per-rank bytes are checked
against one process; impossible splits are one validation line each."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli, write_recipe

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def _recipe(tmp_path: Path, model: Path, export: dict, stages: list[dict] | None = None
            ) -> Path:
    raw = {"name": "tp", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 12}},
           "evaluation": {"generation": {"prompts": 3, "max_new_tokens": 6,
                                         "batch_sizes": [1], "compile": "none"}},
           "stages": [*(stages or []), {"kind": "export", "format": "transformers", **export}],
           "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "tp.yaml", raw)


def test_a_two_way_split_gives_the_one_process_logits_with_half_the_weights_per_rank(
        tmp_path: Path, varied_llama_folder: Path) -> None:
    done = run_cli("run", str(_recipe(tmp_path, varied_llama_folder, {"tensor_parallel": 2})))
    assert done.returncode == 0, done.stderr[-3000:]
    stage = json.loads((tmp_path / "runs/tp/manifest.json").read_text())["stages"][0]
    m = stage["metrics"]
    assert m["tp_processes"] == 2 and m["tp_max_logit_diff"] <= 1e-4
    assert m["tp_greedy_agreement"] == 1.0
    assert m["tp_linear_weight_share"] == 0.5  # measured shard bytes on each rank
    assert len(m["tp_linear_weight_mb_per_rank"]) == 2
    assert m["tp_decode_tok_s_b1"] > 0 and m["tp_decode_tok_s_b1_one_process"] > 0
    folder = tmp_path / "runs/tp" / stage["outputs"][0]["export_dir"]
    assert (folder / "causal_lm/runtime/tensor_parallel.py").is_file()
    assert json.loads((tmp_path / "runs/tp/00-export/tensor_parallel.json").read_text())[
        "tensor_parallel"] == 2


def test_splits_that_cannot_work_are_one_line_each(tmp_path: Path,
                                                   varied_llama_folder: Path) -> None:
    cores = os.cpu_count() or 1
    bad = run_cli("validate", str(_recipe(tmp_path, varied_llama_folder,
                                          {"tensor_parallel": 4 if cores < 4 else cores + 2},
                                          [{"kind": "quantize", "scheme": "int8_weight_only"}])))
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    ranks = 4 if cores < 4 else cores + 2
    assert f"stages.1.tensor_parallel: {ranks} does not divide the model's 2 key-value heads" \
        in bad.stderr
    assert "stages.1.tensor_parallel: splits a float model, and this export follows the " \
           "quantize stage 0; take the model from a stage before it" in bad.stderr
    assert f"stages.1.tensor_parallel: {ranks} processes is more than the {cores} CPU cores" \
        in bad.stderr
    assert all(line.startswith(("error:", "  ", "stages.")) or "tp.yaml" in line
               for line in lines), lines
