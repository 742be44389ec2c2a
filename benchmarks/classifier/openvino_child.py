"""The OpenVINO peer's own process, run with the peer environment's Python (OpenVINO and
NNCF are not in compress's environment): `python -m benchmarks.classifier.openvino_child
SPEC_JSON` prints one JSON line, the figures or {"error": one line}; the rest goes to
stderr. It imports the standard library and benchmarks/harness/child_main.py alone (each
mode's libraries inside it).

Two modes:
- "build": OpenVINO reads Optimum's fp32 ONNX file, NNCF quantizes it to int8 (static,
  the transformer preset, calibrated on the run's calibration sentences), and the IR is
  saved as `openvino_model.xml` + `.bin` in the spec's folder.
- "measure": compiles the IR for the CPU (latency hint, every core) and measures it as
  benchmarks/classifier/child.py measures compress's files: accuracy on the eval split, batch
  1 and 8 at 128 tokens (the same token ids compress's harness draws), and the eval
  sentences in order, batches padded to their longest.

Helpers that need neither OpenVINO nor torch (`padded_batches`, `summary`) are imported by
compress's tests to check they batch as compress's harness does.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.child_main import run_modes

XML = "openvino_model.xml"
EVAL_FILE = "eval.json"  # {"texts", "labels", "calibration", "max_length", "batch_size"}


def padded_batches(tokenizer: Any, texts: list[str], batch: int, max_length: int
                   ) -> list[dict[str, Any]]:
    """`texts` in order in batches of `batch`, each padded to its longest (int64 numpy)."""
    out = []
    for start in range(0, len(texts), batch):
        enc = tokenizer(texts[start:start + batch], padding="longest", truncation=True,
                        max_length=max_length, return_tensors="np")
        out.append({k: v.astype("int64") for k, v in enc.items()})
    return out


def summary(samples: list[float]) -> tuple[float, float]:
    """(median, p90) of timings in ms, as compress's harness computes them."""
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1,
                                                   round(0.9 * (len(ordered) - 1)))]


def _feed(inputs: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {name: inputs[name] for name in names}


def build(spec: dict[str, Any]) -> dict[str, Any]:
    """Quantize Optimum's fp32 ONNX with NNCF; the IR's size."""
    import nncf
    import openvino as ov
    from transformers import AutoTokenizer

    folder = Path(spec["folder"])
    data = json.loads((folder / EVAL_FILE).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["source"])
    model = ov.Core().read_model(str(Path(spec["source"]) / "model.onnx"))
    names = [port.get_any_name() for port in model.inputs]
    calibration = padded_batches(tokenizer, data["calibration"], 1, data["max_length"])
    began = time.perf_counter()
    quantized = nncf.quantize(model, nncf.Dataset(calibration, lambda x: _feed(x, names)),
                              model_type=nncf.ModelType.TRANSFORMER,
                              subset_size=len(calibration))
    ov.save_model(quantized, str(folder / XML))
    return {"build_s": round(time.perf_counter() - began, 1), "inputs": names,
            "size_mb": sum((folder / f).stat().st_size for f in (XML, "openvino_model.bin"))
            / 1e6}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Accuracy, fixed-length and real-length latency of the IR in `spec["folder"]`."""
    import numpy as np
    import openvino as ov
    import torch
    from transformers import AutoTokenizer

    folder = Path(spec["folder"])
    data = json.loads((folder / EVAL_FILE).read_text())
    lat = spec["latency"]
    began = time.perf_counter()
    compiled = ov.Core().compile_model(str(folder / XML), "CPU", {
        "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": os.cpu_count() or 1})
    request = compiled.create_infer_request()
    names = [port.get_any_name() for port in compiled.inputs]
    tokenizer = AutoTokenizer.from_pretrained(spec["source"])
    figures: dict[str, Any] = {"load_s": round(time.perf_counter() - began, 3)}

    def run(inputs: dict[str, Any]) -> Any:
        return request.infer(_feed(inputs, names))[compiled.output(0)]

    texts, labels = data["texts"], data["labels"]
    if spec.get("accuracy"):
        began = time.perf_counter()
        predicted = [int(p) for inputs in padded_batches(tokenizer, texts, data["batch_size"],
                                                         data["max_length"])
                     for p in np.argmax(run(inputs), axis=-1)]
        hits = sum(p == y for p, y in zip(predicted, labels, strict=True))
        figures["accuracy"] = hits / len(labels)
        figures["eval_size"] = len(labels)
        figures["eval_s"] = round(time.perf_counter() - began, 3)
    low = max(tokenizer.all_special_ids, default=0) + 1
    for batch in lat["batch_sizes"]:  # the token ids export.graphs.example_inputs draws
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(low, tokenizer.vocab_size, (batch, lat["seq_len"]),
                            generator=generator).numpy()
        inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids),
                  "token_type_ids": np.zeros_like(ids)}
        samples = _timed([inputs] * (lat["warmup"] + lat["iters"]), run, lat["warmup"])
        figures[f"latency_ms_b{batch}"], figures[f"latency_ms_b{batch}_p90"] = (
            round(v, 3) for v in summary(samples))
    limit = spec.get("real_limit") or len(texts)
    for batch in lat["batch_sizes"]:
        batches = padded_batches(tokenizer, texts[:limit], batch, data["max_length"])
        samples = _timed(batches[:lat["warmup"]] + batches, run, lat["warmup"])
        figures[f"latency_ms_b{batch}_real"], figures[f"latency_ms_b{batch}_real_p90"] = (
            round(v, 3) for v in summary(samples))
        figures[f"real_tokens_b{batch}"] = round(
            sum(b["input_ids"].shape[1] for b in batches) / len(batches), 1)
        figures[f"real_items_per_s_b{batch}"] = round(1000 * limit / sum(samples), 1)
    figures["latency_threads"] = os.cpu_count()
    return {**figures, "folder": str(folder), "pid": os.getpid()}


def _timed(batches: list[dict[str, Any]], run: Any, warmup: int) -> list[float]:
    """ms per call of all but the first `warmup` batches."""
    samples = []
    for i, inputs in enumerate(batches):
        start = time.perf_counter()
        run(inputs)
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1000)
    return samples


def main(argv: list[str] | None = None) -> int:
    """The spec's mode, its JSON line on stdout (`child_main.run_modes`)."""
    return run_modes({"build": build, "measure": measure}, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
