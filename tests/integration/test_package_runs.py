"""Package stage: the .mar's contents and settings, and the batching handler run in this
process with TorchServe's own Context (no server: tests/serving starts a real one)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import digits_recipe, run_cli, write_recipe

pytest.importorskip("ts")

from ts.context import Context, RequestProcessor  # noqa: E402

import serve  # noqa: E402
from compress.runfolder.code_digest import shipped_files  # noqa: E402
from compress.serving.archive import build_mar, model_config  # noqa: E402
from export.folder import load_export  # noqa: E402
from serve.classifier.handler import BATCH_HEADER, CompressHandler  # noqa: E402
from serve.handler_settings import UnknownSetting  # noqa: E402


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _handler(mar: Path, folder: Path) -> tuple[CompressHandler, dict]:
    """The archive unpacked and its handler initialised as a TorchServe worker would."""
    with zipfile.ZipFile(mar) as archive:
        archive.extractall(folder)
    config = yaml.safe_load((folder / "model-config.yaml").read_text())
    context = Context("m", str(folder), None, config["batchSize"], None, "0.12.0",
                      model_yaml_config=config)
    handler = CompressHandler()
    handler.initialize(context)
    return handler, config


def _handle(handler: CompressHandler, requests: list[tuple[object, str]]):
    """Serve one batch of (body, content type); return [(status, headers, answer)]."""
    context = Context("m", "", None, len(requests), None, "0.12.0")
    context.request_processor = [RequestProcessor({"body": {"content-type": ctype}})
                                 for _, ctype in requests]
    answers = handler.handle([{"body": body} for body, _ in requests], context)
    return [(context.get_response_status(i)[0], context.get_response_headers(i),
             json.loads(answer)) for i, answer in enumerate(answers)]


def test_mar_holds_the_file_handler_labels_settings_and_figures(packaged_text_run) -> None:
    stages = _manifest(packaged_text_run)["stages"]
    assert [s["status"] for s in stages] == ["done"] * 5
    record = stages[3]["outputs"][0]
    assert record["path"] == "03-package/tiny_onnx.mar" and record["format"] == "mar"
    assert record["model_name"] == "tiny_onnx" and record["served_format"] == "onnx"
    with zipfile.ZipFile(packaged_text_run / record["path"]) as archive:
        names = set(archive.namelist())
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        config = yaml.safe_load(archive.read("model-config.yaml"))
        labels = json.loads(archive.read("index_to_name.json"))
        summary = json.loads(archive.read("compress.json"))
    assert {"handler.py", "model.onnx", "export.json", "tokenizer.json", "parity.json",
            "index_to_name.json", "compress.json", "model-config.yaml"} <= names
    assert manifest["model"]["modelName"] == "tiny_onnx"
    assert manifest["model"]["serializedFile"] == "model.onnx"
    assert manifest["model"]["handler"] == "handler.py"
    # its code: serve/'s own modules and serve/classifier/, the folders as they are
    serve_dir = Path(serve.__file__).parent
    shipped = {f"serve/{p.relative_to(serve_dir)}"
               for p in (*(p for p in serve_dir.iterdir() if p.is_file()),
                         *shipped_files("serve.classifier")) if not p.name.endswith(".pyc")}
    assert {n for n in names if n.startswith("serve/")} == shipped
    assert "serve/classifier/handler.py" in shipped and "serve/batching.py" in shipped
    assert {k: config[k] for k in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay",
                                   "responseTimeout")} == {
        "minWorkers": 1, "maxWorkers": 1, "batchSize": 8, "maxBatchDelay": 50,
        "responseTimeout": 120}
    assert config["handler"] == {"threads": os.cpu_count(), "max_length": 32,
                                 "max_text_chars": 200, "length_buckets": True}
    assert labels == {"0": "negative", "1": "positive"}
    export = stages[1]
    assert summary["artifact"]["accuracy"] == export["metrics"]["accuracy"]
    assert summary["artifact"]["sha256"] == export["outputs"][0]["sha256"]
    assert summary["recipe"]["name"] == "tiny_served"
    assert stages[4]["outputs"][0]["served_format"] == "torchscript"


def test_an_unknown_handler_setting_is_refused_naming_it(packaged_text_run,
                                                         tmp_path: Path) -> None:
    export_dir = packaged_text_run / _manifest(packaged_text_run)["stages"][1]["outputs"][0][
        "export_dir"]
    config = model_config(4, 10, 1, 60, {"threads": 1, "max_lenght": 32})
    with pytest.raises(UnknownSetting) as refused:
        build_mar(export_dir, tmp_path, "m", "1.0", config, {})
    assert str(refused.value).startswith("unknown handler setting 'max_lenght' (known: ")
    assert "\n" not in str(refused.value) and list(tmp_path.iterdir()) == []


def test_package_is_cached_and_rebuilt_when_its_settings_change(packaged_text_run,
                                                                tmp_path: Path) -> None:
    import shutil

    recipe = packaged_text_run.parent.parent / "r.yaml"
    run = tmp_path / "runs" / packaged_text_run.name  # a copy: the session fixture stays
    shutil.copytree(packaged_text_run, run)
    out = f"output_dir={tmp_path / 'runs'}"
    again = run_cli("run", str(recipe), out)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count(": cached") == 6  # baseline + 5 stages
    old = _manifest(run)["stages"][4]["outputs"][0]["sha256"]
    changed = run_cli("run", str(recipe), out, "stages.4.batch_size=2")
    assert changed.returncode == 0, changed.stderr[-2000:]
    assert changed.stderr.count(": cached") == 5
    stages = _manifest(run)["stages"]
    assert stages[4]["outputs"][0]["sha256"] != old and stages[4]["metrics"]["batch_size"] == 2
    assert _manifest(packaged_text_run)["stages"][4]["metrics"]["batch_size"] == 4


def test_handler_answers_each_request_of_a_batch(packaged_text_run, tmp_path: Path) -> None:
    handler, _ = _handler(packaged_text_run / "03-package/tiny_onnx.mar", tmp_path / "m")
    good = ["great superb movie", "awful boring dull movie"]
    answers = _handle(handler, [
        ({"text": good[0]}, "application/json"),
        (b'{"text": "unterminated', "application/json"),
        (good[1], "text/plain"),
        ({"texts": good}, "application/json"),
        ({"text": "x" * 201}, "application/json"),
        ({"review": "no text key"}, "application/json"),
        (bytearray(json.dumps({"text": good[1]}).encode()), "application/octet-stream"),
    ])
    statuses = [status for status, _, _ in answers]
    assert statuses == [200, 400, 200, 200, 400, 400, 200]
    assert all(headers[BATCH_HEADER] == "7" for _, headers, _ in answers)
    assert answers[1][2]["error"].startswith("malformed JSON")
    assert answers[4][2]["error"] == "text too long: 201 characters, at most 200"
    assert answers[5][2]["error"].startswith("no text")
    offline = load_export(packaged_text_run / "01-export/onnx", threads=1)
    encoded = offline.tokenizer(good, padding=True, return_tensors="pt")
    expected = torch.softmax(offline.model(**encoded), dim=-1)
    listed = answers[3][2]
    assert [a["label"] for a in listed] == ["positive", "negative"]
    for row, single in zip(range(2), (answers[0][2], answers[2][2]), strict=True):
        for answer in (single, listed[row]):
            probs = torch.tensor([answer["probabilities"][n] for n in ("negative", "positive")])
            assert torch.allclose(probs, expected[row], atol=1e-5)
            assert answer["score"] == max(answer["probabilities"].values())
    assert answers[6][2] == answers[2][2]


def test_handler_takes_nested_arrays_for_image_models(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["stages"] += [{"kind": "export", "format": "torchscript"},
                      {"kind": "package", "batch_size": 4}]
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert result.returncode == 0, result.stderr[-2000:]
    run_dir = tmp_path / "runs/tiny_digits"
    handler, _ = _handler(run_dir / "02-package/tiny_digits.mar", tmp_path / "m")
    from sklearn.datasets import load_digits

    images = load_digits().data[:3].astype("float32") / 16.0
    shape = handler.input_shape
    arrays = [image.reshape(shape).tolist() for image in images]
    answers = _handle(handler, [
        ({"input": arrays[0]}, "application/json"),
        ({"inputs": arrays[1:]}, "application/json"),
        ({"input": [[1.0, 2.0]]}, "application/json"),
        (json.dumps(arrays[0]).encode(), "application/json"),  # bytes, as LitServe hands
        (arrays[0], "application/json"),  # decoded, as TorchServe's worker hands it over
    ])
    assert [status for status, _, _ in answers] == [200, 200, 400, 200, 200]
    assert "nested array of shape" in answers[2][2]["error"]
    offline = load_export(run_dir / "01-export/torchscript", threads=1)
    expected = offline.model(torch.tensor(images).reshape(3, *shape)).argmax(-1).tolist()
    names = offline.label_names
    got = [answers[0][2]["label"], *(a["label"] for a in answers[1][2])]
    assert got == [names[i] for i in expected]
    assert answers[3][2] == answers[0][2]
    assert answers[4][2]["label"] == answers[0][2]["label"]
    assert answers[4][2]["probabilities"] == pytest.approx(answers[0][2]["probabilities"],
                                                          abs=1e-6)


@pytest.mark.parametrize("stages,message", [
    ([{"kind": "package"}],
     "stages.1.artifact: no export stage comes before this package stage"),
    ([{"kind": "export", "format": "onnx", "name": "o"}, {"kind": "package", "artifact": "x"}],
     "stages.2.artifact: 'x' is not an earlier export stage (choices: 1 (o))"),
    ([{"kind": "package", "model_name": "bad name"}], "model_name"),
    ([{"kind": "package", "batch_size": 0}], "batch_size"),
])
def test_bad_package_stages_fail_validation(tmp_path: Path, stages, message) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["stages"] += stages
    result = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()
