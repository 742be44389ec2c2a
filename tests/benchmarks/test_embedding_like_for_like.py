"""benchmarks/embedding/peers.py like for like (issue 72): every library encodes the whole list
in one call with its batch size (sentence-transformers sorts it by length itself), the peers
also run on our student's float weights, the table gives the product and the like-for-like
ratios with their legend, and a peer whose environment lacks its library is left out with
one line saying why. Stand-ins only: no environment is built and nothing is timed for
real."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.embedding import child, items, peers, quality, student, table
from benchmarks.harness.venv import PeerError

TEXTS = [f"text number {i} " + "word " * (i % 7) for i in range(70)]


class RecordingModel:
    """A stand-in SentenceTransformer: records every `encode` call."""

    calls: list[tuple[list[str], int]] = []

    def __init__(self, folder, device=None, backend=None, **kwargs):
        self.folder, self.backend = folder, backend

    def encode(self, texts, batch_size=32, convert_to_numpy=True, show_progress_bar=False):
        RecordingModel.calls.append((list(texts), batch_size))
        return np.ones((len(texts), 4), dtype=np.float32)

    def tokenize(self, texts):
        return {"input_ids": [[1] * 3 for _ in texts]}

    def __call__(self, features):
        return {"sentence_embedding": np.ones((len(features["input_ids"]), 4))}


@pytest.fixture
def stand_in_st(monkeypatch):
    module = types.ModuleType("sentence_transformers")
    module.SentenceTransformer = RecordingModel
    monkeypatch.setitem(sys.modules, "sentence_transformers", module)
    RecordingModel.calls = []
    return RecordingModel


@pytest.mark.parametrize("kind", ["st", "st_onnx", "st_openvino"])
def test_the_child_hands_the_library_the_whole_list_in_one_call(stand_in_st, tmp_path, kind):
    texts_file = tmp_path / "texts.json"
    texts_file.write_text(json.dumps({"texts": TEXTS}))
    spec = {"kind": kind, "folder": str(tmp_path), "file": None, "texts": str(texts_file),
            "batch": 16, "warmup": 2, "passes": 3, "fixed": [8, 128],
            "embeddings": str(tmp_path / "out.npy")}
    figures = child.measure(spec)
    calls = stand_in_st.calls
    # the warm-up: one call on the first warmup x batch texts; then one call per pass on the
    # whole list with the row's batch size; then the fixed shape (8 texts a call)
    assert calls[0] == (TEXTS[:32], 16)
    assert calls[1:4] == [(TEXTS, 16)] * 3
    assert all(len(texts) == 8 and batch == 16 for texts, batch in calls[4:])
    assert len(figures["items_per_s_passes"]) == 3 and figures["calls_per_pass"] == 1
    assert figures["fixed_shape"] == [8, 128] and figures["fixed_model_ms"] is not None
    assert np.load(tmp_path / "out.npy").shape == (70, 4)


def test_a_pass_is_one_call_and_no_warm_up_is_no_call():
    seen = []

    def encode(texts):
        seen.append(len(texts))
        return np.full((len(texts), 2), len(seen), dtype=np.float32)

    figures, first = child.time_whole(encode, TEXTS, 32, 0, 2)
    assert seen == [70, 70] and first[0, 0] == 1.0  # the first timed call's embeddings
    assert len(figures["pass_s"]) == 2 and figures["items_per_s"] > 0


def test_compress_rows_take_the_whole_list_in_batches_in_order(tiny_bert, tmp_path,
                                                               monkeypatch):
    """Our side of one call: the list cut into batches of `batch` in order, each batch in
    passes of similar length, the embeddings in the texts' order."""
    from builders import stand_in_embedding_export
    from transformers import AutoTokenizer

    folder = tmp_path / "export"
    shapes = stand_in_embedding_export(tiny_bert, folder, monkeypatch)
    encode = child.load_compress({"folder": str(folder), "threads": 1, "batch": 4,
                                  "length_buckets": False})
    texts = TEXTS[:10]
    out = encode(texts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert out[:, 0].tolist() == [len(tokenizer(t)["input_ids"]) for t in texts]
    assert [rows for rows, _ in shapes] == [4, 4, 2]  # batches of 4 in order, a pass each


def test_sentence_transformers_flops_are_counted_on_its_length_sorted_batches():
    texts = ["a", "a much longer sentence here", "bb", "a long one too"]
    assert quality.length_sorted(texts) == ["a much longer sentence here", "a long one too",
                                            "bb", "a"]
    assert quality.shape_kind({"kind": "st_onnx"}) == "sorted"
    assert quality.shape_kind({"kind": "fastembed"}) == "order"
    assert quality.shape_kind({"kind": "compress", "length_buckets": True}) == "bucketed"
    assert quality.shape_kind({"kind": "compress", "packed": True}) == "packed"


# ------------------------------------------------------------------ the student's weights


def _st_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "modules.json").write_text("[]")
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def _stage(index, kind, model_dir=None):
    return SimpleNamespace(index=index, kind=kind, finished_ok=True,
                           outputs=[SimpleNamespace(model_dir=model_dir)])


