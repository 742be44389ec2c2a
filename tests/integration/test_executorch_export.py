"""Format executorch through the pipeline (issue 76): the session's fine-tuned MiniLM on real
SST-2 as a float `.pte` (within 0.3 pt of the source's accuracy) and as XNNPACK static int8,
and a sentence encoder as both, held to fidelity; each file run by executorch.runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import embedding_recipe, run_in_process
from conftest import write_recipe, write_sentiment_tables

from compress.models.folders import load_export

pytest.importorskip("executorch", reason="the executorch extra is not installed: "
                    "pip install 'compress-pipeline[executorch]'")

EVAL_SENTENCES = 200  # of the 872 (the whole split: measured by hand, docs/stages.md)


@pytest.fixture(scope="module")
def minilm_run(finetuned_minilm: Path, data_dir: Path, tmp_path_factory) -> tuple[Path, dict]:
    """The fine-tuned MiniLM exported as a float .pte and as XNNPACK static int8, each
    checked on 200 SST-2 validation sentences."""
    tmp = tmp_path_factory.mktemp("executorch")
    raw = {
        "name": "minilm_executorch",
        "model": {"source": str(finetuned_minilm)},
        "data": {"source": "stanfordnlp/sst2", "text_column": "sentence",
                 "label_column": "label", "label_names": ["negative", "positive"],
                 "max_length": 128, "train": {"split": "train", "max_samples": 64},
                 "calibration": {"split": "train", "max_samples": 128},
                 "eval": {"split": "validation", "max_samples": EVAL_SENTENCES}},
        "stages": [{"kind": "export", "name": "et_fp32", "format": "executorch"},
                   {"kind": "export", "name": "et_int8", "format": "executorch",
                    "quantize": "static", "calibration": {"samples": 128, "batch_size": 32}}],
        "evaluation": {"batch_size": 64,
                       "latency": {"batch_sizes": [8], "seq_len": 64, "iters": 3,
                                   "warmup": 1, "real_limit": 64}},
        "output_dir": str(tmp / "runs"), "seed": 0,
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMPRESS_DATA_DIR", str(data_dir))
        manifest = run_in_process(write_recipe(tmp / "r.yaml", raw))
    return tmp / "runs" / "minilm_executorch", manifest


def test_float_pte_keeps_the_classifiers_accuracy(minilm_run) -> None:
    run_dir, manifest = minilm_run
    assert [s["status"] for s in manifest["stages"]] == ["done", "done"]
    base = manifest["baseline"]["metrics"]
    fp32 = manifest["stages"][0]["metrics"]
    assert base["accuracy"] >= 0.75  # a fine-tuned model, not a random head
    assert abs(fp32["accuracy"] - base["accuracy"]) * 100 <= 0.3
    assert fp32["parity_samples"] == EVAL_SENTENCES
    assert fp32["parity_max_abs_diff"] <= 1e-4 == fp32["parity_tolerance"]
    assert fp32["parity_argmax_agreement"] >= 0.995
    assert fp32["runtime"] == "executorch" and fp32["executorch_delegated"] >= 6
    meta = json.loads((run_dir / "01-export/executorch/export.json").read_text())
    assert (meta["executorch_max_batch"], meta["executorch_max_seq"]) == (64, 512)


def test_xnnpack_int8_pte_stays_close(minilm_run) -> None:
    _, manifest = minilm_run
    base = manifest["baseline"]["metrics"]
    fp32, int8 = (s["metrics"] for s in manifest["stages"])
    assert int8["executorch_quantize"] == "static" and int8["calibration_samples"] == 128
    assert int8["executorch_dynamic_linears"] == 6  # each layer's FFN down-projection
    assert int8["parity_tolerance"] is None and int8["parity_max_accuracy_drop"] == 1.5
    assert int8["parity_max_abs_diff"] > 0  # it does round
    assert int8["parity_argmax_agreement"] >= 0.95  # 0.986 on all 872 (docs/stages.md)
    assert abs(int8["accuracy"] - base["accuracy"]) * 100 <= 1.5
    # int8 linear weights; the word embeddings (half of MiniLM's bytes) stay float
    assert manifest["stages"][1]["outputs"][0]["bytes"] < \
        0.7 * manifest["stages"][0]["outputs"][0]["bytes"]


def test_pte_in_its_runtime_slices_big_batches_and_refuses_long_inputs(minilm_run) -> None:
    run_dir, _ = minilm_run
    exported = load_export(run_dir / "01-export/executorch", threads=2)
    sentences = ["a gripping, beautiful film", "dull and far too long"] * 40  # 80 > 64
    inputs = exported.tokenizer(sentences, padding=True, return_tensors="pt")
    logits = exported.model(**inputs)
    assert logits.shape == (80, 2)
    assert torch.equal(logits[:2].argmax(1), torch.tensor([1, 0]))
    assert torch.allclose(logits[64:66], logits[:2], atol=1e-5)  # the second slice alike
    ids = torch.full((1, 513), 1000)
    with pytest.raises(RuntimeError, match=r"model\.pte takes sequences of at most 512 "
                       "tokens \\(its export bound\\), got 513; truncate the input"):
        exported.model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_sentence_encoder_pte_float_and_int8(varied_cls_bert_folder: Path, tmp_path: Path
                                            ) -> None:
    """A random encoder whose layers each move its CLS embedding (std 0.2), so a fidelity
    bound can fail: float ~1, XNNPACK int8 held to 0.99."""
    data = write_sentiment_tables(tmp_path / "data", 64, 48)
    stages = [{"kind": "export", "name": "et_fp32", "format": "executorch"},
              {"kind": "export", "name": "et_int8", "format": "executorch",
               "quantize": "static", "calibration": {"samples": 32, "batch_size": 16}}]
    manifest = run_in_process(write_recipe(tmp_path / "r.yaml", embedding_recipe(
        varied_cls_bert_folder, data, tmp_path / "runs", stages)))
    assert [s["status"] for s in manifest["stages"]] == ["done", "done"]
    fp32, int8 = (s["metrics"] for s in manifest["stages"])
    assert fp32["parity_min_fidelity"] == 0.99999 and fp32["parity_fidelity"] >= 0.99999
    assert fp32["parity_max_abs_diff"] < 1e-4
    assert int8["parity_min_fidelity"] == 0.99 and 0.99 <= int8["parity_fidelity"] < 0.99999
    assert int8["executorch_dynamic_linears"] == 2
    meta = json.loads((tmp_path / "runs/tiny_embed_run/01-export/executorch/export.json")
                      .read_text())
    assert meta["outputs"] == ["embedding"] and meta["embedding"]["pooling"] == "cls"
