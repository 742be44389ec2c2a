"""Issue 76 item 4, through the pipeline: a causal LM quantized int4_grouped, then exported
`format: executorch, quantize: 8da4w` (recipes/llm_executorch.yaml's first export, shrunk
to a tiny Llama with SmolLM2's tokenizer and chat template). The stage dequantizes the
grouped layers, writes the .pte, runs it in executorch.runtime against the model that
entered the stage and records greedy agreement and perplexity (the file's are the stage's
figures of record); `min_agreement` above what it reached fails the stage in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cli, write_recipe

pytest.importorskip("executorch", reason="the executorch extra is not installed: "
                    "pip install 'compress-pipeline[executorch]'")

from compress.pipeline.loop import run_recipe  # noqa: E402
from compress.recipe.schema import load_recipe  # noqa: E402

pytestmark = pytest.mark.integration


def shrunk(tmp_path: Path, model: Path, export: dict | None = None) -> Path:
    raw = yaml.safe_load((REPO / "recipes/llm_executorch.yaml").read_text())
    exported = {**raw["stages"][0], **(export or {})}  # et_8da4w
    quantize = {"kind": "quantize", "scheme": "int4_grouped"}
    raw["model"]["source"] = str(model)
    raw["data"].update(max_length=32, eval={"split": "validation", "max_samples": 6})
    raw["evaluation"] = {"generation": {"prompts": 3, "max_new_tokens": 6, "batch_sizes": [1],
                                        "compile": "none", "eager_generate": False,
                                        "cache_len": 64},
                         "latency": {"enabled": False}}
    raw["stages"] = [quantize, exported]
    raw["output_dir"] = str(tmp_path / "runs")
    return write_recipe(tmp_path / "llm_executorch.yaml", raw)


def test_a_grouped_model_exports_to_a_pte_that_proves_itself(
        tmp_path: Path, smol_tokenizer_llama_folder: Path, data_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    monkeypatch.chdir(REPO)  # the recipe's prompts file
    recipe = load_recipe(shrunk(tmp_path, smol_tokenizer_llama_folder), check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 2
    export = manifest["stages"][-1]
    metrics = export["metrics"]
    assert metrics["runtime"] == "executorch" and metrics["executorch_quantize"] == "8da4w"
    assert metrics["executorch_dequantized_layers"] == 2 * 7 + 2  # projections, head, table
    assert metrics["executorch_prompts"] == 3 and metrics["executorch_new_tokens"] == 6
    assert 0 <= metrics["executorch_token_agreement"] <= 1
    assert metrics["executorch_perplexity"] > 1 and metrics["executorch_source_perplexity"] > 1
    change = 100 * (metrics["executorch_perplexity"] / metrics["executorch_source_perplexity"]
                    - 1)
    assert abs(change - metrics["executorch_perplexity_change_pct"]) < 0.01
    assert metrics["executorch_logit_positions"] == 100  # a random model: near-ties, so
    assert 0 <= metrics["executorch_top1_agreement"] <= 1  # the figures only are checked
    # the figures of record are the file's, as the family measures a model: perplexity on
    # the eval split and agreement with the float model's tokens, in executorch.runtime
    quantized = manifest["stages"][0]["metrics"]
    assert metrics["perplexity"] != quantized["perplexity"]
    assert metrics["eval_tokens"] == quantized["eval_tokens"]
    assert metrics["perplexity_delta_pct"] == round(
        100 * (metrics["perplexity"] / quantized["perplexity"] - 1), 3)
    assert 0 <= metrics["agreement"] <= 1 and 0 <= metrics["next_token_agreement"] <= 1
    assert metrics["executorch_decode_tok_s_b1"] > 0 and metrics["executorch_ttft_ms"] > 0
    path = run_dir / export["outputs"][0]["path"]
    assert path.name == "model.pte" and metrics["size_mb"] == round(path.stat().st_size / 1e6, 3)
    parity = json.loads((path.parent / "parity.json").read_text())
    assert parity["executorch_token_agreement"] == metrics["executorch_token_agreement"]
    meta = json.loads((path.parent / "export.json").read_text())
    assert meta["executorch_max_cache_len"] == 64 and meta["chat_template"]


def test_min_agreement_above_what_the_file_reached_fails_in_one_line(
        tmp_path: Path, smol_tokenizer_llama_folder: Path, data_dir: Path, monkeypatch,
        capsys) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    monkeypatch.chdir(REPO)
    recipe = shrunk(tmp_path, smol_tokenizer_llama_folder,
                    {"quantize": "8da8w", "min_agreement": 1.0, "parity_samples": 2})
    code, _, err = cli(monkeypatch, capsys, "run", str(recipe))
    run_dir = tmp_path / "runs" / "llm_executorch"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    metrics = manifest["stages"][-1]["metrics"]
    if metrics["executorch_token_agreement"] == 1.0:  # every token kept: nothing to fail on
        assert code == 0, err
        return
    assert code == 1 and "Traceback" not in err
    assert "greedy token agreement" in err and "parity.json has the figures" in err
