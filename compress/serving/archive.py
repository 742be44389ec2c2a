"""Build a TorchServe archive (.mar) of an export folder with compress's batching handler.

The archive holds the exported file, `export.json`, the tokenizer files, `parity.json`,
`index_to_name.json`, `model-config.yaml` (TorchServe's batch and worker settings plus a
`handler:` section) and `compress.json` (what the run measured for this artifact), and its
code: the package `serve/` with serve's own modules (what every handler shares) and the
family's package whole (`serve/classifier/`, `serve/embedding/` or `serve/causal_lm/`), and
a generated root module that TorchServe and LitServe import by its file name. The folders
are the list of what ships (`code_tree`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import yaml

import serve
from compress.runfolder.code_digest import NOT_SHIPPED, shipped_files
from serve.handler_settings import HandlerSettings

SERVE = Path(serve.__file__).parent  # what ships inside an archive, as its `serve/` package
CLASSIFIER = "serve.classifier.handler:CompressHandler"  # the classifier family's handler
ENTRY_SOURCE = '''"""The archive's handler module (written by compress's package stage):
TorchServe and LitServe import it by its file name and take the one class defined in it."""

from {module} import {name} as _Handler


class {name}(_Handler):
    """compress's handler (`{path}`)."""
'''
STORED_BYTES = 16 << 20  # an entry this large (the weights) is stored in the archive, not
# deflated: `compress serve` unpacks the archive at every start, and inflating SmolLM2's
# 204 MB int8 model.pt took 1.6 s of its cold start (Emerald Rapids), a copy a tenth of that
ZIP64_BYTES = 1 << 31  # an entry this large needs zip64's sizes
SERVED_METRICS = ("accuracy", "macro_f1", "latency_ms_b1", "latency_ms_b8",
                  "parity_max_abs_diff", "parity_argmax_agreement", "runtime_threads")


def model_config(batch_size: int, max_batch_delay_ms: int, workers: int,
                 response_timeout_s: int, handler: dict[str, Any],
                 startup_timeout_s: int = 600) -> dict[str, Any]:
    """TorchServe's per-model settings (`model-config.yaml`) with the handler's own section."""
    return {"minWorkers": workers, "maxWorkers": workers, "batchSize": batch_size,
            "maxBatchDelay": max_batch_delay_ms, "responseTimeout": response_timeout_s,
            "startupTimeout": startup_timeout_s, "handler": handler}


def code_tree(folder: Path, handler: str, entry: str = "handler.py") -> tuple[Path, Path]:
    """Write an archive's code under `folder` and return (the tree whose contents go to the
    archive's root, the entry module): `tree/serve/` holds serve's own files and the
    family's package (`serve.<family>`, where `handler`, "module:Class", lives) whole;
    `entry` defines the one class TorchServe and LitServe look for, a subclass of
    `handler`'s."""
    module, _, name = handler.partition(":")
    family = ".".join(module.split(".")[:2])  # serve.causal_lm.server.handler: serve.causal_lm
    shutil.rmtree(folder, ignore_errors=True)
    code = folder / "tree" / SERVE.name
    code.mkdir(parents=True)
    for path in SERVE.iterdir():
        if path.is_file() and not any(path.match(pattern) for pattern in NOT_SHIPPED):
            shutil.copy2(path, code / path.name)
    top = SERVE.parent
    for path in shipped_files(family):
        target = folder / "tree" / path.relative_to(top)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    source = Path(*module.split(".")).with_suffix(".py")
    (folder / entry).write_text(ENTRY_SOURCE.format(module=module, name=name, path=source))
    return folder / "tree", folder / entry


def store_large_entries(mar: Path, threshold: int = STORED_BYTES) -> int:
    """Rewrite the archive `mar` in place (through a file beside it, renamed over it) with
    every entry of `threshold` bytes or more stored rather than deflated; the entries
    stored. The others, their names, order and times are kept."""
    with zipfile.ZipFile(mar) as source:
        entries = source.infolist()
        large = [e for e in entries if e.file_size >= threshold
                 and e.compress_type != zipfile.ZIP_STORED]
        if not large:
            return 0
        rewritten = mar.with_name(mar.name + ".stored")
        with zipfile.ZipFile(rewritten, "w", allowZip64=True) as target:
            for entry in entries:
                kind = zipfile.ZIP_STORED if entry in large else entry.compress_type
                copy = zipfile.ZipInfo(entry.filename, entry.date_time)
                copy.compress_type, copy.external_attr = kind, entry.external_attr
                if entry.is_dir():
                    target.writestr(copy, b"")
                    continue
                with source.open(entry) as read, target.open(
                        copy, "w", force_zip64=entry.file_size >= ZIP64_BYTES) as write:
                    shutil.copyfileobj(read, write, 1 << 20)
    rewritten.replace(mar)
    return len(large)


def build_mar(export_dir: Path, out_dir: Path, model_name: str, version: str,
              config: dict[str, Any], summary: dict[str, Any], handler: str = CLASSIFIER,
              code: tuple[Path, Path] | None = None) -> Path:
    """Write `<out_dir>/<model_name>.mar` (complete or not at all) and return its path:
    the export folder's files and the archive's code (`code`: a `code_tree` already
    written, or one written here for `handler`). A `handler:` setting that
    `HandlerSettings` does not know raises `UnknownSetting`, naming it, before anything is
    written."""
    HandlerSettings.from_config(config.get("handler"))
    meta = json.loads((export_dir / "export.json").read_text())
    serialized = export_dir / meta["file"]
    staging = out_dir / ".mar.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        tree, entry = code or code_tree(staging / "code", handler)
        (staging / "compress.json").write_text(json.dumps(summary, indent=2))
        config_file = staging / "model-config.yaml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        extra = [p for p in sorted(export_dir.iterdir()) if p.is_file() and p != serialized]
        extra += [tree, staging / "compress.json"]  # a folder: its contents go to the root
        if meta.get("label_names"):
            labels = {str(i): name for i, name in enumerate(meta["label_names"])}
            (staging / "index_to_name.json").write_text(json.dumps(labels, indent=2))
            extra.append(staging / "index_to_name.json")
        command = [sys.executable, "-m", "model_archiver.model_packaging",
                   "--model-name", model_name, "--version", version,
                   "--serialized-file", str(serialized), "--handler", str(entry),
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
        store_large_entries(built)
        final = out_dir / built.name
        built.replace(final)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)
