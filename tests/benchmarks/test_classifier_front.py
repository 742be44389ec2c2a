"""benchmarks/classifier/contenders.py: the trials on a search stage's accuracy-latency front
become rows of the peer table (the winner is already the stage's own artifact)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.classifier import contenders as peers_contenders
from compress.runfolder.records import Manifest, StageRecord

CONFIG = {"num_hidden_layers": 3, "hidden_size": 384, "intermediate_size": 1536,
          "num_attention_heads": 12, "model_type": "bert"}


def _trial(tid: str, candidate: str, ms: float, accuracy: float, shape: str | None) -> dict:
    return {"id": tid, "candidate": candidate, "status": "ok", "latency_ms_b8": ms,
            "accuracy": accuracy, "shape": shape, "folder": f"00-search/trials/{tid}",
            "export_dir": "onnx", "file": "model.onnx"}


def test_front_trials_other_than_the_winner_are_rows(tmp_path: Path) -> None:
    stage = tmp_path / "00-search"
    shape = stage / "shapes" / "L3-abcd1234" / "model"
    shape.mkdir(parents=True)
    (shape / "config.json").write_text(json.dumps(CONFIG))
    trials = [_trial("ort_dynamic_int8-1", "ort_dynamic_int8", 30.0, 0.87, None),  # front
              _trial("onnx_fp32-2", "onnx_fp32", 60.0, 0.86, None),  # beaten on both
              _trial("L3-ort_dynamic_int8-3", "ort_dynamic_int8", 12.0, 0.85, "L3"),  # won
              _trial("L3-onnx_fp32-4", "onnx_fp32", 20.0, 0.86, "L3")]  # front
    for t in trials:
        folder = tmp_path / t["folder"] / "onnx"
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(b"x" * 2_000_000)
    (stage / "search.json").write_text(json.dumps({
        "metric": "latency_ms_b8", "winner": "L3-ort_dynamic_int8-3",
        "shapes": [{"label": "L3", "folder": "L3-abcd1234"}], "trials": trials}))
    manifest = Manifest(stages=[StageRecord(index=0, name="search", kind="search",
                                            status="done")])
    items = peers_contenders.search_front_items(tmp_path, manifest)
    assert [i["name"] for i in items] == ["search/L3-onnx_fp32-4", "search/ort_dynamic_int8-1"]
    shaped = items[0]
    assert shaped["folder"] == "00-search/trials/L3-onnx_fp32-4/onnx"
    assert shaped["config"] == {"kind": "export", "format": "onnx"}
    assert shaped["runtime"] == "float32 in ONNX Runtime on shape L3 (search front)"
    assert shaped["size_mb"] == 2.0
    assert shaped["flops"] == peers_contenders.forward_flops(CONFIG)
    assert "from the shape's config" in shaped["flops_source"]


def test_a_pruned_shape_counts_the_flops_pruning_left(tmp_path: Path) -> None:
    """A shape folder with a structure.json (the feed-forward layers halved): its FLOPs at
    8 x 128 are the pruned model's, and the note says where the shapes came from."""
    shape = tmp_path / "shapes" / "L3-ffn50-1234" / "model"
    shape.mkdir(parents=True)
    (shape / "config.json").write_text(json.dumps(CONFIG))
    record = {"shapes": [{"label": "L3-ffn50", "folder": "L3-ffn50-1234"}]}
    full, _ = peers_contenders.shape_flops(tmp_path, record, "L3-ffn50")
    assert full == peers_contenders.forward_flops(CONFIG)
    halved = {f"bert.encoder.layer.{i}.{name}": shape_of for i in range(3)
              for name, shape_of in (("intermediate.dense", [768, 384]),
                                     ("output.dense", [384, 768]))}
    (shape / "structure.json").write_text(json.dumps({"modules": halved,
                                                      "attention_heads": {}}))
    flops, note = peers_contenders.shape_flops(tmp_path, record, "L3-ffn50")
    assert flops == full - 3 * 2 * (2 * 384 * 768) * 8 * 128
    assert "pruned shapes (structure.json)" in note
