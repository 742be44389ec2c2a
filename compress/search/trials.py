"""One search trial: a candidate built into its own folder and measured the one way every
candidate is (eval accuracy, agreement with the float model, latency with the harness in
the runtime it would be served in, file size), cached as `trial.json`.

A trial's key covers the candidate's stage configs, its float layers, the entering model
and the data and latency settings, not the search's tolerance: a killed search resumes
after its last finished trial, and a re-run with another tolerance reuses every trial.
"""

from __future__ import annotations

import shutil
import time
import traceback
from functools import cache
from pathlib import Path
from typing import Any

from compress.data.datasets import DataBundle
from compress.errors import one_line
from compress.measure.figures import latency_sweep, real_latency
from compress.models.bundle import ModelBundle
from compress.recipe.options import StrictModel
from compress.runfolder.code_digest import code_digests
from compress.runfolder.files import atomic_write_json, read_json, sha256_file, sha256_json
from compress.search.quality import Quality

TRIAL_FILE = "trial.json"
VERSION = 1  # bump when what a trial measures changes
BUILDER = "compress.search.candidates"  # builds a trial: its code is part of the key


class Measurer:
    """Measures models on the eval split the same way: the family's quality figures
    (`quality`), b1 and b8 at `seq_len`, and batches of the split's own sentences (b8, and
    the objective `metric`'s batch when it times real lengths at another)."""

    def __init__(self, data: DataBundle, recipe, threads: int, quality: Quality,
                 metric: str = "latency_ms_b8"):
        self.data, self.recipe, self.threads = data, recipe, threads
        self.quality = quality
        self.real_batches = sorted({8, real_batch(metric) or 8})
        self.latency = recipe.evaluation.latency.model_copy(
            update={"batch_sizes": [1, 8], "seq_lens": None, "threads": threads})

    def settings(self) -> dict[str, Any]:
        """What the figures depend on besides the model (part of every trial's key)."""
        settings = {"data": self.recipe.data.model_dump(mode="json"),
                    "batch_size": self.recipe.evaluation.batch_size,
                    "latency": self.latency.model_dump(mode="json"), "seed": self.recipe.seed}
        if self.real_batches != [8]:
            settings["real_batches"] = self.real_batches
        return {**settings, **self.quality.settings()}

    def objective_ms(self, bundle: ModelBundle, metric: str) -> float:
        """One more timing of a latency objective (`latency_ms_b1`, `latency_ms_b8` or
        `latency_ms_bN_real`) of `bundle`, in ms."""
        if (batch := real_batch(metric)) is not None:
            real = real_latency(bundle, self.data.splits["eval"], [batch],
                                self.data.max_length, self.threads,
                                limit=self.latency.real_limit, warmup=self.latency.warmup)
            return real[metric]
        batch = int(metric.removeprefix("latency_ms_b"))
        single = self.latency.model_copy(update={"batch_sizes": [batch]})
        return latency_sweep(bundle, single)[metric]

    def measure(self, bundle: ModelBundle, reference: dict[str, Any] | None
                ) -> dict[str, Any]:
        """The quality figures against `reference` (the entering model's record; None for
        the entering model itself), latencies (ms) and sentences/s at real lengths."""
        figures = self.quality.measure(bundle, reference)
        latency = latency_sweep(bundle, self.latency)
        figures.update({k: latency[k] for k in ("latency_ms_b1", "latency_ms_b8",
                                                "latency_ms_b1_p90", "latency_ms_b8_p90")})
        if bundle.is_text:
            real = real_latency(bundle, self.data.splits["eval"], self.real_batches,
                                self.data.max_length, self.threads,
                                limit=self.latency.real_limit, warmup=self.latency.warmup)
            figures.update({k: v for k, v in real.items() if not k.endswith("_p90")})
        return figures


def real_batch(metric: str) -> int | None:
    """The batch size of a real-lengths objective (`latency_ms_b32_real`: 32), else None."""
    if not metric.endswith("_real"):
        return None
    return int(metric.removeprefix("latency_ms_b").removesuffix("_real"))


@cache
def _builder_code(model_module: str | None = None) -> list[str]:
    """The digests of the code that builds a trial, with the module of the model's class
    (its forms, such as a sentence encoder's packed copy, are built by its methods): read
    once a process, not once a trial."""
    return code_digests([BUILDER, *([model_module] if model_module else [])])


def trial_key(name: str, stages: list[StrictModel], float_layers: list[str], input_sha: str,
              settings: dict[str, Any], model_module: str | None = None) -> str:
    """The cache key of one trial: with the code that builds it (a change to an export pass
    or a kernel builds the trial again)."""
    return sha256_json([VERSION, name, [s.model_dump(mode="json") for s in stages],
                        float_layers, input_sha, settings, _builder_code(model_module)])


def trial_id(name: str, float_layers: list[str], key: str) -> str:
    """The trial's folder name: candidate, float layer count, key prefix."""
    fallback = f"-float{len(float_layers)}" if float_layers else ""
    return f"{name}{fallback}-{key[:8]}"


def cached_trial(folder: Path, key: str) -> dict[str, Any] | None:
    """The finished trial in `folder` with this key whose file is intact, else None."""
    record = read_json(folder / TRIAL_FILE)
    if record.get("key") != key:
        return None
    if record.get("status") == "ok":
        path = folder / record["export_dir"] / record["file"]
        if not path.is_file() or sha256_file(path) != record.get("sha256"):
            return None
    return record


def run_trial(folder: Path, record: dict[str, Any], build, measurer: Measurer,
              reference: dict[str, Any]) -> dict[str, Any]:
    """Build (`build(export_dir) -> facts`) and measure one trial in `folder`; write
    `trial.json` last (atomically), so a killed trial is built again next time. A
    candidate that cannot be built or loaded is recorded as failed, with why."""
    from compress.models.folders import load_export

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    fmt = record["stages"][-1]["format"]
    record = {**record, "export_dir": fmt}
    began = time.perf_counter()
    try:
        facts = build(folder / fmt)
        record["build_s"] = round(time.perf_counter() - began, 2)
        path = folder / fmt / facts.pop("file")
        record.update(file=path.name, sha256=sha256_file(path), bytes=path.stat().st_size,
                      facts=_plain(facts))
        bundle = load_export(folder / fmt, measurer.threads)
        record.update(measurer.measure(bundle, reference), status="ok")
    except Exception as exc:  # noqa: BLE001 - a candidate that fails loses, the search goes on
        (folder / "error.log").write_text(traceback.format_exc())
        record.update(status="failed", error=one_line(exc, 300))
    record["trial_s"] = round(time.perf_counter() - began, 2)
    atomic_write_json(folder / TRIAL_FILE, record)
    return record


def _plain(facts: dict[str, Any]) -> dict[str, Any]:
    """The JSON-writable figures of a build."""
    return {k: v for k, v in facts.items() if isinstance(v, str | int | float | bool)}
