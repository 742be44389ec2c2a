"""Build a TorchServe archive (.mar) of an export folder with compress's batching handler.

The archive holds the exported file, `export.json`, the tokenizer files, `parity.json`,
`index_to_name.json`, `model-config.yaml` (TorchServe's batch and worker settings plus a
`handler:` section) and `compress.json` (what the run measured for this artifact).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

import serve

SERVE = Path(serve.__file__).parent  # what ships inside an archive
HANDLER = SERVE / "handler.py"
# what every handler imports beside it
HANDLER_MODULES = (SERVE / "runtimes.py", SERVE / "worker_threads.py",
                   SERVE / "handler_metrics.py", SERVE / "http_answers.py",
                   SERVE / "batching.py", SERVE / "encoder_attention.py",
                   SERVE / "encoder_attention.cpp", SERVE / "encoder_norm.cpp",
                   SERVE / "encoder_activation.cpp")
SERVED_METRICS = ("accuracy", "macro_f1", "latency_ms_b1", "latency_ms_b8",
                  "parity_max_abs_diff", "parity_argmax_agreement", "runtime_threads")


def model_config(batch_size: int, max_batch_delay_ms: int, workers: int,
                 response_timeout_s: int, handler: dict[str, Any],
                 startup_timeout_s: int = 600) -> dict[str, Any]:
    """TorchServe's per-model settings (`model-config.yaml`) with the handler's own section."""
    return {"minWorkers": workers, "maxWorkers": workers, "batchSize": batch_size,
            "maxBatchDelay": max_batch_delay_ms, "responseTimeout": response_timeout_s,
            "startupTimeout": startup_timeout_s, "handler": handler}


def build_mar(export_dir: Path, out_dir: Path, model_name: str, version: str,
              config: dict[str, Any], summary: dict[str, Any], handler: Path = HANDLER,
              modules: tuple[Path, ...] = (), trees: tuple[Path, ...] = ()) -> Path:
    """Write `<out_dir>/<model_name>.mar` (complete or not at all) and return its path:
    the export folder's files, `handler`, the modules every handler imports, the
    `modules` this one imports too and the contents of each of `trees` (a family's package:
    torch-model-archiver copies a folder's contents to the archive's root, sub-folders
    whole)."""
    meta = json.loads((export_dir / "export.json").read_text())
    serialized = export_dir / meta["file"]
    staging = out_dir / ".mar.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        (staging / "compress.json").write_text(json.dumps(summary, indent=2))
        config_file = staging / "model-config.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        extra = [p for p in sorted(export_dir.iterdir()) if p.is_file() and p != serialized]
        extra += [*HANDLER_MODULES, *modules, *trees, staging / "compress.json"]
        if meta.get("label_names"):
            labels = {str(i): name for i, name in enumerate(meta["label_names"])}
            (staging / "index_to_name.json").write_text(json.dumps(labels, indent=2))
            extra.append(staging / "index_to_name.json")
        command = [sys.executable, "-m", "model_archiver.model_packaging",
                   "--model-name", model_name, "--version", version,
                   "--serialized-file", str(serialized), "--handler", str(handler),
                   "--extra-files", ",".join(str(p) for p in extra),
                   "--config-file", str(config_file), "--export-path", str(staging), "--force"]
        # it gathers the files in <TMPDIR>/<model name>: two runs packaging the same name at
        # once (two test workers, two recipes) would share /tmp's and break each other
        (staging / "tmp").mkdir()
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "TMPDIR": str(staging / "tmp")})
        built = staging / f"{model_name}.mar"
        if done.returncode != 0 or not built.is_file():
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise RuntimeError(f"torch-model-archiver failed: {lines[-1]}")
        final = out_dir / built.name
        built.replace(final)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)
