"""benchmarks/classifier (issue 72): the winner's own student weights are found through a
fake run folder's manifest (a search winner's shape, or the nearest model folder up a chain
of stages), the peers are scheduled on the teacher and on the student (Optimum's int8 at
each --optimize level, OpenVINO's static int8), Optimum's levels are exported and
quantized one by one, and the table prints the product and the like-for-like ratio with a
legend (stand-ins for the peers' tools: nothing is built or timed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.classifier import contenders, openvino, optimum
from benchmarks.classifier import peers as classifier_peers
from benchmarks.classifier import table as peers_table
from compress.runfolder.records import Artifact, Manifest, StageRecord

CONFIG = {"num_hidden_layers": 3, "hidden_size": 384, "intermediate_size": 1536,
          "num_attention_heads": 12, "model_type": "bert",
          "id2label": {"0": "negative", "1": "positive"}}
TEACHER_SHA = "t" * 64


def model_folder(folder: Path, layers: int = 3, pruned: bool = False,
                 quantized: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    (folder / "model.safetensors").write_bytes(f"weights of {folder.parent.name}".encode())
    if pruned:
        (folder / "structure.json").write_text(json.dumps({"modules": {}}))
    if quantized:
        (folder / "model.pt2").write_bytes(b"pt2")
    return folder


def stage(index: int, name: str, kind: str, takes: str | None, makes: str,
          model_dir: str | None = None, export_dir: str | None = None) -> StageRecord:
    return StageRecord(
        index=index, name=name, kind=kind, status="done",
        inputs=[Artifact(format="model", sha256=takes)] if takes else [],
        outputs=[Artifact(format="model", sha256=makes, model_dir=model_dir,
                          export_dir=export_dir, bytes=1000)],
        metrics={"accuracy": 0.87})


def search_run(tmp_path: Path) -> tuple[Path, Manifest]:
    """finetune (the teacher, 6 layers), then a search whose winner was built on shape L3
    (distilled); L3-direct is fine-tuned on the labels alone."""
    run = tmp_path / "run"
    model_folder(run / "00-finetune" / "model", layers=6)
    search = run / "01-search"
    model_folder(search / "shapes" / "L3-abcd1234" / "model")
    model_folder(search / "shapes" / "L3-direct-ef015678" / "model")
    model_folder(search / "shapes" / "L3-ffn50-99887766" / "model", pruned=True)
    (search / "search.json").write_text(json.dumps({
        "metric": "latency_ms_b8", "winner": "L3-pt2e_static_aoti-1",
        "max_accuracy_drop": 1.0,
        "shapes": [{"label": "L3", "folder": "L3-abcd1234",
                    "shape": {"layers": 3, "teacher": True}},
                   {"label": "L3-direct", "folder": "L3-direct-ef015678",
                    "shape": {"layers": 3, "teacher": False}},
                   {"label": "L3-ffn50", "folder": "L3-ffn50-99887766",
                    "shape": {"layers": 3, "ffn": 0.5, "teacher": True}}],
        "trials": [{"id": "L3-pt2e_static_aoti-1", "candidate": "pt2e_static_aoti",
                    "status": "ok", "shape": "L3", "latency_ms_b8": 8.0, "accuracy": 0.866,
                    "folder": "01-search/trials/L3-pt2e_static_aoti-1", "export_dir": "aoti",
                    "file": "model.aoti.pt2"}]}))
    manifest = Manifest(
        recipe={"stages": [{"kind": "finetune"}, {"kind": "search"}]},
        labels={"names": ["negative", "positive"]},
        stages=[stage(0, "finetune", "finetune", None, TEACHER_SHA, "00-finetune/model"),
                stage(1, "search", "search", TEACHER_SHA, "w" * 64,
                      export_dir="01-search/trials/L3-pt2e_static_aoti-1/aoti")])
    return run, manifest


def test_a_search_winner_s_student_is_the_model_of_the_shape_its_trial_was_built_on(
        tmp_path: Path) -> None:
    run, manifest = search_run(tmp_path)
    assert contenders.winner_index(run, manifest) == 1
    student = contenders.student_source(run, manifest)
    assert student["folder"] == run / "01-search" / "shapes" / "L3-abcd1234" / "model"
    assert student["label"] == "search/L3"
    assert student["how"] == "search's winner L3-pt2e_static_aoti-1 was built on shape L3: " \
        "01-search/shapes/L3-abcd1234/model"
    assert student["flops"] == contenders.forward_flops(CONFIG)
    # a winner on a pruned shape has no folder a peer can export: none, and why
    record = json.loads((run / "01-search" / "search.json").read_text())
    record["trials"][0]["shape"] = "L3-ffn50"
    (run / "01-search" / "search.json").write_text(json.dumps(record))
    assert "pruned (structure.json)" in contenders.student_source(run, manifest)["none"]
    # a winner on the entering model (no shape): the teacher's weights, like for like is
    # the product ratio
    record["trials"][0]["shape"] = None
    (run / "01-search" / "search.json").write_text(json.dumps(record))
    assert "the teacher's own weights" in contenders.student_source(run, manifest)["none"]


def test_another_chain_s_student_is_the_nearest_model_folder_up_its_producers(
        tmp_path: Path) -> None:
    """finetune -> distill -> quantize (model.pt2) -> export: the winner (the last
    artifact) was made from the distilled folder; with a prune in between, none."""
    run = tmp_path / "run"
    model_folder(run / "00-finetune" / "model", layers=6)
    model_folder(run / "01-distill" / "model", layers=3)
    model_folder(run / "02-quantize" / "model", quantized=True)
    (run / "03-export" / "onnx").mkdir(parents=True)
    stages = [stage(0, "finetune", "finetune", None, TEACHER_SHA, "00-finetune/model"),
              stage(1, "distill", "distill", TEACHER_SHA, "d" * 64, "01-distill/model"),
              stage(2, "quantize", "quantize", "d" * 64, "q" * 64, "02-quantize/model"),
              stage(3, "export", "export", "q" * 64, "e" * 64, export_dir="03-export/onnx")]
    manifest = Manifest(recipe={"stages": [{"kind": s.kind} for s in stages]}, stages=stages)
    (run / "manifest.json").write_text(manifest.model_dump_json())
    assert contenders.winner_index(run, manifest) == 3
    student = contenders.student_source(run, manifest)
    assert student["folder"] == run / "01-distill" / "model" and student["label"] == "distill"
    assert student["sha256"] == "d" * 64
    assert student["how"] == "the winner (export) was made from distill's 01-distill/model"
    (run / "01-distill" / "model" / "structure.json").write_text("{}")  # pruned instead
    assert "pruned (structure.json)" in contenders.student_source(run, manifest)["none"]
    # finetune -> quantize -> export: made from the teacher itself
    short = Manifest(recipe={"stages": [{"kind": k} for k in ("finetune", "quantize", "export")]},
                     stages=[stages[0], stage(1, "quantize", "quantize", TEACHER_SHA, "q" * 64,
                                              "02-quantize/model"),
                             stage(2, "export", "export", "q" * 64, "e" * 64,
                                   export_dir="03-export/onnx")])
    (run / "manifest.json").write_text(short.model_dump_json())
    assert "the teacher's own weights" in contenders.student_source(run, short)["none"]


def stand_in_peers(monkeypatch, tmp_path: Path) -> list[dict]:
    """Optimum's and OpenVINO's builds replaced by folders with a model.onnx; each
    Optimum build call recorded."""
    calls: list[dict] = []

    def build_peers(run_dir, source, sha, labels, venv, facts, echo, under="peers",
                    levels=optimum.LEVELS, failed=None):
        calls.append({"source": source, "sha": sha, "under": under, "levels": list(levels),
                      "labels": labels})
        folders = {}
        for name in [optimum.FP32, *(optimum.int8_name(lv) for lv in levels)]:
            folder = run_dir / under / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "model.onnx").write_bytes(b"x" * 1000)
            folders[name] = folder
        return folders

    def build_openvino(run_dir, fp32, sha, recipe, venv, echo, under="peers"):
        folder = run_dir / under / openvino.NAME
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "build.json").write_text(json.dumps({"size_mb": 23.6, "source": str(fp32)}))
        return folder

    monkeypatch.setattr(optimum, "build_peers", build_peers)
    monkeypatch.setenv(optimum.OPTIMUM.variable, str(tmp_path / "venv"))
    monkeypatch.setattr(contenders, "ensure_venv", lambda *a: {"optimum-onnx": "0.1.0"})
    monkeypatch.setattr(openvino, "ensure_openvino", lambda venv, echo: {"openvino": "1"})
    monkeypatch.setattr(openvino, "full_recipe", lambda run_dir: None)
    monkeypatch.setattr(openvino, "build", build_openvino)
    return calls


def test_optimum_at_each_level_and_openvino_run_on_the_teacher_and_the_student(
        tmp_path: Path, monkeypatch) -> None:
    run, manifest = search_run(tmp_path)
    calls = stand_in_peers(monkeypatch, tmp_path)
    items, facts, student = contenders.peer_items(run, manifest, lambda _: None)
    by_name = {i["name"]: i for i in items}
    assert list(by_name) == [
        "optimum_fp32", "optimum_int8_O1", "optimum_int8_O2", "optimum_int8_O3",
        "openvino_int8", "search/L3/optimum_int8_O1", "search/L3/optimum_int8_O2",
        "search/L3/optimum_int8_O3", "search/L3/openvino_int8",
        "search/L3-direct/optimum_int8_O1", "search/L3-direct/optimum_int8_O2",
        "search/L3-direct/optimum_int8_O3"]  # the pruned shape: no peer exports it
    assert [(c["source"].relative_to(run).as_posix(), c["under"], c["levels"]) for c in calls] \
        == [("00-finetune/model", "peers", ["O1", "O2", "O3"]),
            ("01-search/shapes/L3-abcd1234/model", "peers/search-L3", ["O1", "O2", "O3"]),
            ("01-search/shapes/L3-direct-ef015678/model", "peers/search-L3-direct",
             ["O1", "O2", "O3"])]
    assert calls[0]["sha"] == TEACHER_SHA and calls[0]["labels"] == ["negative", "positive"]
    sides = {name: (i.get("peer_kind"), i.get("peer_of"), i.get("level"))
             for name, i in by_name.items()}
    assert sides["optimum_int8_O2"] == ("optimum_int8", "teacher", "O2")
    assert sides["openvino_int8"] == ("openvino_int8", "teacher", None)
    assert sides["search/L3/optimum_int8_O3"] == ("optimum_int8", "student", "O3")
    assert sides["search/L3/openvino_int8"] == ("openvino_int8", "student", None)
    assert sides["search/L3-direct/optimum_int8_O1"] == ("optimum_int8", "labels alone", "O1")
    assert sides["optimum_fp32"] == ("optimum_fp32", "teacher", None)
    assert "--optimize O2" in by_name["optimum_int8_O2"]["runtime"]
    assert "of the winner's student weights" in by_name["search/L3/openvino_int8"]["runtime"]
    # OpenVINO quantizes each model's own plain fp32 export
    assert by_name["openvino_int8"]["source"] == str(run / "peers" / "optimum_fp32")
    assert by_name["search/L3/openvino_int8"]["source"] == \
        str(run / "peers" / "search-L3" / "optimum_fp32")
    assert by_name["search/L3/openvino_int8"]["folder"] == \
        str(run / "peers" / "search-L3" / "openvino_int8")
    assert by_name["search/L3/optimum_int8_O1"]["folder"] == \
        "peers/search-L3/optimum_int8_O1"
    assert by_name["search/L3/optimum_int8_O1"]["flops"] == contenders.forward_flops(CONFIG)
    assert student["folder"] == "01-search/shapes/L3-abcd1234/model"  # no absolute path
    assert facts == {"optimum-onnx": "0.1.0"}
    # with one level asked for, one int8 row a model
    calls.clear()
    items, _, _ = contenders.peer_items(run, manifest, lambda _: None, ["O2"])
    assert [i["name"] for i in items if i.get("peer_of") == "student"] == [
        "search/L3/optimum_int8_O2", "search/L3/openvino_int8"]


def test_the_winner_row_and_the_options(tmp_path: Path) -> None:
    run, manifest = search_run(tmp_path)
    (run / "manifest.json").write_text(manifest.model_dump_json())
    items = contenders.items_of(run, manifest, None)
    assert [(i["name"], i["winner"]) for i in items] == [("finetune", False), ("search", True)]
    args = classifier_peers.parse_args(["RUN"])
    assert args.rounds >= 5 and args.optimum_levels == ["O1", "O2", "O3"]
    assert classifier_peers.parse_args(["RUN", "--optimum-levels", "O3"]).optimum_levels == \
        ["O3"]
    with pytest.raises(SystemExit):
        classifier_peers.parse_args(["RUN", "--optimum-levels", "O4"])


def test_each_optimize_level_is_exported_then_quantized(tmp_path: Path, monkeypatch) -> None:
    """optimum-cli export onnx --optimize LEVEL, then onnxruntime quantize, per level; the
    plain export once (OpenVINO's source and the fp32 row); a level already built for these
    weights is kept."""
    run = tmp_path / "run"
    source = model_folder(run / "00-finetune" / "model")
    commands: list[list[str]] = []

    def call(command, what, log):
        commands.append(command)
        out = Path(command[command.index("-o") + 1] if "-o" in command else command[-1])
        out.mkdir(parents=True)
        (out / ("model_quantized.onnx" if "quantize" in command else "model.onnx")).write_bytes(
            b"onnx")
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(optimum, "call", call)
    monkeypatch.setattr(optimum, "_check_graph", lambda path: None)
    venv = tmp_path / "venv"
    folders = optimum.build_peers(run, source, "s" * 64, ["a", "b"], venv, {}, lambda _: None,
                                  levels=["O2", "O3"])
    assert list(folders) == ["optimum_fp32", "optimum_int8_O2", "optimum_int8_O3"]
    cli = str(venv / "bin" / "optimum-cli")
    exports = [c for c in commands if c[1] == "export"]
    assert [c[c.index("--optimize") + 1] if "--optimize" in c else None for c in exports] == \
        [None, "O2", "O3"]
    assert all(c[0] == cli for c in commands)
    quantized = [c for c in commands if "quantize" in c]
    assert len(quantized) == 2 and all(optimum.QUANTIZE_ISA in c for c in quantized)
    assert quantized[0][quantized[0].index("--onnx_model") + 1].endswith("export_O2")
    for name, level in (("optimum_fp32", None), ("optimum_int8_O2", "O2")):
        meta = json.loads((folders[name] / "export.json").read_text())
        assert meta["optimize"] == level and meta["source_sha256"] == "s" * 64
        assert (folders[name] / "model.onnx").is_file()
    assert json.loads((folders["optimum_int8_O3"] / "export.json").read_text())["quantize"] \
        == f"dynamic {optimum.QUANTIZE_ISA}"
    commands.clear()  # O1 added later: built alone, the others kept
    optimum.build_peers(run, source, "s" * 64, ["a", "b"], venv, {}, lambda _: None,
                        levels=["O1", "O2", "O3"])
    assert [c[c.index("--optimize") + 1] for c in commands if c[1] == "export"] == ["O1"]
    assert not list((run / "peers").glob(".build-*"))


def test_a_level_that_cannot_be_built_is_left_out_and_named(tmp_path: Path,
                                                           monkeypatch) -> None:
    """Optimum's quantizer failing on one --optimize level (its O2 graph, whose shapes ORT
    cannot infer) leaves that level out and says why in the results file, without an
    absolute path; the other levels are built and timed; the fp32 export failing stops."""
    run = tmp_path / "run"
    source = model_folder(run / "00-finetune" / "model")
    log = run / "peers" / "optimum.log"

    def call(command, what, log_path):
        out = Path(command[command.index("-o") + 1] if "-o" in command else command[-1])
        if "quantize" in command and str(out).endswith("quantized_O2"):
            raise optimum.PeerError(f"{what} failed with exit code 1: RuntimeError: Unable "
                                    f"to find data type (full output in {log})")
        out.mkdir(parents=True)
        (out / "model.onnx").write_bytes(b"onnx")

    monkeypatch.setattr(optimum, "call", call)
    monkeypatch.setattr(optimum, "_check_graph", lambda path: None)
    failed: dict[str, str] = {}
    folders = optimum.build_peers(run, source, "s" * 64, ["a", "b"], tmp_path / "venv", {},
                                  lambda _: None, levels=["O1", "O2"], failed=failed)
    assert list(folders) == ["optimum_fp32", "optimum_int8_O1"]
    assert (folders["optimum_int8_O1"] / "model.onnx").is_file()
    assert not (run / "peers" / "optimum_int8_O2").exists()
    assert list(failed) == ["peers/optimum_int8_O2"]
    assert "Unable to find data type" in failed["peers/optimum_int8_O2"]
    text = peers_table.render_markdown([], {"optimum_levels": ["O1", "O2"],
                                            "optimum_failed": failed})
    named = [line for line in text.splitlines() if "not built" in line]
    assert len(named) == 1 and "`peers/optimum_int8_O2`" in named[0]
    assert "Unable to find data type" in named[0] and str(tmp_path) not in named[0]
    with pytest.raises(optimum.PeerError):  # no int8 level can stand in for the fp32 file
        monkeypatch.setattr(optimum, "call", lambda *a: (_ for _ in ()).throw(
            optimum.PeerError("optimum-cli export onnx failed")))
        optimum.build_peers(tmp_path / "other", model_folder(tmp_path / "other" / "m"),
                            "t" * 64, ["a", "b"], tmp_path / "venv", {}, lambda _: None,
                            levels=["O1"], failed={})


def _rows() -> list[dict]:
    """The winner and each peer on teacher and student, two rounds each (ms at 8 x 128,
    at real lengths)."""
    def item(name: str, b8: float, real: float, accuracy: float, **more) -> dict:
        return {"name": name, "runtime": f"rt {name}", "rounds": [
            {"latency_ms_b8": b8, "latency_ms_b8_real": real, "accuracy": accuracy},
            {"latency_ms_b8": b8, "latency_ms_b8_real": real}], **more}
    optimum_int8 = {"peer": True, "peer_kind": "optimum_int8"}
    ov = {"peer": True, "peer_kind": "openvino_int8"}
    return [item("finetune", 130.0, 40.0, 0.8681),
            item("search", 8.0, 3.0, 0.8658, winner=True),
            item("optimum_int8_O1", 30.0, 9.0, 0.8796, **optimum_int8, peer_of="teacher",
                 level="O1"),
            item("optimum_int8_O2", 24.0, 9.6, 0.8785, **optimum_int8, peer_of="teacher",
                 level="O2"),
            item("optimum_int8_O3", 25.0, 9.3, 0.8750, **optimum_int8, peer_of="teacher",
                 level="O3"),
            item("openvino_int8", 20.0, 8.5, 0.8693, **ov, peer_of="teacher"),
            item("search/L3/optimum_int8_O1", 16.0, 4.5, 0.8600, **optimum_int8,
                 peer_of="student", level="O1"),
            item("search/L3/optimum_int8_O2", 14.0, 4.8, 0.8610, **optimum_int8,
                 peer_of="student", level="O2"),
            item("search/L3/openvino_int8", 10.4, 3.9, 0.8630, **ov, peer_of="student")]


STUDENT = {"folder": "01-search/shapes/L3-abcd1234/model",
           "how": "search's winner L3-pt2e_static_aoti-1 was built on shape L3: "
                  "01-search/shapes/L3-abcd1234/model"}


def test_the_table_gives_the_product_and_the_like_for_like_ratio() -> None:
    rows = peers_table.table_rows(_rows(), 2000.0)
    by_name = {r["artifact"]: r for r in rows}
    # the x faster columns: Optimum at its best on the teacher, per length (O2 at 8 x 128,
    # O1 at real lengths), never the student's
    assert by_name["search"]["speedup_b8"] == 3.0 and by_name["search"]["speedup_b8_real"] == 3.0
    entries = {(e["ratio"], e["peer"]): e for e in peers_table.headline(rows)}
    product = entries[("product", "Optimum int8")]
    assert (product["speedup_b8"], product["speedup_b8_real"]) == (3.0, 3.0)
    assert product["level"] == "O2 / O1" and product["peer_accuracy_pct"] == pytest.approx(87.85)
    assert product["winner_accuracy_pct"] == pytest.approx(86.58)
    assert product["peer_rows"] == {"latency_ms_b8": "optimum_int8_O2",
                                    "latency_ms_b8_real": "optimum_int8_O1"}
    like = entries[("like for like", "Optimum int8")]
    assert (like["speedup_b8"], like["speedup_b8_real"]) == (1.75, 1.5)
    assert like["level"] == "O2 / O1" and like["on"] == "student"
    assert entries[("product", "OpenVINO int8 static")]["speedup_b8"] == 2.5
    ov_like = entries[("like for like", "OpenVINO int8 static")]
    assert ov_like["speedup_b8"] == 1.3 and ov_like["speedup_b8_real"] == 1.3
    assert ov_like["level"] is None and ov_like["peer_accuracy_pct"] == pytest.approx(86.3)
    markdown = peers_table.render_markdown(rows, {"student": STUDENT, "rounds": 5,
                                                  "optimum_levels": ["O1", "O2", "O3"]})
    assert "- Optimum int8: optimum-cli export onnx --optimize O1, O2, O3, each quantized" \
        in markdown
    assert "## The winner against each peer: the product and the like-for-like ratio" in \
        markdown
    assert "| like for like | Optimum int8 | student | O2 / O1 | 86.10 | 86.58 | 1.75 | 1.75 " \
        "| 1.50 | 1.50 |" in markdown
    assert "| product | OpenVINO int8 static | teacher | - | 86.93 | 86.58 | 2.50 | 2.50 | " \
        "2.83 | 2.83 |" in markdown  # 20 / 8 and 8.5 / 3
    assert "**product**: the peer applied to the user's model, the fine-tuned teacher" in \
        markdown
    assert "**like for like**: the peer applied to the same float student weights" in markdown
    assert "- the winner's student weights: `01-search/shapes/L3-abcd1234/model` (search's " \
        "winner L3-pt2e_static_aoti-1 was built on shape L3" in markdown
    text = peers_table.render_text(rows)
    assert "the winner against each peer at its best:" in text
    assert any(line.startswith("like for like  OpenVINO int8 static") and
               line.split()[-4:] == ["1.30", "1.30", "1.30", "1.30"]
               for line in text.splitlines())


def test_without_student_rows_the_like_for_like_ratio_says_why() -> None:
    rows = peers_table.table_rows([i for i in _rows() if "/" not in i["name"]], None)
    entries = peers_table.headline(rows)
    like = [e for e in entries if e["ratio"] == "like for like"]
    assert all(e["speedup_b8"] is None and not e["peer_rows"] for e in like)
    markdown = peers_table.render_markdown(rows, {"student": {
        "none": "the winner (export) was made from finetune's 00-finetune/model: the "
                "teacher's own weights, so the product ratio is the like-for-like one"}})
    assert "| like for like | Optimum int8 | student | - | not measured | 86.58 | " \
        "not measured |" in markdown
    assert "- the winner's student weights: not measured: the winner (export) was made " \
        "from finetune's" in markdown
    # no winner (compress's artifacts alone, no search): no headline
    plain = [{**i, "winner": False} for i in _rows()]
    assert peers_table.headline(peers_table.table_rows(plain, None)) == []
