"""Validation and the stage registry load no torch (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_spec_modules_and_validation_import_no_torch() -> None:
    code = ("import sys; import compress.recipe.registry as s; s.all_specs(); "
            "from compress.recipe.schema import load_recipe; "
            "load_recipe('recipes/bert_int8.yaml'); import compress; compress.ExportConfig; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
