"""benchmarks/classifier/plain_pair.py: two files, each timed in fresh processes with
nothing but its runtime, rounds alternating; the ratio by median and by best. Run here on a
tiny ONNX graph (an embedding table, mean over the tokens) so no model is built."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper, save

from benchmarks.classifier import plain_pair


def _tiny_onnx(path: Path, width: int) -> Path:
    table = numpy_helper.from_array(np.random.default_rng(0).random((20000, width),
                                                                    dtype=np.float32), "E")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "input_ids"], ["x"]),
         helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)], "tiny",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", width])], [table])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_two_files_are_timed_in_alternating_fresh_processes(tmp_path: Path, capsys) -> None:
    ours, peer = _tiny_onnx(tmp_path / "ours.onnx", 8), _tiny_onnx(tmp_path / "peer.onnx", 64)
    out = tmp_path / "pair.json"
    code = plain_pair.main([str(ours), str(peer), "--rounds", "3", "--iters", "3",
                            "--warmup", "1", "--batch", "32", "--length", "64", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.count("round ") == 3 and "by the median" in printed
    kept = json.loads(out.read_text())
    assert [len(r) for r in kept["rounds_ms"]] == [3, 3]
    assert all(ms > 0 for r in kept["rounds_ms"] for ms in r)
    ours_ms, peer_ms = kept["spread_ms"]
    assert ours_ms["ms_median"] == pytest.approx(np.median(kept["rounds_ms"][0]), abs=1e-3)
    assert kept["x_faster_median"] == pytest.approx(
        peer_ms["ms_median"] / ours_ms["ms_median"], abs=0.01)
    assert kept["x_faster_best"] == pytest.approx(
        peer_ms["ms_min"] / ours_ms["ms_min"], abs=0.01)


def test_a_missing_file_or_one_alone_exits_2_in_one_line(tmp_path: Path, capsys) -> None:
    ours = _tiny_onnx(tmp_path / "ours.onnx", 8)
    assert plain_pair.main([str(ours), str(tmp_path / "missing.onnx")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'missing.onnx'}: not a .pt2 or .onnx file")
    assert plain_pair.main([str(ours)]) == 2


def test_a_file_its_runtime_cannot_load_exits_1(tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    ours = _tiny_onnx(tmp_path / "ours.onnx", 8)
    assert plain_pair.main([str(ours), str(broken), "--rounds", "1", "--iters", "1"]) == 1
