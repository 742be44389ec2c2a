"""Recipe schema, overrides, interpolation, and every bad-input path of `compress validate/run`."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, digits_recipe, run_cli, write_recipe

from compress.errors import UserError
from compress.recipe.registry import bf16_cpu_present, cuda_device_present
from compress.recipe.schema import load_recipe
from compress.recipe.sources import check_recipe_sources

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates(path: Path, data_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    recipe = load_recipe(path, check_sources=True)  # hardware is checked by `run`, not here
    if "format: tensorrt" in path.read_text() and not cuda_device_present():
        from compress.pipeline.loop import check_hardware

        with pytest.raises(UserError, match=r"stages.1: this stage needs a CUDA GPU"):
            check_hardware(recipe)
    if "kind: precision" in path.read_text() and not bf16_cpu_present():
        from compress.pipeline.loop import check_hardware

        with pytest.raises(UserError, match=r"stages.1: this stage needs a CPU that computes "
                                            r"bfloat16 natively"):
            check_hardware(recipe)
    model, data = check_recipe_sources(recipe)
    assert recipe.stages, "a shipped recipe has stages"
    assert model.kind in ("hf", "gguf", "factory") and data.kind in ("files", "digits")


def test_validate_cli_accepts_bert_finetune(data_dir: Path) -> None:
    result = run_cli("validate", str(REPO / "recipes/bert_finetune.yaml"),
                     env={"COMPRESS_DATA_DIR": str(data_dir)})
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_validate_does_not_import_torch(data_dir: Path) -> None:
    code = (
        "import sys\n"
        "from compress.cli.main import cli\n"
        f"cli.main(['validate', {str(REPO / 'recipes/bert_finetune.yaml')!r}],"
        " standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'validate imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"COMPRESS_DATA_DIR": str(data_dir), "PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr


def _bert_copy(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load((REPO / "recipes/bert_finetune.yaml").read_text())
    mutate(raw)
    return write_recipe(tmp_path / "recipe.yaml", raw)


def _assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> list[str]:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert all(line.startswith("error: ") for line in lines), lines
    for needle in needles:
        assert needle in result.stderr, result.stderr
    return lines


def test_misspelt_stage_option_suggests_the_real_one(tmp_path: Path, data_dir: Path) -> None:
    def mutate(raw):
        raw["stages"][0]["lerning_rate"] = raw["stages"][0].pop("learning_rate")

    path = _bert_copy(tmp_path, mutate)
    result = run_cli("validate", str(path), env={"COMPRESS_DATA_DIR": str(data_dir)})
    _assert_user_error(result, "stages.0.lerning_rate: unknown key",
                       "did you mean 'learning_rate'")


def test_unknown_stage_kind_suggests_the_real_one(tmp_path: Path, data_dir: Path) -> None:
    path = _bert_copy(tmp_path, lambda raw: raw["stages"][0].update(kind="finetun"))
    result = run_cli("validate", str(path), env={"COMPRESS_DATA_DIR": str(data_dir)})
    _assert_user_error(result, "unknown stage kind 'finetun'", "did you mean 'finetune'")


def test_every_problem_reported_at_once(tmp_path: Path, data_dir: Path) -> None:
    def mutate(raw):
        raw["stages"][0]["batch_size"] = "many"        # wrong type
        raw["stages"][0]["learning_rate"] = -1          # out of range
        raw["data"]["eval"]["max_sampels"] = 10         # unknown key
        raw["evaluation"]["latency"]["iters"] = 0       # out of range

    path = _bert_copy(tmp_path, mutate)
    lines = _assert_user_error(
        run_cli("validate", str(path), env={"COMPRESS_DATA_DIR": str(data_dir)}),
        "stages.0.batch_size", "stages.0.learning_rate",
        "greater than 0", "data.eval.max_sampels: unknown key (did you mean 'max_samples'?)",
        "evaluation.latency.iters")
    assert len(lines) == 4


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel:\n  source: [unclosed\ndata: {}\n")
    lines = _assert_user_error(run_cli("validate", str(path)), "malformed YAML")
    assert f"{path}:4:" in lines[0] or f"{path}:3:" in lines[0], lines


def test_missing_recipe_file(tmp_path: Path) -> None:
    _assert_user_error(run_cli("run", str(tmp_path / "nope.yaml")), "recipe file not found")


def test_missing_model_path(tmp_path: Path, data_dir: Path) -> None:
    missing = tmp_path / "no_such_model"
    path = _bert_copy(tmp_path, lambda raw: raw["model"].update(source=str(missing)))
    _assert_user_error(run_cli("run", str(path), env={"COMPRESS_DATA_DIR": str(data_dir)}),
                       f"model.source: path '{missing}' does not exist")


def test_missing_dataset_names_compress_data_dir(tmp_path: Path) -> None:
    path = _bert_copy(tmp_path, lambda raw: raw["data"].update(source="nobody/nothing"))
    _assert_user_error(run_cli("run", str(path), env={"COMPRESS_DATA_DIR": str(tmp_path)}),
                       "dataset 'nobody/nothing' not found", "COMPRESS_DATA_DIR")


def test_missing_label_column(tmp_path: Path, data_dir: Path) -> None:
    path = _bert_copy(tmp_path, lambda raw: raw["data"].update(label_column="sentiment"))
    _assert_user_error(run_cli("run", str(path), env={"COMPRESS_DATA_DIR": str(data_dir)}),
                       "data.label_column: column 'sentiment' not in", "columns: sentence, label")


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bad_input_writes_nothing_into_an_existing_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    raw = digits_recipe(out)
    good = write_recipe(tmp_path / "good.yaml", raw)
    assert run_cli("run", str(good)).returncode == 0
    run_dir = out / raw["name"]
    before = _snapshot(run_dir)
    bad_recipes = {
        "unknown key": lambda r: r["stages"][0].update(lerning_rate=0.1),
        "bad model": lambda r: r["model"].update(source="./missing_model"),
        "bad data": lambda r: r["data"].update(source="sklearn:nothing"),
        "bad split": lambda r: r["data"]["eval"].update(split="dev"),
    }
    for name, mutate in bad_recipes.items():
        bad_raw = copy.deepcopy(raw)
        mutate(bad_raw)
        bad = write_recipe(tmp_path / "bad.yaml", bad_raw)
        result = run_cli("run", str(bad))
        assert result.returncode == 2, (name, result.stderr)
        assert "Traceback" not in result.stderr, name
        assert _snapshot(run_dir) == before, f"{name} changed the run folder"


def test_stages_and_schema_commands() -> None:
    stages = run_cli("stages")
    assert stages.returncode == 0
    assert "finetune" in stages.stdout and "learning_rate" in stages.stdout
    assert "5e-05" in stages.stdout  # the default is shown
    schema = run_cli("schema")
    doc = json.loads(schema.stdout)
    assert "stages" in doc["properties"] and "finetune" in json.dumps(doc)


def test_help_has_examples() -> None:
    result = run_cli("run", "--help")
    assert result.returncode == 0 and "Examples:" in result.stdout


@pytest.mark.parametrize("amount", [0, 1, 1.5, -0.2])
def test_sparsity_outside_zero_one_is_refused_at_validation(tmp_path: Path, amount) -> None:
    raw = digits_recipe(tmp_path)
    raw["stages"].append({"kind": "prune", "method": "global", "amount": amount})
    result = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    _assert_user_error(result, "stages.1.amount")


def test_gradual_pruning_without_recovery_is_refused(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path)
    raw["stages"].append({"kind": "prune", "gradual": True})
    result = run_cli("validate", str(write_recipe(tmp_path / "r.yaml", raw)))
    _assert_user_error(result, "gradual: true needs recovery")
