"""The README's Python example runs as written, in a fresh folder, and its figures hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_python_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_runs(tmp_path: Path, data_dir: Path) -> None:
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "cnn_digits.yaml").write_text(
        (REPO / "recipes" / "cnn_digits.yaml").read_text())
    code = readme_python_example() + (
        "\nassert figures['calibration_samples'] > 0"
        "\nassert compress.score(int8, data.splits['eval'])['accuracy'] > 0.8"
        "\nassert compress.score(onnx_model, data.splits['eval'])['accuracy'] > 0.8"
        "\nassert path.is_file() and (run_dir / 'manifest.json').is_file()\n")
    env = {**os.environ, "COMPRESS_RUNS": str(tmp_path / "runs"),
           "COMPRESS_DATA_DIR": str(data_dir), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "exports" / "cnn_onnx" / "model.onnx").is_file()
