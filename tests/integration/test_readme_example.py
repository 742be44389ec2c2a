"""The quickstart's commands (docs/quickstart.md) and the README's Python example run as
written, in one fresh folder, and their figures hold. The Python example trains what the
quickstart's first command trained, so it finds that stage cached."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- tested: tests/integration/test_readme_example.py -->"


def readme_python_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def quickstart_blocks() -> list[str]:
    """The shell blocks of docs/quickstart.md marked as tested here."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    return re.findall(re.escape(MARKER) + r"\n```bash\n(.*?)```", text, re.S)


def rows(run_dir: Path) -> dict[str, dict]:
    """report.json's rows by artifact (name, and runtime when a name repeats)."""
    out = {}
    for row in json.loads((run_dir / "report.json").read_text())["rows"]:
        out[row["name"] if row["name"] not in out else f"{row['name']} {row['runtime']}"] = row
    return out


def test_the_quickstart_and_the_readme_python_example_run(tmp_path: Path,
                                                          data_dir: Path) -> None:
    (tmp_path / "recipes").mkdir()
    shutil.copy(REPO / "recipes" / "cnn_digits.yaml", tmp_path / "recipes")
    shutil.copytree(REPO / "docs" / "examples", tmp_path / "docs" / "examples")
    env = {k: v for k, v in os.environ.items() if k != "COMPRESS_RUNS"}  # runs/ as written
    env.update(COMPRESS_DATA_DIR=str(data_dir), PYTHONPATH=str(REPO))
    blocks = quickstart_blocks()
    assert len(blocks) == 2 and "compress run recipes/cnn_digits.yaml" in blocks[0]
    shell = f'compress() {{ "{sys.executable}" -m compress "$@"; }}\nset -e\n'
    for block in blocks:
        done = subprocess.run(["bash", "-c", shell + block], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "finetune" in done.stdout and "acc %" in done.stdout  # the report's table

    digits = rows(tmp_path / "runs" / "cnn_digits")
    assert digits["finetune"]["accuracy_pct"] > 80 and digits["baseline"]["accuracy_pct"] < 30
    int8 = rows(tmp_path / "runs" / "digits_int8")
    assert set(int8) == {"baseline", "finetune", "export", "export ONNX Runtime int8 static"}
    static = int8["export ONNX Runtime int8 static"]
    assert static["accuracy_pct"] > 80 and static["size_ratio"] < 0.5  # quickstart: 0.35x

    code = readme_python_example() + (
        "\nassert figures['calibration_samples'] > 0"
        "\nassert compress.score(int8, data.splits['eval'])['accuracy'] > 0.8"
        "\nassert compress.score(onnx_model, data.splits['eval'])['accuracy'] > 0.8"
        "\nassert path.is_file() and (run_dir / 'manifest.json').is_file()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "exports" / "cnn_onnx" / "model.onnx").is_file()
    manifest = json.loads((tmp_path / "runs" / "cnn_digits" / "manifest.json").read_text())
    assert [s["status"] for s in manifest["stages"]] == ["cached"]
