"""The causal-LM model family through the pipeline, on a tiny random Llama (seconds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from builders import SST2, causal_lm_recipe
from conftest import cli, write_recipe

from compress.families.causal_lm.model import quantize_weights
from compress.models.folders import load_saved
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe


@pytest.fixture(autouse=True)
def _data_dir(monkeypatch) -> None:
    if not os.environ.get("COMPRESS_DATA_DIR"):
        monkeypatch.setenv("COMPRESS_DATA_DIR", str(Path(__file__).parents[3] / "shared/data"))


def test_a_causal_lm_runs_quantize_and_compile_with_its_own_figures(
        tmp_path, tiny_llama_folder) -> None:
    stages = [{"kind": "quantize", "scheme": "int8_weight_only", "activations": "float32"},
              {"kind": "compile", "mode": "default"}]
    recipe = load_recipe(causal_lm_recipe(tmp_path, tiny_llama_folder, stages), check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"]["task"] == "causal-lm"
    assert manifest["model"]["weights"] == "torch.float32"
    base = manifest["baseline"]["metrics"]
    # a random model over MiniLM's 30522 tokens is near uniform
    assert 0.5 * 30522 < base["perplexity"] < 2 * 30522 and base["eval_tokens"] > 12
    for key in ("decode_tok_s_b1", "decode_tok_s_b2", "ttft_ms", "eager_generate_tok_s_b1",
                "peak_rss_mb"):
        assert base[key] > 0, key
    reference = json.loads((run_dir / "causal_lm_reference.json").read_text())
    assert [len(t) for t in reference["tokens"]] == [6, 6, 6]
    assert [len(m) for m in reference["margins"]] == [6, 6, 6]
    # top-1 minus top-2 of the float model's logits at each greedy step: positive (the
    # greedy token led), and different from step to step (not a constant or a copy)
    margins = [m for row in reference["margins"] for m in row]
    assert all(m > 0 for m in margins) and len(set(margins)) > len(margins) // 2

    quant, compiled = (s["metrics"] for s in manifest["stages"])
    assert quant["scheme"] == "int8_weight_only" and quant["activation_dtype"] == "float32"
    # free-running greedy agreement: 1.0 measured (int8 weights keep every step's choice
    # here); a broken quantizer's tokens agree by chance only (1 in 30522), and agreement
    # is below 1 exactly when some prompt left the reference (its margin then recorded)
    assert 0.5 <= quant["agreement"] <= 1, quant
    assert (quant["agreement"] < 1) == (quant["divergence_margin_median"] is not None), quant
    assert abs(quant["perplexity_delta_vs_float_pct"]) < 2
    assert quant["perplexity_delta_pct"] == quant["perplexity_delta_vs_float_pct"]
    assert 0.5 <= quant["next_token_agreement"] <= 1 and 0 <= quant["agreement"] <= 1
    assert 0.5 <= quant["next_token_agreement_decisive"] <= 1
    assert "divergence_margin_median" in quant
    assert quant["input_decode_tok_s_b1"] > 0 and quant["decode_speedup_b1"] > 0
    assert quant["decode_vs_float_eager_generate"] > 0
    assert compiled["decode_compile"] == "default" and compiled["compile_s"] > 0

    folder = run_dir / manifest["stages"][0]["outputs"][0]["model_dir"]
    assert json.loads((folder / "causal_lm.json").read_text())["scheme"] == "int8_weight_only"
    saved = load_saved(folder)  # rebuilt from config + torchao scheme + state dict
    float_model = load_saved(run_dir / manifest["stages"][1]["outputs"][0]["model_dir"])
    assert saved.causal_lm_facts["scheme"] == "int8_weight_only"
    assert json.loads((run_dir / manifest["stages"][1]["outputs"][0]["model_dir"]
                       / "causal_lm.json").read_text())["compile"] == "default"
    ids = torch.tensor([[101, 1996, 2143, 2001]])
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_folder).eval()
    quantize_weights(fresh, "int8_weight_only")
    with torch.inference_mode():
        want = fresh(input_ids=ids).logits
        assert torch.equal(saved.model(input_ids=ids).logits, want)
        assert torch.equal(float_model.model(input_ids=ids).logits, want)

    again = run_recipe(recipe, echo=lambda _: None)  # every stage cached
    statuses = [s["status"] for s in json.loads((again / "manifest.json").read_text())["stages"]]
    assert statuses == ["cached", "cached"]


@pytest.mark.parametrize(("stages", "extra", "line"), [
    ([{"kind": "quantize", "mode": "static"}], {},
     "stages.0.mode: static is a PT2E mode for classifiers; a causal LM takes `mode: qat`"),
    ([{"kind": "quantize"}], {}, "stages.0.scheme: a causal LM needs a weight scheme"),
    ([{"kind": "prune", "amount": 0.5}], {},
     "stages.0.method: a causal LM is pruned with method: structured"),
    ([{"kind": "prune", "method": "structured", "target": "channels"}], {},
     "stages.0.target: channels are a CNN's; a causal LM takes ffn, heads or ffn+heads"),
    ([{"kind": "compile", "dynamic": True}], {},
     "stages.0.dynamic: a causal LM's decode step has static shapes"),
    ([{"kind": "distill", "student": {"layers": 1}, "layerwise": {}}], {},
     "stages.0.layerwise: a classifier's option; a causal LM's student is distilled on "
     "next-token distributions"),
    ([], {"model_task": "classification"}, None),
])
def test_a_classifier_option_on_a_causal_lm_is_one_line(
        tmp_path, tiny_llama_folder, monkeypatch, capsys, stages, extra, line) -> None:
    path = causal_lm_recipe(tmp_path, tiny_llama_folder, stages)
    if extra:  # the reverse: the same Llama declared a classifier takes no LM options
        raw = path.read_text().replace("model:\n", "model:\n  task: classification\n")
        path.write_text(raw)
        line = "evaluation.generation: only a causal LM takes this option"
    code, out, err = cli(monkeypatch, capsys, "validate", str(path))
    assert code == 2 and line in err, err
    assert "Traceback" not in err


def test_a_weight_scheme_on_a_classifier_and_labels_on_a_causal_lm_are_refused(
        tmp_path, tiny_bert, tiny_llama_folder, monkeypatch, capsys) -> None:
    raw = {"name": "bert", "model": {"source": str(tiny_bert)},
           "data": {"source": SST2, "text_column": "sentence"},
           "stages": [{"kind": "quantize", "scheme": "int4_weight_only"}]}
    code, _, err = cli(monkeypatch, capsys, "validate",
                       str(write_recipe(tmp_path / "bert.yaml", raw)))
    assert code == 2
    assert "stages.0.scheme: only a causal LM takes this option" in err

    lm = causal_lm_recipe(tmp_path, tiny_llama_folder, [])
    lm.write_text(lm.read_text().replace("  text_column: sentence",
                                         "  text_column: sentence\n  label_column: label"))
    code, _, err = cli(monkeypatch, capsys, "validate", str(lm))
    assert code == 2
    assert "data.label_column: only a classifier takes this option" in err


def test_prompts_come_from_a_file_through_the_chat_template(tmp_path) -> None:
    from compress.errors import UserError
    from compress.families.causal_lm.family import read_prompts

    (tmp_path / "p.txt").write_text("Name a colour.\n\nWhat is 2 + 2?\n")
    assert read_prompts(str(tmp_path / "p.txt")) == ["Name a colour.", "What is 2 + 2?"]
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "yo"}]}\n{"x": 1}\n')
    with pytest.raises(UserError, match=r"p.jsonl:3: not a JSON object with `prompt`"):
        read_prompts(str(tmp_path / "p.jsonl"))