def test_the_search_winner_is_made_from_its_shapes_folder(tmp_path):
    shape = _st_folder(tmp_path / "00-search" / "shapes" / "L4-abcd1234" / "model")
    (tmp_path / "00-search" / "search.json").write_text(json.dumps({
        "winner": "t7", "shapes": [{"label": "L4", "folder": "L4-abcd1234"}],
        "trials": [{"id": "t1", "shape": None}, {"id": "t7", "shape": "L4"}]}))
    assert student.made_from(tmp_path, [_stage(0, "search"), _stage(1, "package")]) == {
        0: shape, 1: None}


def test_a_search_winner_on_the_entering_model_and_a_distilled_model(tmp_path):
    (tmp_path / "01-search").mkdir()
    (tmp_path / "01-search" / "search.json").write_text(json.dumps({
        "winner": "t1", "shapes": [], "trials": [{"id": "t1", "shape": None}]}))
    distilled = _st_folder(tmp_path / "00-distill" / "model")
    quantized = tmp_path / "02-quantize" / "model"
    _st_folder(quantized)
    (quantized / "model.pt2").write_bytes(b"int8")  # not a float folder
    weights = student.made_from(tmp_path, [
        _stage(0, "distill", "00-distill/model"), _stage(1, "search"),
        _stage(2, "quantize", "02-quantize/model"), _stage(3, "export")])
    assert weights == {0: distilled, 1: distilled, 2: distilled, 3: distilled}
    assert student.made_from(tmp_path, [_stage(3, "export")]) == {3: None}


def _args(**kw):
    return SimpleNamespace(**{"no_student": False, "student": None, **kw})


def test_the_student_is_the_float_folder_the_exports_were_made_from(tmp_path):
    shape = _st_folder(tmp_path / "shape")
    ours = [{"name": "search", "weights": "other", "model": str(shape)},
            {"name": "fp32_onnx", "weights": "source"}]
    found, note = peers.find_student(_args(), ours)
    assert found == shape and "the peers run on our student" in note
    assert [i["weights"] for i in ours] == ["student", "source"]
    # exports of the source's own weights: no student, the user's-model peers are like for like
    found, note = peers.find_student(_args(), [{"name": "int8", "weights": "source"}])
    assert found is None and "source model's own weights" in note
    with pytest.raises(Exception, match="not a float sentence-transformers folder"):
        peers.find_student(_args(student=tmp_path), [])


FACTS = {"onnx": {"sentence-transformers": "5.7.0", "fastembed": "0.9.1"},
         "openvino": {"sentence-transformers": "6.2.0", "openvino": "2026.4.1"}}


@pytest.fixture
def stand_in_builds(monkeypatch, tmp_path):
    """ensure_venv answers FACTS (or raises what a test puts there); _build records what it
    was asked to build and answers a built folder."""
    built = []
    facts = {k: dict(v) for k, v in FACTS.items()}

    def ensure(venv, echo):
        answer = facts[venv.name]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def build(venv, run_dir, name, source, sha, spec, echo):
        built.append((name, Path(source), sha))
        return {"folder": str(tmp_path / "built" / name), "files": {
            "fp32": "onnx/model.onnx", "int8": "onnx/model_qint8.onnx"},
            "size_mb": {"fp32": 86.7, "int8": 21.9}}

    monkeypatch.setattr(items, "ensure_venv", ensure)
    monkeypatch.setattr(items, "_build", build)
    return SimpleNamespace(built=built, facts=facts)


