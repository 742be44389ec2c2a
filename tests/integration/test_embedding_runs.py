"""The embedding family through the pipeline (issue 44): a random BERT sentence-transformers
folder with CLS pooling and no Normalize is distilled to one layer (saved as a
sentence-transformers folder that sentence-transformers itself loads and embeds alike), half
its FFN neurons removed and recovered towards its unpruned self (read back at its new shapes),
quantized (PT2E dynamic int8) and exported (ONNX float, AOTI int8); every model is scored
against the baseline's embeddings (fidelity, recall@10, k-NN accuracy of the labels) and
every export's parity is held to fidelity. Recipe checks refuse what an embedding model does
not take, in one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import embedding_recipe
from conftest import write_recipe, write_sentiment_tables

from compress.errors import UserError
from compress.recipe.schema import load_recipe
from compress.recipe.sources import check_recipe_sources

QAT_STEPS = 10


@pytest.fixture(scope="module")
def embedding_run(cls_bert_folder: Path, tmp_path_factory) -> Path:
    """distill (1 layer) -> structured prune with recovery -> export onnx -> quantize
    dynamic -> export aoti; the run folder."""
    from builders import run_in_process

    tmp = tmp_path_factory.mktemp("embedding_runs")
    data = write_sentiment_tables(tmp / "data", 96, 40)
    stages = [{"kind": "distill", "student": {"layer_indices": [1]}, "epochs": 2,
               "batch_size": 16, "learning_rate": 1e-3},
              {"kind": "prune", "method": "structured", "target": "ffn", "amount": 0.5,
               "recovery": {"epochs": 1, "batch_size": 16, "learning_rate": 1e-3}},
              {"kind": "export", "name": "fp32_onnx", "format": "onnx"},
              {"kind": "quantize", "mode": "dynamic"},
              {"kind": "export", "name": "int8_aoti", "format": "aoti"}]
    recipe = write_recipe(tmp / "embed.yaml", embedding_recipe(cls_bert_folder, data,
                                                               tmp / "runs", stages))
    manifest = run_in_process(recipe)
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 5
    return tmp / "runs" / "tiny_embed_run"


def manifest_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def test_every_model_is_scored_against_the_baselines_embeddings(embedding_run: Path) -> None:
    manifest = manifest_of(embedding_run)
    assert manifest["model"] == {"task": "embedding", "pooling": "cls", "normalize": False,
                                 "dimensions": 32, "max_seq_length": 512,
                                 "matryoshka": False}
    base = manifest["baseline"]["metrics"]
    assert (base["fidelity"], base["recall_at_10"], base["dimensions"]) == (1.0, 1.0, 32)
    assert 0 <= base["knn_accuracy"] <= 1 and base["real_items_per_s_b4"] > 0
    assert (embedding_run / "embedding_reference.safetensors").is_file()
    distill, prune, onnx, quantize, aoti = (s["metrics"] for s in manifest["stages"])
    assert distill["student_layers"] == 1 and distill["teacher_layers"] == 2
    # a random teacher's CLS barely moves when a layer goes; training moved the student,
    # and it stays as close to the teacher as it started
    assert distill["fidelity_to_teacher"] != distill["fidelity_to_teacher_before_training"]
    assert distill["fidelity"] == distill["fidelity_to_teacher"] > 0.999
    assert distill["train_loss"] > 0
    assert distill["params"] < base["params"]
    assert prune["params_after"] < prune["params_before"] == distill["params"]
    assert prune["train_loss"] > 0 and prune["fidelity"] > 0.99
    # the float ONNX file embeds as the pruned student does; the int8 program close to it
    assert onnx["parity_max_abs_diff"] < 1e-4 and onnx["parity_fidelity"] >= 0.99999
    assert onnx["parity_min_fidelity"] == 0.99999
    assert quantize["quant_mode"] == "dynamic"
    assert aoti["parity_tolerance"] is None and aoti["parity_min_fidelity"] == 0.99
    assert aoti["parity_fidelity"] >= 0.99
    for metrics in (distill, prune, onnx, quantize, aoti):
        assert 0 < metrics["fidelity"] <= 1 + 1e-6 and 0 <= metrics["recall_at_10"] <= 1
        assert "latency_ms_b1" in metrics and "latency_ratio_b4" in metrics


def test_exports_say_what_a_server_needs(embedding_run: Path) -> None:
    for stage in ("02-export/onnx", "04-export/aoti"):
        meta = json.loads((embedding_run / stage / "export.json").read_text())
        assert meta["outputs"] == ["embedding"]
        assert meta["embedding"] == {"pooling": "cls", "normalize": False, "dimensions": 32,
                                     "max_seq_length": 512, "matryoshka": False}
    import onnx

    graph = onnx.load(str(embedding_run / "02-export/onnx/model.onnx")).graph
    assert [o.name for o in graph.output] == ["embedding"]


def test_a_stage_model_is_a_sentence_transformers_folder(embedding_run: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    from compress.families.embedding.encoder import load_encoder

    folder = embedding_run / "00-distill" / "model"
    texts = ["a good film", "bad bad bad", "an utterly ordinary evening"]
    theirs = torch.as_tensor(st.SentenceTransformer(str(folder), device="cpu").encode(texts))
    encoder, tokenizer, layout = load_encoder(folder)
    assert (layout.pooling, layout.normalize) == (("cls",), False)
    assert encoder.config.num_hidden_layers == 1
    with torch.no_grad():
        ours = encoder(**tokenizer(texts, padding=True, return_tensors="pt"))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_pruned_model_is_read_back_at_its_shapes(embedding_run: Path) -> None:
    from compress.models.folders import load_export, load_saved

    pruned = load_saved(embedding_run / "01-prune" / "model")
    assert pruned.kind == "embedding" and pruned.structure is not None
    inner = pruned.model.transformer.encoder.layer[0].intermediate.dense
    assert inner.out_features == 32  # half of the random BERT's 64
    exported = load_export(embedding_run / "02-export" / "onnx", 1)
    inputs = pruned.tokenizer(["a good film", "bad bad bad"], padding=True,
                              return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(pruned.model(**inputs), exported.model(**inputs),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("stage", "wanted"), [
    ({"kind": "distill", "student": {"layers": 1}, "temperature": 3.0},
     "stages.0.temperature: not an option of an embedding model's distillation"),
    ({"kind": "export", "format": "onnx", "max_accuracy_drop": 1.0},
     "stages.0.max_accuracy_drop: not a parity bound of this model"),
    ({"kind": "finetune", "epochs": 1}, "stages.0 (finetune): this stage kind does not take "
     "an embedding model yet"),
])
def test_what_an_embedding_model_does_not_take_is_refused(
        stage: dict, wanted: str, cls_bert_folder: Path, tmp_path: Path) -> None:
    data = write_sentiment_tables(tmp_path / "data", 16, 8)
    path = write_recipe(tmp_path / "r.yaml",
                        embedding_recipe(cls_bert_folder, data, tmp_path / "runs", [stage]))
    with pytest.raises(UserError) as raised:
        check_recipe_sources(load_recipe(path))
    assert any(m.startswith(wanted) for m in raised.value.messages), raised.value.messages


def test_a_classifier_export_refuses_min_fidelity(cls_bert_folder: Path, tmp_path: Path) -> None:
    data = write_sentiment_tables(tmp_path / "data", 16, 8)
    raw = embedding_recipe(cls_bert_folder, data, tmp_path / "runs",
                           [{"kind": "export", "format": "onnx", "min_fidelity": 0.9}])
    raw["model"]["task"] = "classification"
    with pytest.raises(UserError) as raised:
        check_recipe_sources(load_recipe(write_recipe(tmp_path / "r.yaml", raw)))
    assert any(m.startswith("stages.0.min_fidelity: not a parity bound") for m in
               raised.value.messages), raised.value.messages


def test_qat_trains_towards_the_float_embeddings(varied_cls_bert_folder: Path,
                                                 tmp_path: Path) -> None:
    """QAT on an embedding model reads no labels (the table has none here): on a model whose
    every layer moves its embeddings, training moves the weights and the fake-quantized
    encoder's distance to the float model's embeddings (|s - t|^2 + 1 - cos on the first
    train batch) falls well below that of the same fake-quantized encoder untrained (the
    no-training control), and the int8 result keeps fidelity > 0.99 (through the reference
    int8 ops: see varied_int8_run)."""
    from builders import run_in_process

    data = write_sentiment_tables(tmp_path / "data", 48, 32)
    # lr 1e-5: on this model Adam at 1e-4 overshoots (the third step's loss jumps 4x, at 1e-3
    # 200x); 3e-6 to 2e-5 all bring the loss down by 15-35% in 10 steps
    stages = [{"kind": "quantize", "mode": "qat", "compile": False,
               "qat": {"max_steps": QAT_STEPS, "batch_size": 16, "learning_rate": 1e-5},
               "calibration": {"samples": 16, "batch_size": 16}}]
    raw = embedding_recipe(varied_cls_bert_folder, data, tmp_path / "runs", stages)
    raw["evaluation"]["latency"]["enabled"] = False
    manifest = run_in_process(write_recipe(tmp_path / "qat.yaml", raw))
    stage = manifest["stages"][0]
    metrics = stage["metrics"]
    assert stage["status"] == "done" and metrics["qat_steps"] == QAT_STEPS
    assert metrics["quant_mode"] == "qat" and metrics["fidelity"] > 0.99
    assert metrics["qat_weight_change"] > 1e-6, metrics["qat_weight_change"]
    before, after = metrics["qat_loss_before_training"], metrics["qat_loss_after_training"]
    # 15-35% lower after 10 steps (the comment above); 18% on a 2-core Emerald Rapids
    assert after < 0.85 * before, (before, after)
    assert (tmp_path / "runs/tiny_embed_run/00-quantize/model/model.pt2").is_file()


@pytest.fixture(scope="module")
def varied_int8_run(varied_cls_bert_folder: Path, tmp_path_factory) -> Path:
    """The varied CLS BERT through one stage, quantize dynamic int8, scored through the
    converted graph's reference int8 ops (no Inductor: its u8 x s8 kernels without VNNI,
    as on an AVX2-only CPU, lose 2% fidelity on this model to saturated sums); the folder."""
    from builders import run_in_process

    tmp = tmp_path_factory.mktemp("varied_int8")
    data = write_sentiment_tables(tmp / "data", 16, 40)
    raw = embedding_recipe(varied_cls_bert_folder, data, tmp / "runs",
                           [{"kind": "quantize", "mode": "dynamic", "compile": False}])
    raw["evaluation"]["latency"]["enabled"] = False
    manifest = run_in_process(write_recipe(tmp / "int8.yaml", raw))
    assert manifest["stages"][0]["status"] == "done"
    return tmp


def coarse_grid(encoder: torch.nn.Module, levels: int = 8) -> torch.nn.Module:
    """A copy of `encoder` whose Linear weights are rounded to `levels` steps of one scale
    per matrix (3 bits): a deliberately broken quantizer."""
    import copy

    broken = copy.deepcopy(encoder)
    for module in broken.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.data
            scale = weight.abs().max() / (levels // 2 - 1)
            module.weight.data = (weight / scale).round().clamp(-levels // 2, levels // 2 - 1) \
                * scale
    return broken


def test_int8_embeds_far_closer_to_float_than_a_broken_model(
        varied_int8_run: Path, varied_cls_bert_folder: Path) -> None:
    """On a model whose every layer moves its CLS embedding, dynamic int8's distance from the
    float embeddings (1 - fidelity, as the stage records it) is under a twentieth of that of
    two broken models scored on the same eval texts against the same reference: the float
    model with its first layer dropped, and its weights rounded to a 3-bit grid."""
    import copy
    import csv

    from safetensors.torch import load_file

    from compress.data.datasets import Examples
    from compress.families.embedding.encoder import load_encoder
    from compress.families.embedding.family import REFERENCE, embed
    from compress.families.embedding.measures import fidelity

    run = varied_int8_run / "runs" / "tiny_embed_run"
    int8 = manifest_of(run)["stages"][0]["metrics"]["fidelity"]
    reference = load_file(str(run / REFERENCE))["embeddings"]
    with (varied_int8_run / "data" / "validation.tsv").open() as table:
        texts = [row["sentence"] for row in csv.DictReader(table, delimiter="\t")]
    encoder, tokenizer, _ = load_encoder(varied_cls_bert_folder)
    examples = Examples(labels=[], texts=texts)
    # the controls are scored on the texts the stage was: the float model gives the reference
    torch.testing.assert_close(embed(encoder, examples, 16, tokenizer, 32), reference)
    dropped = copy.deepcopy(encoder)
    dropped.transformer.encoder.layer = dropped.transformer.encoder.layer[1:]
    for name, broken in (("layer 0 dropped", dropped), ("3-bit grid", coarse_grid(encoder))):
        score = fidelity(embed(broken, examples, 16, tokenizer, 32), reference)["fidelity"]
        assert 1 - int8 < (1 - score) / 20, (name, int8, score)
    assert int8 > 0.99
