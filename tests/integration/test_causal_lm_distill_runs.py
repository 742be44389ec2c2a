"""Fine-tuning and layer-dropping distillation of causal LMs, on a tiny random Llama."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import write_recipe

from compress.families.causal_lm.algorithms.distill import drop_layers, pack_texts, recovery
from compress.families.causal_lm.model import StaticDecoder
from compress.models.folders import load_saved
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe


@pytest.fixture(autouse=True)
def _data_dir(monkeypatch) -> None:
    if not os.environ.get("COMPRESS_DATA_DIR"):
        monkeypatch.setenv("COMPRESS_DATA_DIR", str(Path(__file__).parents[3] / "shared/data"))


@pytest.fixture(scope="module")
def llama(tiny_llama_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_llama_folder).eval(),
            AutoTokenizer.from_pretrained(tiny_llama_folder))


def test_packing_joins_texts_with_eos_and_cuts_full_blocks(llama) -> None:
    _, tokenizer = llama
    tokenizer.eos_token = tokenizer.sep_token  # MiniLM's tokenizer has no eos of its own
    texts = ["a good film", "a bad one", "it was fine really"]
    blocks = pack_texts(tokenizer, texts, 4)
    stream = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    assert blocks.shape == (len(stream) // 4, 4)
    assert blocks.flatten().tolist() == stream[:blocks.numel()]
    with pytest.raises(ValueError, match="fewer than one block of 999"):
        pack_texts(tokenizer, texts, 999)


def test_dropping_layers_keeps_the_kept_ones_and_decodes_over_a_static_cache(llama) -> None:
    model, tokenizer = llama
    ids = tokenizer("the film was", return_tensors="pt")["input_ids"]
    same = drop_layers(model, [0, 1])
    with torch.inference_mode():
        assert torch.equal(same(input_ids=ids).logits, model(input_ids=ids).logits)
    one = drop_layers(model, [1]).eval()
    assert one.config.num_hidden_layers == 1 and one.model.layers[0].self_attn.layer_idx == 0
    kept = one.model.layers[0].mlp.up_proj.weight
    assert torch.equal(kept, model.model.layers[1].mlp.up_proj.weight)
    with torch.inference_mode():
        want = one.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                            pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert StaticDecoder(one, 32).generate(ids, 8).tokens == want  # the cache index fits
    assert len(model.model.layers) == 2  # the teacher is untouched
    with pytest.raises(ValueError, match="cannot keep layers"):
        drop_layers(model, [2])


def test_recovery_is_the_share_of_the_gap_closed() -> None:
    assert recovery(10.0, 30.0, 15.0) == 0.75
    assert recovery(10.0, 9.0, 8.0) is None


TRAIN = {"batch_size": 8, "learning_rate": 3e-3, "warmup_ratio": 0.0, "checkpoint_every": 1000}


def _run_tiny(tmp_path: Path, model: Path, train_samples: int, stages: list[dict]) -> Path:
    """The run folder of `stages` on the tiny Llama and SST-2 text (no latency figures)."""
    raw = {"name": "tiny_lm_distill", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "train": {"split": "train", "max_samples": train_samples},
                    "eval": {"split": "validation", "max_samples": 40}},
           "evaluation": {"latency": {"enabled": False},
                          "generation": {"prompts": 2, "max_new_tokens": 4, "compile": "none",
                                         "batch_sizes": [1], "eager_generate": False}},
           "stages": stages, "output_dir": str(tmp_path / "runs")}
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", raw), check_sources=True)
    return run_recipe(recipe, echo=lambda _: None)


def test_finetune_then_distil_a_causal_lm(tmp_path, tiny_llama_folder) -> None:
    run_dir = _run_tiny(tmp_path, tiny_llama_folder, 1500, [
        {"kind": "finetune", "max_steps": 60, **TRAIN},
        {"kind": "distill", "student": {"layers": 1}, "max_steps": 40, "temperature": 1.0,
         "alpha": 0.5, **TRAIN}])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    base = manifest["baseline"]["metrics"]["perplexity"]
    tuned, distilled = (s["metrics"] for s in manifest["stages"])
    assert tuned["train_steps"] == 60 and tuned["perplexity"] < 0.2 * base  # it learnt the text
    assert distilled["teacher_layers"] == 2 and distilled["student_layers"] == 1
    assert distilled["perplexity_teacher"] == pytest.approx(tuned["perplexity"], rel=1e-3)
    # the drop opens a gap; training closes part of it
    assert distilled["perplexity_dropped"] > distilled["perplexity_teacher"]
    assert distilled["perplexity"] < distilled["perplexity_dropped"]
    assert distilled["recovery"] == recovery(distilled["perplexity_teacher"],
                                             distilled["perplexity_dropped"],
                                             distilled["perplexity"])
    student = load_saved(run_dir / manifest["stages"][1]["outputs"][0]["model_dir"])
    assert student.model.config.num_hidden_layers == 1


def test_quantization_aware_distillation_leaves_the_student_on_the_int4_grid(
        tmp_path, tiny_llama_folder) -> None:
    from torch import nn

    from compress.families.causal_lm.algorithms.qat import fake_quantize

    grid = {"scheme": "int4_weight_only", "group_size": 32}
    run_dir = _run_tiny(tmp_path, tiny_llama_folder, 600, [
        {"kind": "finetune", "max_steps": 30, **TRAIN},
        {"kind": "distill", "student": {"layers": 1}, "max_steps": 20, "temperature": 1.0,
         "alpha": 0.5, "quantization_aware": grid, **TRAIN},
        {"kind": "quantize", "scheme": "int4_weight_only", "head_scheme": "float",
         "activations": "float32"}])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    _, distilled, quantized = (s["metrics"] for s in manifest["stages"])
    assert distilled["qat_linears"] == 7 and distilled["qat_scheme"] == "int4_weight_only"
    assert distilled["perplexity"] < distilled["perplexity_dropped"]
    student = load_saved(run_dir / manifest["stages"][1]["outputs"][0]["model_dir"]).model
    linears = [m for n, m in student.named_modules()
               if isinstance(m, nn.Linear) and n != "lm_head"]
    assert len(linears) == 7
    for linear in linears:  # trained, and every weight sits on its int4 group's grid
        snapped = fake_quantize(linear.weight, "int4_weight_only", 32)
        assert torch.allclose(snapped, linear.weight, atol=1e-6)
    assert student.lm_head.weight is student.get_input_embeddings().weight  # head tied, float
    # the int4 model is the distilled one: torchao's int4 loses (almost) nothing
    assert abs(quantized["perplexity_delta_pct"]) < 1.0, quantized["perplexity_delta_pct"]


def test_quantization_aware_is_refused_on_a_classifier_and_under_fsdp(
        tmp_path, tiny_bert, tiny_llama_folder, monkeypatch, capsys) -> None:
    from conftest import cli

    grid = {"scheme": "int4_weight_only", "group_size": 32}
    bert = {"name": "bert", "model": {"source": str(tiny_bert)},
            "data": {"source": "stanfordnlp/sst2", "text_column": "sentence",
                     "label_column": "label"},
            "stages": [{"kind": "distill", "student": {"layers": 1},
                        "quantization_aware": grid}]}
    code, _, err = cli(monkeypatch, capsys, "validate",
                       str(write_recipe(tmp_path / "bert.yaml", bert)))
    assert code == 2 and "stages.0.quantization_aware: only a causal LM takes this option" in err
    lm = {"name": "lm", "model": {"source": str(tiny_llama_folder)},
          "data": {"source": "stanfordnlp/sst2", "text_column": "sentence"},
          "stages": [{"kind": "distill", "student": {"layers": 1}, "parallel": "fsdp",
                      "quantization_aware": {**grid, "group_size": 48}}]}
    code, _, err = cli(monkeypatch, capsys, "validate",
                       str(write_recipe(tmp_path / "lm.yaml", lm)))
    assert code == 2 and "Traceback" not in err
    assert "stages.0.quantization_aware.group_size: 48 is not one of 32" in err
    assert "stages.0.quantization_aware: not with parallel: fsdp" in err
