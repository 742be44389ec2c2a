"""Pipeline-parallel export of a causal LM: torchrun cuts a tiny random Llama's decoder layers
into 2 pipeline stages (gloo, GPipe micro-batches) and its logits, greedy tokens, per-rank
bytes and throughput at 1, 2 and 4 micro-batches are checked against one process;
impossible splits are one validation line each."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_cli, write_recipe

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")


def _recipe(tmp_path: Path, model: Path, export: dict, stages: list[dict] | None = None
            ) -> Path:
    raw = {"name": "pp", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 12}},
           "evaluation": {"generation": {"prompts": 3, "max_new_tokens": 6,
                                         "batch_sizes": [1], "compile": "none"}},
           "stages": [*(stages or []), {"kind": "export", "format": "transformers", **export}],
           "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "pp.yaml", raw)


def test_two_pipeline_stages_give_the_one_process_logits_and_tokens_with_half_the_layers(
        tmp_path: Path, varied_llama_folder: Path) -> None:
    done = run_cli("run", str(_recipe(tmp_path, varied_llama_folder, {"pipeline_parallel": 2})))
    assert done.returncode == 0, done.stderr[-3000:]
    stage = json.loads((tmp_path / "runs/pp/manifest.json").read_text())["stages"][0]
    m = stage["metrics"]
    assert m["pp_processes"] == 2 and m["pp_schedule"] == "GPipe"
    assert m["pp_layers_per_rank"] == [1, 1]
    assert m["pp_max_logit_diff"] <= 1e-4
    assert m["pp_greedy_agreement"] == 1.0  # alone, and left-padded in batches of 8
    assert m["pp_projection_weight_share"] == 0.5  # measured bytes each rank holds
    assert 0.45 < m["pp_weight_share"] < 0.55  # embedding on one end, the head on the other
    assert len(m["pp_weight_mb_per_rank"]) == 2
    assert all(m[f"pp_generate_tok_s_b8_mb{k}"] > 0 for k in (1, 2, 4))
    assert m["pp_generate_tok_s_b8_one_process"] > 0
    folder = tmp_path / "runs/pp" / stage["outputs"][0]["export_dir"]
    assert (folder / "causal_lm/runtime/pipeline_parallel.py").is_file()
    assert (folder / "causal_lm/runtime/pipeline.py").is_file()
    figures = json.loads((tmp_path / "runs/pp/00-export/pipeline_parallel.json").read_text())
    assert figures["pipeline_parallel"] == 2 and not figures["kv_cache"]
    assert set(figures["generate_tok_s_b8"]) == {"1", "2", "4"}


def test_splits_pipelining_cannot_run_are_one_line_each(tmp_path: Path,
                                                        varied_llama_folder: Path) -> None:
    cores = os.cpu_count() or 1
    ranks = max(4, cores + 2)  # more than the tiny model's 2 layers and than the cores
    bad = run_cli("validate", str(_recipe(
        tmp_path, varied_llama_folder, {"pipeline_parallel": ranks, "tensor_parallel": 2},
        [{"kind": "quantize", "scheme": "int8_weight_only"}])))
    assert bad.returncode == 2
    want = [f"stages.1.pipeline_parallel: {ranks} stages for the model's 2 decoder layers "
            "would leave a stage with none; use 2 or fewer",
            "stages.1.pipeline_parallel: tensor_parallel is set too, and a stage splits "
            "the model one way only; drop one of them",
            "stages.1.pipeline_parallel: recomputes every token with no KV cache, whose "
            "bfloat16 logits part from the cached one-process decoder's at near-ties, and "
            "stage 0 computes in bfloat16",
            f"stages.1.pipeline_parallel: {ranks} processes is more than the {cores} CPU "
            "cores of this machine"]
    for line in want:
        assert line in bad.stderr, (line, bad.stderr)
    lines = bad.stderr.strip().splitlines()
    assert all(line.startswith(("error:", "  ", "stages.")) or "pp.yaml" in line
               for line in lines), lines

    # float32 activations carry (the grouped schemes, or activations: float32), and
    # oversubscribe lets more ranks than cores through
    good = run_cli("validate", str(_recipe(
        tmp_path, varied_llama_folder, {"pipeline_parallel": 2, "oversubscribe": True},
        [{"kind": "quantize", "scheme": "int8_grouped"}])))
    assert good.returncode == 0, good.stderr
