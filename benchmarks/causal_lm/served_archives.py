"""compress's side of benchmarks/causal_lm/served.py: the `llm_int8` and `llm_int4` archives
(run folders made by `compress run recipes/<name>.yaml` when missing), what their
model-config says (model name and version, the KV cache positions a row holds), and copies
of an archive with handler settings written into its model-config.yaml (`compress serve`
takes workers and batch settings on its command line, no handler settings).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.paths import REPO
from benchmarks.harness.venv import PeerError
from compress.errors import UserError
from compress.serving.serve_target import resolve_target

SCHEMES = {"int8": {"recipe": "llm_int8", "quants": ("Q8_0",)},
           "int4": {"recipe": "llm_int4", "quants": ("Q4_0", "Q4_1")}}
CONFIG = "model-config.yaml"
DEFAULT_CACHE_LEN = 512  # serve/causal_lm/server/requests.py's Limits.cache_len
PREFIX_ROOM = 64  # chat template and the question, in tokens, beside a shared prefix


def ensure_run(target: Path, recipe: str, build: bool, echo: Callable[[str], None]) -> Path:
    """The archive of `target` (a run folder or a .mar); a missing or unfinished run folder
    is made first with `python -m compress run recipes/<recipe>.yaml` when `build` (its
    output in `<target>.log`)."""
    try:
        return resolve_target(target).mar
    except UserError as exc:
        if not build or target.suffix == ".mar":
            raise PeerError(f"{target}: {exc}") from None
        reason = str(exc)
    if target.name != recipe:
        raise PeerError(f"{target}: {reason}; a run folder this benchmark makes is named "
                        f"after its recipe ({recipe})")
    log = target.with_name(f"{target.name}.log")
    target.parent.mkdir(parents=True, exist_ok=True)
    echo(f"serve_peers_llm: {target} has no archive ({reason}); making it with compress run "
         f"recipes/{recipe}.yaml (minutes; output in {log})")
    with open(log, "ab") as out:
        done = subprocess.run([sys.executable, "-m", "compress", "run",
                               str(REPO / "recipes" / f"{recipe}.yaml"),
                               f"output_dir={target.parent}"], stdout=out,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise PeerError(f"compress run recipes/{recipe}.yaml exited with {done.returncode} "
                        f"(output in {log})")
    return resolve_target(target).mar


def archive_facts(mar: Path) -> dict[str, Any]:
    """Model name, version, KV cache positions a row (`cache_len`), decode rows and the
    largest max_new_tokens of an archive."""
    with zipfile.ZipFile(mar) as archive:
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        names = archive.namelist()
        config = yaml.safe_load(archive.read(CONFIG)) if CONFIG in names else {}
    handler = (config or {}).get("handler") or {}
    if handler.get("task") != "causal-lm":
        raise PeerError(f"{mar}: not a causal LM's archive (handler task "
                        f"{handler.get('task')!r})")
    return {"model_name": manifest["model"]["modelName"],
            "version": str(manifest["model"].get("modelVersion") or "1.0"),
            "cache_len": int(handler.get("cache_len") or DEFAULT_CACHE_LEN),
            "rows": int(handler.get("rows") or config.get("batchSize") or 1),
            "max_new_tokens": handler.get("max_new_tokens"),
            "prefix_cache": handler.get("prefix_cache")}


def with_handler_settings(mar: Path, out_dir: Path, settings: dict[str, Any]) -> Path:
    """A copy of `mar` in `out_dir` (same file name, same model) whose model-config.yaml's
    `handler` has `settings` written over it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copy = out_dir / mar.name
    with zipfile.ZipFile(mar) as source, zipfile.ZipFile(copy, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == CONFIG:
                config = yaml.safe_load(data) or {}
                config["handler"] = {**(config.get("handler") or {}), **settings}
                data = yaml.safe_dump(config, sort_keys=False).encode()
            target.writestr(item, data)
    return copy


def prefix_cache_len(facts: dict[str, Any], shared_prefix: int, max_tokens: int) -> int:
    """The cache positions a row needs for a `shared_prefix`-token system prompt, its
    question and `max_tokens` new tokens: the archive's, or more (a multiple of 64)."""
    need = shared_prefix + PREFIX_ROOM + max_tokens
    return max(facts["cache_len"], -(-need // 64) * 64)
