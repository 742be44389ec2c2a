"""The causal-LM stages through the pipeline, in process, on a tiny random Llama: structured
pruning with recovery, activation-aware scaling before int4, the grouped schemes (float32,
int8 and bfloat16 activations) and MoEfication through the CLI, each run saved, reloaded and
measured, and the recipes each stage refuses refused in one line. The algorithms alone are
tested in tests/unit (test_causal_lm_prune.py, test_causal_lm_equalize.py,
test_causal_lm_grouped.py, test_causal_lm_moefy.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from builders import causal_lm_recipe
from conftest import cli

from compress.cli.main import main
from compress.models.folders import load_saved
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from serve import cpu_features
from serve.causal_lm.runtime import grouped


def test_a_pruned_causal_lm_runs_through_the_pipeline_and_reloads(
        tmp_path: Path, tiny_llama_folder: Path) -> None:
    stages = [{"kind": "prune", "method": "structured", "target": "ffn+heads", "amount": 0.5,
               "recovery": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-3}}]
    path = causal_lm_recipe(tmp_path, tiny_llama_folder, stages, train_samples=64)
    run_dir = run_recipe(load_recipe(path), echo=lambda _: None)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    m = stage["metrics"]
    assert stage["status"] == "done" and m["key_value_heads"] == 1
    assert m["intermediate_size"] == 32 and m["params_after"] < m["params_before"]
    assert m["train_steps"] == 2 and m["perplexity"] > 0
    saved = json.loads((run_dir / stage["outputs"][0]["model_dir"] / "config.json").read_text())
    assert saved["num_key_value_heads"] == 1 and saved["intermediate_size"] == 32


def test_the_quantize_stage_equalizes_then_quantizes_and_reloads(
        tmp_path, tiny_llama_folder, monkeypatch, capsys) -> None:
    stages = [{"kind": "quantize", "scheme": "int4_weight_only", "equalize": True}]
    path = causal_lm_recipe(tmp_path, tiny_llama_folder, stages, train_samples=200)
    run_dir = run_recipe(load_recipe(path, check_sources=True), echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    metrics = manifest["stages"][0]["metrics"]
    layers = json.loads((tiny_llama_folder / "config.json").read_text())["num_hidden_layers"]
    assert metrics["equalize_pairs_seen"] == 3 * layers
    assert 0 < metrics["equalize_error_ratio"] <= 1.0
    assert metrics["perplexity"] > 1 and metrics["scheme"] == "int4_weight_only"
    saved = load_saved(run_dir / manifest["stages"][0]["outputs"][0]["model_dir"]).model
    assert type(saved.model.layers[0].mlp.down_proj.weight).__name__ == "Int4OpaqueTensor"

    dynamic = causal_lm_recipe(tmp_path, tiny_llama_folder,
                               [{"kind": "quantize", "scheme": "int8_dynamic", "equalize": True}])
    code, _, err = cli(monkeypatch, capsys, "validate", str(dynamic))
    assert code == 2 and "stages.0.equalize: activation-aware scaling is for the weight-only" \
        in err, err


def test_the_stage_saves_a_model_that_reloads_and_refuses_bfloat16(
        tmp_path, varied_llama_folder, monkeypatch, capsys) -> None:
    stages = [{"kind": "quantize", "scheme": "int8_grouped"}]
    recipe = load_recipe(causal_lm_recipe(tmp_path, varied_llama_folder, stages),
                         check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    metrics = stage["metrics"]
    assert metrics["activation_dtype"] == "float32" and metrics["head_scheme"] == "int8_grouped"
    assert abs(metrics["perplexity_delta_vs_float_pct"]) < 0.5
    assert metrics["next_token_agreement_decisive"] == 1.0

    saved = load_saved(run_dir / stage["outputs"][0]["model_dir"])
    assert isinstance(saved.model.lm_head, grouped.GroupedLinear)
    # the untied head and the embedding table each count, beside the layers' weights
    config = saved.model.config
    vocab, hidden = config.vocab_size, config.hidden_size
    assert metrics["params"] > 2 * vocab * hidden

    bad = causal_lm_recipe(tmp_path, varied_llama_folder, [
        {"kind": "quantize", "scheme": "int8_grouped", "activations": "bfloat16"}])
    code, _, err = cli(monkeypatch, capsys, "validate", str(bad))
    assert code == 2 and "stages.0.activations: int8_grouped computes in float32" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("mode, scheme", [("int8", "int4_grouped"), ("bf16", "int8_grouped"),
                                          ("int8_where_vnni", "int8_grouped")])
def test_rounded_activations_are_a_saved_opt_in_of_the_grouped_schemes(
        tmp_path, varied_llama_folder, monkeypatch, capsys, mode, scheme) -> None:
    stages = [{"kind": "quantize", "scheme": scheme, "activations": mode}]
    recipe = load_recipe(causal_lm_recipe(tmp_path, varied_llama_folder, stages),
                         check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    vnni = cpu_features.int32_dot_products()
    kept = {"int8_where_vnni": "int8" if vnni else "float32"}.get(mode, mode)
    assert stage["metrics"]["activation_dtype"] == kept

    saved = load_saved(run_dir / stage["outputs"][0]["model_dir"])
    modes = {m.activations for name, m in saved.model.named_modules()
             if isinstance(m, grouped.GroupedLinear) and "embed" not in name}
    assert modes == {kept}  # the body's and the head's, as saved in the folder's facts

    bad = causal_lm_recipe(tmp_path, varied_llama_folder, [
        {"kind": "quantize", "scheme": "int8_weight_only", "activations": mode}])
    code, _, err = cli(monkeypatch, capsys, "validate", str(bad))
    assert code == 2 and f"stages.0.activations: {mode} activations are a mode of the " \
        "grouped schemes" in err
    assert "Traceback" not in err


def test_moefy_runs_through_the_cli_and_saves_a_mixtral_folder(
        tmp_path: Path, tiny_llama_folder: Path, data_dir: Path, monkeypatch, capsys) -> None:
    stages = [{"kind": "moefy", "experts": 4, "top_k": 2, "router_steps": 4,
               "calibration": {"samples": 24, "batch_size": 4},
               "recovery": {"max_steps": 2, "batch_size": 4, "learning_rate": 1e-2}}]
    path = causal_lm_recipe(tmp_path, tiny_llama_folder, stages, train_samples=64,
                            calibration_samples=200)
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    monkeypatch.setattr(sys, "argv", ["compress", "run", str(path)])
    main()  # a run that succeeds returns
    run_dir = tmp_path / "runs" / "tiny_lm"
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    m = stage["metrics"]
    assert stage["status"] == "done"
    assert m["perplexity_dense"] > 0 and m["perplexity_moefied"] > 0
    assert m["perplexity_recovered"] == m["perplexity"] > 0
    # recovery helped: two steps at 1e-2 took perplexity from 31170 to 30728 (-1.4%); a
    # recovery whose optimizer never steps leaves it where moefication left it
    assert m["perplexity_recovered"] < 0.995 * m["perplexity_moefied"]
    assert m["train_steps"] == 2 and len(m["recovery_curve"]) == 2
    assert m["router_steps"] == 4 and [s for s, _ in m["router_curve"]] == [1, 2, 3, 4]
    assert m["mass_selected_best"] >= m["mass_selected_router"] > 0
    ffn = 2 * 3 * 32 * 64  # 2 layers of gate, up and down: half of them run per token
    assert m["params_moe"] - m["params_active"] == ffn // 2
    assert m["params_moe"] == m["params_dense"] + 2 * 4 * 32  # and 2 routers of 4 x 32
    folder = run_dir / stage["outputs"][0]["model_dir"]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded).__name__ == "MixtralForCausalLM"
    assert loaded.config.num_local_experts == 4 and loaded.config.num_experts_per_tok == 2
    from compress.families.causal_lm.folder import load_causal_lm_folder

    again = load_causal_lm_folder(folder)  # as a resumed run or a later stage reads it back
    assert type(again.model).__name__ == "MixtralForCausalLM"
    assert again.causal_lm_facts["moefied"] == {"experts": 4, "top_k": 2}
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(again.model(input_ids=ids).logits,
                                   loaded(input_ids=ids).logits)
    curves = json.loads((run_dir / "00-moefy" / "curves.json").read_text())
    assert len(curves["router"]) == 4 and len(curves["recovery"]) == 2
