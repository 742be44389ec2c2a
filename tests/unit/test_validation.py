"""Every bad input a user can make is one `error:` line with exit 2 (in-process through
`compress.cli.main.main`), all mistakes of a recipe are reported together, and an unexpected
exception is one line plus a log, never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from conftest import cli, digits_recipe

from compress.cli.main import main


def recipe_file(tmp_path: Path, **changes) -> Path:
    raw = digits_recipe(tmp_path / "runs")
    raw.update(changes)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


BAD_OVERRIDES = [
    (["stages.0.epochs=1e400"], "stages.0.epochs: "),
    (["stages.0.epochs=.inf"], "stages.0.epochs: must be a finite number"),
    (["stages.0.max_steps=99999999999999999999"], "stages.0.max_steps: "),
    (["seed=-5"], "seed: Input should be greater than or equal to 0"),
    (["model.source=compress.models.zoo:nope"],
     "model.source: module 'compress.models.zoo' defines no 'nope'"),
    (["stages=[{kind: quantize, mode: dynamic}, {kind: finetune}]"],
     "stages.1: a finetune stage cannot take the model of a quantize stage"),
    (["stages=[{kind: quantize, mode: dynamic}, {kind: quantize, mode: dynamic}]"],
     "stages.1: a quantize stage cannot take the model of a quantize stage"),
    (["stages=[{kind: prune, method: structured, target: channels}, "
      "{kind: distill, student: {layers: 1}}]"],
     "stages.1: distill cannot copy layers of the structurally pruned model of stages.0"),
    (["stages=[{kind: distill, student: {factory: 'compress.models.zoo:mlp'}, "
      "layerwise: {hidden_weight: 1}}]"],
     "stages.0.layerwise: matches the layers of Hugging Face encoders; a student.factory "
     "model has none (drop layerwise)"),
    (["stages=[{kind: distill, student: {layers: 1}, layerwise: {hidden_loss: l1}}]"],
     "stages.0.layerwise.hidden_loss: "),
]


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES)
def test_bad_values_are_one_line_exit_2(overrides, message, tmp_path, monkeypatch,
                                         capsys) -> None:
    code, out, err = cli(monkeypatch, capsys, "validate", str(recipe_file(tmp_path)),
                         *overrides)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize("content,message", [
    (b"name: caf\xe9\n", ":1: not UTF-8 text (byte 0xe9)"),
    (b"a: &a [*a]\nname: x\n", "an alias refers to itself"),
    (b"name: a\nname: b\n", "key 'name' is given twice (lines 1 and 2)"),
])
def test_unreadable_recipes_are_one_line_exit_2(content, message, tmp_path, monkeypatch,
                                                capsys) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    code, _, err = cli(monkeypatch, capsys, "validate", str(path))
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in err


def test_three_independent_mistakes_are_three_lines(tmp_path, monkeypatch, capsys) -> None:
    path = recipe_file(tmp_path)
    code, _, err = cli(monkeypatch, capsys, "validate", str(path), "stages.0.lerning_rate=1",
                       "data.source=nowhere/at_all", "seed=-1")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 3, lines
    assert "stages.0.lerning_rate: unknown key (did you mean 'learning_rate'?)" in lines[0]
    assert any("seed: " in line for line in lines)
    assert any("data.source: dataset 'nowhere/at_all' not found" in line for line in lines)


def test_validate_takes_several_files(tmp_path, monkeypatch, capsys) -> None:
    good = recipe_file(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    code, out, err = cli(monkeypatch, capsys, "validate", str(good), str(bad))
    assert code == 2 and f"{good}: ok (tiny_digits: finetune)" in out
    assert f"error: {bad}: model: required key is missing" in err


def test_validate_says_it_cannot_check_a_hub_dataset_id_offline(tmp_path, monkeypatch,
                                                             capsys) -> None:
    pytest.importorskip("datasets")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("COMPRESS_DATA_DIR", raising=False)
    data = {"source": "someone/reviews", "text_column": "sentence"}
    monkeypatch.setattr(sys, "argv", ["compress", "validate", str(recipe_file(tmp_path,
                                                                              data=data))])
    main()  # exit 0: returns
    out, err = capsys.readouterr()
    assert (f"{tmp_path / 'r.yaml'}: note: data.source 'someone/reviews' is read from the "
            f"Hugging Face hub, which validate does not reach: it cannot check the id "
            f"offline") in out
    assert out.count("note:") == 1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub at all: the id is an error
    code, _, err = cli(monkeypatch, capsys, "validate", str(recipe_file(tmp_path, data=data)))
    assert code == 2 and "dataset 'someone/reviews' not found" in err


def test_an_unexpected_exception_is_one_line_and_a_log(tmp_path, monkeypatch,
                                                       capsys) -> None:
    import compress.cli.main as cli_module

    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke\nsecond line")

    monkeypatch.setenv("COMPRESS_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(cli_module, "load_recipe", broken)
    code, _, err = cli(monkeypatch, capsys, "validate", str(recipe_file(tmp_path)))
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: RuntimeError: something inside broke (details in ")
    log = Path(err.split("(details in ")[1].rstrip(")\n"))
    assert log.is_file() and "Traceback" in log.read_text() and log.parent.name == "logs"


def test_stages_lists_nested_options_allowed_values_and_real_defaults(monkeypatch,
                                                                       capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["compress", "stages"])
    main()  # returns on success
    text = capsys.readouterr().out
    assert "PydanticUndefined" not in text
    for nested in ("calibration.samples", "student.layers", "recovery.epochs", "qat.max_steps"):
        assert f"  {nested} " in text
    assert "one of: dynamic, static, qat" in text
    assert "default ['*']" in text  # prune.include's real default, from its factory


def test_stages_json_for_one_kind(monkeypatch, capsys) -> None:
    import json

    monkeypatch.setattr(sys, "argv", ["compress", "stages", "quantize", "--json"])
    main()
    data = json.loads(capsys.readouterr().out)
    options = {o["name"]: o for o in data[0]["options"]}
    assert data[0]["kind"] == "quantize" and options["mode"]["allowed"] == ["dynamic", "static",
                                                                         "qat"]
    assert options["calibration.samples"]["default"] == 256
    assert ">= 1" in options["calibration.samples"]["bounds"]
