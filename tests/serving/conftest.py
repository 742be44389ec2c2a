"""Serving tests need Java 17 and TorchServe: without them every test here is skipped
with the reason (never an error)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

MISSING = [what for what, present in (
    ("java (TorchServe needs Java 17)", shutil.which("java") is not None),
    ("torchserve", importlib.util.find_spec("ts") is not None),
    ("torch-model-archiver", importlib.util.find_spec("model_archiver") is not None),
) if not present]


def pytest_collection_modifyitems(config, items) -> None:
    if not MISSING:
        return
    skip = pytest.mark.skip(reason="serving tests need " + ", ".join(MISSING))
    for item in items:
        if "serving" in Path(str(item.fspath)).parts:
            item.add_marker(skip)