def _peer_items(tmp_path, wanted, with_student=True):
    source, shape = tmp_path / "teacher", tmp_path / "student"
    layout = {"pooling": "mean", "normalize": True, "dimensions": 384}
    return items.peer_items(
        tmp_path, source, "sha-teacher",
        {"dataset": str(tmp_path), "split": "train", "column": "sentence"}, layout,
        lambda line: None, wanted,
        (shape, "sha-student", layout) if with_student else None)


def test_like_for_like_rows_are_built_from_the_students_folder(stand_in_builds, tmp_path):
    every = {*items.PEERS, *(items.STUDENT + p for p in items.PEERS)}
    rows, versions, absent = _peer_items(tmp_path, every)
    assert absent == [] and versions == FACTS
    assert [r["name"] for r in rows] == [*items.PEERS, *(items.STUDENT + p for p in items.PEERS)]
    built = {name: (source.name, sha) for name, source, sha in stand_in_builds.built}
    assert built == {"st_onnx": ("teacher", "sha-teacher"),
                     "st_openvino": ("teacher", "sha-teacher"),
                     "student_st_onnx": ("student", "sha-student"),
                     "student_st_openvino": ("student", "sha-student")}
    by_name = {r["name"]: r for r in rows}
    assert by_name["student_st_fp32"]["folder"] == str(tmp_path / "student")
    assert by_name["student_st_onnx_int8"]["folder"].endswith("student_st_onnx")
    assert by_name["student_fastembed_int8"]["kind"] == "fastembed"
    assert by_name["student_st_openvino_int8"]["weights"] == "student"
    assert by_name["st_openvino_int8"]["weights"] == "source"
    assert "on our student" in by_name["student_st_onnx_int8"]["runtime"]


def test_fastembed_and_openvino_rows_are_absent_with_a_reason(stand_in_builds, tmp_path):
    stand_in_builds.facts["onnx"]["fastembed"] = "-"  # an environment made without it
    stand_in_builds.facts["openvino"] = PeerError("pip install openvino failed with exit 1")
    wanted = {"st_fp32", "st_onnx_int8", "st_openvino_int8", "fastembed_fp32",
              "fastembed_int8", "student_fastembed_int8"}
    rows, _, absent = _peer_items(tmp_path, wanted)
    assert [r["name"] for r in rows] == ["st_fp32", "st_onnx_int8"]
    said = {a["name"]: a for a in absent}
    assert set(said) == {"st_openvino_int8", "fastembed_fp32", "fastembed_int8",
                         "student_fastembed_int8"}
    assert "fastembed is not installed in the peers' onnx environment" in \
        said["fastembed_int8"]["reason"] and not said["fastembed_int8"]["failed"]
    assert "pip install openvino failed" in said["st_openvino_int8"]["reason"]
    assert said["st_openvino_int8"]["failed"]  # an environment that could not be made
    rendered = table.render_markdown(table.table_rows(
        [{**r, "rounds": [{"items_per_s": 100.0}]} for r in rows]), {}, absent)
    line = [ln for ln in rendered.splitlines() if ln.startswith("- fastembed_int8: not run:")]
    assert len(line) == 1 and "not installed" in line[0]
    assert "| fastembed_int8 |" not in rendered and "| st_onnx_int8 |" in rendered
    assert "fastembed_int8: not run:" in table.render_text(table.table_rows([]), absent)


# ------------------------------------------------------------------ the two ratios


def _row(name, rates, model_ms=None, fidelity=None, recall=None, **extra):
    return {"name": name, "runtime": name, "rounds": [
        {"items_per_s": r, **({"fixed_model_ms": model_ms} if model_ms else {})}
        for r in rates], "quality": {"fidelity": fidelity, "recall_at_10": recall}, **extra}


def _table():
    return table.table_rows([
        _row("st_onnx_int8", [400.0], 40.0, 0.991, 0.844, peer=True, weights="source"),
        _row("st_openvino_int8", [800.0], 24.0, 0.997, 0.919, peer=True, weights="source"),
        _row("student_st_onnx_int8", [600.0], 27.0, 0.990, 0.840, peer=True,
             weights="student"),
        _row("student_st_openvino_int8", [1000.0], 16.0, 0.995, 0.910, peer=True,
             weights="student"),
        _row("search", [2000.0], 10.0, 0.998, 0.927, weights="student"),
        _row("int8_onnx", [500.0], 30.0, 0.994, 0.880, weights="source"),
    ])


