"""int8 through torch.export + torchao PT2E: accuracy, modes, save/load, failures, the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import digits_recipe, run_cli, write_recipe


def test_cli_finetune_then_static_quantize_is_accurate_and_cached(tmp_path: Path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["data"]["calibration"] = {"split": "train", "max_samples": 128}
    raw["stages"].append({"kind": "quantize", "mode": "static",
                          "calibration": {"samples": 128, "batch_size": 64}})
    path = write_recipe(tmp_path / "r.yaml", raw)
    state = tmp_path / "state"
    first = run_cli("run", str(path), env={"COMPRESS_STATE_DIR": str(state)})
    assert first.returncode == 0, first.stderr
    # torchao's loading noise goes to a log file; the terminal shows compress's lines only
    lines = [line for line in first.stderr.splitlines() if line.strip()]
    foreign = [line for line in lines
               if not re.match(r"(baseline:|\[\d/2\] |report:|run folder:|finetune:|quantize:)",
                               line)]
    assert not foreign, foreign
    assert "Failed to load" in (state / "logs" / "libraries.log").read_text()
    run_dir = tmp_path / "runs" / "tiny_digits"
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    finetuned, quantized = stages[0]["metrics"], stages[1]["metrics"]
    assert stages[1]["status"] == "done" and quantized["quant_mode"] == "static"
    assert quantized["calibration_samples"] == 128 and quantized["compile_s"] > 0
    assert abs(quantized["accuracy"] - finetuned["accuracy"]) <= 0.03
    assert (run_dir / stages[1]["outputs"][0]["path"]).name == "model.pt2"
    again = run_cli("run", str(path))
    assert again.returncode == 0, again.stderr
    assert "[2/2] quantize: cached" in again.stderr


def test_cli_quantize_of_an_uncapturable_model_exits_1_naming_the_stage(tmp_path: Path) -> None:
    (tmp_path / "branchy.py").write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.linear = torch.nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        "        x = x.flatten(1)\n"
        "        return self.linear(x) if x.sum() > 0 else -self.linear(x)\n"
        "def build():\n"
        "    return Branchy()\n")
    raw = digits_recipe(tmp_path / "runs")
    raw["model"] = {"source": "branchy:build"}
    raw["stages"] = [{"kind": "quantize", "mode": "dynamic"}]
    result = run_cli("run", str(write_recipe(tmp_path / "r.yaml", raw)),
                     env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage quantize failed: torch.export could not capture"), last
    assert "Traceback" not in result.stderr
    manifest = json.loads((tmp_path / "runs" / "tiny_digits" / "manifest.json").read_text())
    assert manifest["stages"][0]["status"] == "failed"
    assert manifest["stages"][0]["outputs"] == []
