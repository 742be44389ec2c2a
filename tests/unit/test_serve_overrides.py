"""`compress serve`'s overrides of an archive's model-config.yaml: workers, batch, delay and
threads land in the unpacked folder; TorchServe never gets a batch delay of 0."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import yaml
from click.testing import CliRunner

from compress.cli.serve import serve
from compress.serving.serve_target import ServeTarget, unpack_model
from compress.serving.torchserve import launch as torchserve_launch


def _archive(tmp_path: Path, threads: int = 2, delay: int = 5) -> ServeTarget:
    mar = tmp_path / "m.mar"
    config = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 32, "maxBatchDelay": delay,
              "handler": {"task": "embedding", "threads": threads}}
    with zipfile.ZipFile(mar, "w") as archive:
        archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "m"}}))
        archive.writestr("model-config.yaml", yaml.safe_dump(config))
    return ServeTarget(mar, "m", tmp_path / "serve")


def test_threads_and_batching_override_the_archive(tmp_path: Path) -> None:
    settings = unpack_model(_archive(tmp_path), tmp_path / "store", None, 16, 0, threads=1)
    written = yaml.safe_load((tmp_path / "store" / "m" / "model-config.yaml").read_text())
    assert written["handler"]["threads"] == 1 and settings["threads_per_worker"] == 1
    assert (written["batchSize"], written["maxBatchDelay"]) == (16, 0)


def test_without_threads_the_archive_keeps_its_own_capped_at_the_cores(tmp_path: Path) -> None:
    settings = unpack_model(_archive(tmp_path, threads=4096), tmp_path / "store", 1, None,
                            None)
    assert settings["threads_per_worker"] == (os.cpu_count() or 1)
    assert settings["batchSize"] == 32 and settings["maxBatchDelay"] == 5


def test_torchserve_gets_one_ms_for_a_zero_delay(tmp_path: Path) -> None:
    unpack_model(_archive(tmp_path, delay=0), tmp_path / "store", None, None, None)
    said: list[str] = []
    assert torchserve_launch._no_zero_delay(tmp_path / "store" / "m", said.append) == 1
    written = yaml.safe_load((tmp_path / "store" / "m" / "model-config.yaml").read_text())
    assert written["maxBatchDelay"] == 1 and "100 ms" in said[0]


def test_threads_below_one_are_refused_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(serve, [str(tmp_path), "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output
    assert "Traceback" not in result.output