def test_the_product_ratio_is_against_the_users_model_and_like_for_like_the_same_weights():
    found = {(r["row"], r["peer"]): r for r in table.two_ratios(_table())}
    ours = found[("search", "st_onnx_int8")]
    assert ours["product"] == 5.0  # 2000 over the peer on the teacher's 400
    assert ours["like_row"] == "student_st_onnx_int8"
    assert ours["like_texts"] == pytest.approx(2000 / 600, abs=1e-4)
    assert ours["like_model"] == pytest.approx(27 / 10)  # the model alone at 8 x 128
    assert ours["ours_quality"] == "0.9980 / 0.927"
    assert ours["peer_quality"] == "0.9910 / 0.844"
    assert ours["like_quality"] == "0.9900 / 0.840"
    openvino = found[("search", "st_openvino_int8")]
    assert (openvino["product"], openvino["like_texts"]) == (2.5, 2.0)
    # an export of the source's own weights: its like-for-like peer is the product peer
    source = found[("int8_onnx", "st_openvino_int8")]
    assert source["like_row"] == "st_openvino_int8" and source["like_texts"] == 0.625
    assert ("search", "fastembed_int8") not in found  # no fastembed row: no ratio


def test_the_table_prints_both_ratios_with_their_legend():
    rows = _table()
    markdown = table.render_markdown(rows, {"notes": ["like for like: the peers run on x"]})
    assert "## Two ratios: product and like for like" in markdown
    assert ("| row | against | product x (sent/s) | ours: fidelity / recall@10 | peer on the "
            "user's model: fidelity / recall@10 | like-for-like peer row | like-for-like x "
            "texts in (sent/s) | like-for-like x model alone (b8x128) | peer on the same "
            "weights: fidelity / recall@10 |") in markdown
    assert ("| search | st_onnx_int8 | 5.00 | 0.9980 / 0.927 | 0.9910 / 0.844 | "
            "student_st_onnx_int8 | 3.33 | 2.70 | 0.9900 / 0.840 |") in markdown
    assert table.RATIO_LEGEND in markdown
    assert "**product x**" in markdown and "**like-for-like x**" in markdown
    assert "product x ST int8 median" in markdown  # the main table names its ratio too
    text = table.render_text(rows)
    assert "like-for-like x texts in (sent/s)" in text and "student_st_onnx_int8" in text


def test_flops_come_from_each_rows_own_model(tmp_path, monkeypatch):
    """A student's rows (ours and the peers on it) count the student's layers; the
    sentence-transformers rows their length-sorted batches."""
    teacher, shape = tmp_path / "teacher", tmp_path / "student"
    for folder, layers in ((teacher, 6), (shape, 4)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    monkeypatch.setattr(quality, "batch_lengths",
                        lambda source, texts, batch, max_length, sort=False:
                        [[30, 28], [12, 10]] if sort else [[10, 30], [12, 28]])
    monkeypatch.setattr(quality, "pass_flops", lambda folder, shapes: (
        json.loads((folder / "config.json").read_text())["num_hidden_layers"]
        * sum(r * n for r, n in shapes), ""))
    rows = [{"name": "st_onnx_int8", "peer": True, "kind": "st_onnx", "folder": str(teacher)},
            {"name": "student_st_onnx_int8", "peer": True, "kind": "st_onnx",
             "folder": str(shape)},
            {"name": "search", "kind": "compress", "packed": True, "model": str(shape)}]
    notes = quality.assign_flops(rows, teacher, ["a", "b"], 32, 256, (8, 128))
    # sorted: 2 x 30 + 2 x 12 tokens (in order it would be 2 x 30 + 2 x 28); packed: 80
    assert [r["flops"] for r in rows] == [6 * 84, 4 * 84, 4 * 80]
    assert [r["fixed_flops"] for r in rows] == [6 * 1024, 4 * 1024, 4 * 1024]
    assert any("the 4-layer student" in n for n in notes)
    assert any("the user's model" in n for n in notes)
