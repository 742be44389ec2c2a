"""benchmarks/classifier/openvino*.py: the OpenVINO peer batches the eval sentences exactly as
compress's harness does, summarizes timings the same way, calibrates on the calibration
split (never on the eval split), and a failed OpenVINO build becomes a row that says so."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
from conftest import minilm_folder
from transformers import AutoTokenizer

from benchmarks.classifier import openvino as peers_openvino
from benchmarks.classifier import openvino_child as child
from compress.data.datasets import DataBundle, Examples, iterate
from compress.measure.latency import summarize

TEXTS = ["a gripping film", "dull", "an utterly charming , warm and very funny movie that "
         "nobody should miss", "bad", "fine", "the plot never goes anywhere at all", "ok",
         "wonderful", "terrible acting throughout the whole long evening", "meh", "great"]


def test_batches_are_padded_as_compress_pads_them() -> None:
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    examples = Examples(labels=[0] * len(TEXTS), texts=TEXTS)
    ours = [inputs for inputs, _ in iterate(examples, 4, tokenizer, 12)]
    theirs = child.padded_batches(tokenizer, TEXTS, 4, 12)
    assert [b["input_ids"].shape for b in theirs] == [tuple(b["input_ids"].shape) for b in ours]
    assert [b["input_ids"].shape[0] for b in theirs] == [4, 4, 3]
    for mine, other in zip(ours, theirs, strict=True):
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            assert (mine[name].numpy() == other[name]).all()
            assert other[name].dtype.name == "int64"


def test_timings_summarize_as_compress_does() -> None:
    samples = [9.0, 1.0, 5.0, 3.0, 7.0, 100.0, 2.0]
    median, p90 = child.summary(samples)
    ours = summarize(samples)
    assert (median, p90) == (ours["p50"], ours["p90"]) == (statistics.median(samples), 9.0)


def test_calibration_comes_from_the_calibration_split() -> None:
    data = DataBundle("text", {"eval": Examples(labels=[1, 0], texts=["e1", "e2"]),
                               "calibration": Examples(labels=[0] * 400,
                                                       texts=[f"c{i}" for i in range(400)])},
                      ["negative", "positive"], {}, 64)
    recipe = type("R", (), {"evaluation": type("E", (), {"batch_size": 16})()})()
    made = peers_openvino.eval_file(recipe, data)
    assert made["texts"] == ["e1", "e2"] and made["labels"] == [1, 0]
    assert made["calibration"] == [f"c{i}" for i in range(peers_openvino.CALIBRATION_SAMPLES)]
    assert made["max_length"] == 64 and made["batch_size"] == 16
    del data.splits["calibration"]
    with pytest.raises(peers_openvino.PeerError, match="no calibration split"):
        peers_openvino.eval_file(recipe, data)


def test_a_failed_build_is_a_row_with_the_reason(tmp_path: Path, monkeypatch) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / peers_openvino.READY).write_text(json.dumps({"openvino": "0", "nncf": "0"}))
    (venv / "bin" / "python").symlink_to(sys.executable)  # a Python without OpenVINO
    run = tmp_path / "run"
    fp32 = run / "peers" / "optimum_fp32"
    fp32.mkdir(parents=True)
    monkeypatch.setattr(peers_openvino, "load_data", lambda *_: DataBundle(
        "text", {"eval": Examples(labels=[0], texts=["x"]),
                 "calibration": Examples(labels=[0], texts=["c"])}, ["a", "b"], {}, 8))
    monkeypatch.setattr(peers_openvino, "resolve_data", lambda _: None)
    recipe_like = type("R", (), {"data": type("D", (), {"source": "s"})(),
                                 "evaluation": type("E", (), {"batch_size": 8})()})()
    monkeypatch.setattr(peers_openvino, "full_recipe", lambda _: recipe_like)
    item = peers_openvino.openvino_item(run, fp32, "sha", venv, 1e9, "note", lambda _: None)
    assert item["peer"] and item["name"] == "openvino_int8"
    assert "ModuleNotFoundError" in item["error"] and "nncf" in item["error"]
    assert not (run / "peers" / "openvino_int8").exists()  # nothing half-written
    assert not list((run / "peers").glob(".build-ov-*"))
