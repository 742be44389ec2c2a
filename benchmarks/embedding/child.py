"""One fresh process of benchmarks/embedding/peers.py: `python -m benchmarks.embedding.child
SPEC_JSON` prints one JSON line (its figures, or {"error": one line}); the rest goes to
stderr.

It runs in a peer's own environment (sentence-transformers, fastembed; compress cannot be
imported there) or in compress's (compress's exports), so it imports the standard library,
numpy and benchmarks/harness/child_main.py only, and each kind's library inside its loader
(the repository is on its PYTHONPATH: compress's exports load through `serve`). Modes:
- "measure": load one row's model and embed the whole list of texts (a JSON file) in ONE
  call with its batch size, as a user calls each library (`model.encode(texts,
  batch_size=B)`: sentence-transformers sorts the list by length before it cuts it into
  batches, fastembed's `embed` takes the batches in order, compress's rows take the
  batches in order and cut each into passes of similar length); first one untimed call on
  the first `warmup` x `batch` texts, then `passes` timed calls on the whole list;
  sentences/s is the texts over a call's time (the median call), and the first call's
  embeddings go to `embeddings` (.npy) when asked. Every kind is texts in, embeddings
  out: the library's own tokenizing is timed with its model. The fixed shape (`fixed`:
  8 texts of 128 tokens) is timed as before, texts in and the model alone.
- "build_onnx" / "build_openvino": sentence-transformers' own int8 files of the source
  model, made in a copy of its folder (its own folder stays as it is: sentence-transformers
  writes its exports beside the weights), each file named relative to that copy.
  "build_onnx": the `onnx` backend's export (`onnx/model.onnx`) and its ONNX Runtime
  dynamic int8 by `export_dynamic_quantized_onnx_model` with the CPU's config
  (`avx512_vnni`, `avx2` or `arm64`, chosen by the parent from /proc/cpuinfo);
  "build_openvino": the `openvino` backend's IR and its static int8 by
  `export_static_quantized_openvino_model` with `OVQuantizationConfig()` (NNCF, 300
  samples), calibrated as its documentation does on SST-2's train sentences (here the
  run's calibration split read by `datasets` from its folder, never the eval texts).
  With `"cross_encoder": true`, "build_onnx" makes a CrossEncoder's files (rerank.py's).
- "rerank": benchmarks/embedding/rerank.py's row, a reranker: load its model, score the
  (query, document) pairs (a JSON file) in order, a call a batch of `batch` (`time_passes`:
  unchanged by issue 72, which moved only the embedding rows to one call), pairs in and
  scores out (sentence-transformers' `CrossEncoder.predict`, torch or
  its ONNX backend, or compress's export as its served handler reads a request); the first
  pass's scores go to `scores` (.npy) when asked.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.child_main import run_modes

Encoder = Callable[[list[str]], np.ndarray]
FASTEMBED_NAME = "compress-peers/local-minilm"  # the custom model's name in fastembed


def load_sentence_transformers(spec: dict[str, Any]) -> Encoder:
    """sentence-transformers on the folder: torch (kind "st"), or its "onnx" / "openvino"
    backend reading `file` from the folder."""
    from sentence_transformers import SentenceTransformer

    backend = {"st": "torch", "st_onnx": "onnx", "st_openvino": "openvino"}[spec["kind"]]
    kwargs = {"model_kwargs": {"file_name": spec["file"]}} if spec.get("file") else {}
    model = SentenceTransformer(spec["folder"], device="cpu", backend=backend, **kwargs)
    batch = spec["batch"]

    def encode(texts: list[str]) -> np.ndarray:
        return model.encode(texts, batch_size=batch, convert_to_numpy=True,
                            show_progress_bar=False)

    def model_call(texts: list[str]) -> Callable[[], Any]:
        import torch

        features = model.tokenize(texts)

        def call() -> Any:
            with torch.inference_mode():
                return model(dict(features))["sentence_embedding"]

        return call

    encode.model_call = model_call  # type: ignore[attr-defined]
    return encode


def load_fastembed(spec: dict[str, Any]) -> Encoder:
    """fastembed's TextEmbedding on the local ONNX file `file` of the folder, registered as
    a custom model with the source model's pooling and normalization."""
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    pooling = {"mean": PoolingType.MEAN, "cls": PoolingType.CLS}[spec.get("pooling", "mean")]
    name = f"{FASTEMBED_NAME}-{Path(spec['file']).stem}"
    TextEmbedding.add_custom_model(model=name, pooling=pooling,
                                   normalization=bool(spec.get("normalize", True)),
                                   sources=ModelSource(hf=name), dim=int(spec["dimensions"]),
                                   model_file=spec["file"])
    model = TextEmbedding(model_name=name, specific_model_path=spec["folder"],
                          threads=spec.get("threads"))
    batch = spec["batch"]

    def encode(texts: list[str]) -> np.ndarray:
        return np.stack(list(model.embed(texts, batch_size=batch)))

    return encode


def load_compress(spec: dict[str, Any]) -> Encoder:
    """One of compress's export folders as a served archive runs it: `serve.runtimes`'
    loader, the folder's tokenizer (truncation at the export's max_seq_length); a call's
    texts in batches of the spec's `batch`, in order, and each batch's texts in passes of
    similar length, each padded to its longest (`serve.batching.by_length`, the handlers'
    `length_buckets`; with the spec's `length_buckets` false, a batch in one pass)."""
    import torch
    from transformers import AutoTokenizer

    from serve.batching import by_length, padded, token_rows
    from serve.runtimes import load_runtime

    folder = Path(spec["folder"])
    meta = json.loads((folder / "export.json").read_text())
    threads = spec.get("threads") or os.cpu_count() or 1
    torch.set_num_threads(threads)
    run = load_runtime(folder, meta, threads)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    max_length = (meta.get("embedding") or {}).get("max_seq_length") or 512

    names, pad = meta["inputs"], tokenizer.pad_token_id or 0

    def one_pass(rows: list[Any]) -> list[np.ndarray]:
        with torch.inference_mode():
            return list(run(*padded(rows, pad, names)).float().numpy())

    batch, buckets = int(spec.get("batch") or 32), spec.get("length_buckets") is not False

    def encode(texts: list[str]) -> np.ndarray:
        out: list[np.ndarray] = []
        for i in range(0, len(texts), batch):  # the batches in order, as a handler gets them
            rows = token_rows(tokenizer, texts[i:i + batch], max_length, names)
            out += by_length(rows, one_pass, buckets)
        return np.stack(out)

    def model_call(texts: list[str]) -> Callable[[], Any]:
        tensors = padded(token_rows(tokenizer, texts, max_length, names), pad, names)

        def call() -> Any:
            with torch.inference_mode():
                return run(*tensors)

        return call

    encode.model_call = model_call  # type: ignore[attr-defined]
    return encode


LOADERS: dict[str, Callable[[dict[str, Any]], Encoder]] = {
    "st": load_sentence_transformers, "st_onnx": load_sentence_transformers,
    "st_openvino": load_sentence_transformers, "fastembed": load_fastembed,
    "compress": load_compress}


def time_passes(encode: Encoder, texts: list[str], batch: int, warmup: int, passes: int
                ) -> tuple[dict[str, Any], np.ndarray]:
    """(the figures, the first pass's outputs) of `encode` called on each batch of `batch`
    in turn (rerank.py's pairs; an embedding row is `time_whole`'s, one call a pass):
    sentences/s of each pass (texts over the summed batch times) and their median, and the
    median batch time."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    for chunk in batches[:warmup]:
        encode(chunk)
    rates, batch_ms, first = [], [], None
    for p in range(passes):
        outputs, total = [], 0.0
        for chunk in batches:
            began = time.perf_counter()
            outputs.append(np.asarray(encode(chunk), dtype=np.float32))
            spent = time.perf_counter() - began
            total += spent
            batch_ms.append(1000 * spent)
        rates.append(len(texts) / total)
        if p == 0:
            first = np.concatenate(outputs)
    return {"items_per_s": round(statistics.median(rates), 2),
            "items_per_s_passes": [round(r, 2) for r in rates],
            "batch_ms_p50": round(statistics.median(batch_ms), 3)}, first


def time_whole(encode: Encoder, texts: list[str], batch: int, warmup: int, passes: int
               ) -> tuple[dict[str, Any], np.ndarray]:
    """(the figures, the first timed call's embeddings) of `encode` called once per pass on
    the whole list, as a user calls a library (it batches, and sorts where it does, by
    itself): after one untimed call on the first `warmup` x `batch` texts (none for 0),
    sentences/s of each pass (the texts over the call's time) and their median."""
    if warmup:
        encode(texts[:warmup * batch])
    rates, seconds, first = [], [], None
    for p in range(passes):
        began = time.perf_counter()
        out = np.asarray(encode(texts), dtype=np.float32)
        spent = time.perf_counter() - began
        seconds.append(round(spent, 4))
        rates.append(len(texts) / spent)
        if p == 0:
            first = out
    return {"items_per_s": round(statistics.median(rates), 2),
            "items_per_s_passes": [round(r, 2) for r in rates], "pass_s": seconds,
            "calls_per_pass": 1}, first


def time_fixed(encode: Encoder, batch: int, length: int, warmup: int, iters: int = 15
               ) -> dict[str, Any]:
    """The median time of a batch of `batch` texts of `length` tokens each (special tokens
    included: `length - 2` words that are one token each), texts in and embeddings out; and,
    where the row's library lets its model be called on tokens (`model_call`), the median
    time of the model alone on the same batch, tokenized once (None for fastembed)."""
    texts = [" ".join(["word"] * (length - 2))] * batch
    figures: dict[str, Any] = {"fixed_ms": _median_ms(lambda: encode(texts), warmup, iters),
                               "fixed_shape": [batch, length]}
    model_call = getattr(encode, "model_call", None)
    figures["fixed_model_ms"] = (_median_ms(model_call(texts), warmup, iters)
                                 if model_call else None)
    return figures


def _median_ms(call: Callable[[], Any], warmup: int, iters: int) -> float:
    """The median time of `iters` calls after `warmup` (at least one) untimed, in ms."""
    for _ in range(max(warmup, 1)):
        call()
    times = []
    for _ in range(iters):
        began = time.perf_counter()
        call()
        times.append(1000 * (time.perf_counter() - began))
    return round(statistics.median(times), 3)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the row's model, time it on the texts, save its embeddings when asked."""
    texts = json.loads(Path(spec["texts"]).read_text())["texts"]
    began = time.perf_counter()
    encode = LOADERS[spec["kind"]](spec)
    load_s = time.perf_counter() - began
    figures, embeddings = time_whole(encode, texts, spec["batch"], spec["warmup"],
                                     spec["passes"])
    if spec.get("embeddings"):
        np.save(spec["embeddings"], embeddings)
    if spec.get("fixed"):
        figures.update(time_fixed(encode, *spec["fixed"], spec["warmup"]))
    return {**figures, "load_s": round(load_s, 3), "texts": len(texts),
            "dimensions": int(embeddings.shape[1]), "pid": os.getpid()}


def _copy(source: str, folder: str) -> Path:
    """A fresh copy of the source model's folder at `folder`."""
    target = Path(folder)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return target


def _sizes(folder: Path, files: dict[str, str]) -> dict[str, float]:
    """MB of each file (an OpenVINO .xml with its .bin)."""
    sizes = {}
    for key, name in files.items():
        path = folder / name
        extra = path.with_suffix(".bin") if path.suffix == ".xml" else None
        total = path.stat().st_size + (extra.stat().st_size if extra and extra.is_file() else 0)
        sizes[key] = round(total / 2**20, 3)
    return sizes


def build_onnx(spec: dict[str, Any]) -> dict[str, Any]:
    """`onnx/model.onnx` and `onnx/model_q(u)int8_<isa>.onnx` in a copy of the source folder
    (a SentenceTransformer's, or with `cross_encoder` a CrossEncoder's)."""
    from sentence_transformers import (
        CrossEncoder,
        SentenceTransformer,
        export_dynamic_quantized_onnx_model,
    )

    folder = _copy(spec["source"], spec["folder"])
    model_class = CrossEncoder if spec.get("cross_encoder") else SentenceTransformer
    model = model_class(str(folder), device="cpu", backend="onnx")
    model.save_pretrained(str(folder))  # the export the backend made on load
    isa = spec["isa"]
    export_dynamic_quantized_onnx_model(model, isa, str(folder))
    # named for its weights' type: qint8 (avx512_vnni, arm64) or quint8 (avx2, avx512)
    written = sorted((folder / "onnx").glob(f"model_*int8_{isa}.onnx"))
    files = {"fp32": "onnx/model.onnx",
             "int8": f"onnx/{written[0].name}" if written else f"onnx/model_qint8_{isa}.onnx"}
    missing = [name for name in files.values() if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"sentence-transformers wrote no {', '.join(missing)} in "
                                f"{folder}")
    return {"files": files, "size_mb": _sizes(folder, files), "isa": isa}


def build_openvino(spec: dict[str, Any]) -> dict[str, Any]:
    """`openvino/openvino_model.xml` and its static int8 `..._qint8_quantized.xml` in a copy
    of the source folder, calibrated on `calibration` (a folder of split files)."""
    from optimum.intel import OVQuantizationConfig
    from sentence_transformers import SentenceTransformer, export_static_quantized_openvino_model

    folder = _copy(spec["source"], spec["folder"])
    model = SentenceTransformer(str(folder), device="cpu", backend="openvino")
    model.save_pretrained(str(folder))
    calibration = spec["calibration"]
    config = OVQuantizationConfig(num_samples=calibration["samples"])
    export_static_quantized_openvino_model(
        model, config, str(folder), dataset_name=calibration["dataset"],
        dataset_config_name="default",  # a local folder of split files has one config
        dataset_split=calibration["split"], column_name=calibration["column"])
    files = {"fp32": "openvino/openvino_model.xml",
             "int8": "openvino/openvino_model_qint8_quantized.xml"}
    missing = [name for name in files.values() if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"sentence-transformers wrote no {', '.join(missing)} in "
                                f"{folder}")
    return {"files": files, "size_mb": _sizes(folder, files),
            "calibration": f"{calibration['samples']} sentences of {calibration['dataset']} "
                           f"({calibration['split']}, {calibration['column']})"}


# ------------------------------------------------------------------ rerankers (rerank.py)

Scorer = Callable[[list[list[str]]], np.ndarray]  # (query, document) pairs in, scores out
FIXED_QUERY_WORDS = 8  # the fixed shape's query; its document fills the rest


def load_cross_encoder(spec: dict[str, Any]) -> Scorer:
    """sentence-transformers' CrossEncoder on the folder: torch (kind "ce"), or its "onnx"
    backend reading `file` from the folder (kind "ce_onnx"); `predict`, its activation
    applied, as a user calls it."""
    from sentence_transformers import CrossEncoder

    backend = "onnx" if spec["kind"] == "ce_onnx" else "torch"
    kwargs = {"model_kwargs": {"file_name": spec["file"]}} if spec.get("file") else {}
    model = CrossEncoder(spec["folder"], device="cpu", backend=backend, **kwargs)
    batch = spec["batch"]

    def score(pairs: list[list[str]]) -> np.ndarray:
        return model.predict([(q, d) for q, d in pairs], batch_size=batch,
                             convert_to_numpy=True, show_progress_bar=False)

    def model_call(pairs: list[list[str]]) -> Callable[[], Any]:
        import torch

        features = model.preprocess([(q, d) for q, d in pairs])  # what predict tokenizes

        def call() -> Any:
            with torch.inference_mode():
                return model.activation_fn(model(features)["scores"])

        return call

    score.model_call = model_call  # type: ignore[attr-defined]
    return score


def load_compress_reranker(spec: dict[str, Any]) -> Scorer:
    """One of compress's reranker exports as its served handler runs it: `serve.runtimes`'
    loader, the folder's tokenizer, each query's pairs tokenized as the handler reads a
    request (`serve/reranker/requests.py`: `tokenizer(query, document)` cut longest-first
    at the export's max_seq_length), a batch's pairs in passes of similar length
    (`serve.batching.by_length`)."""
    import torch
    from transformers import AutoTokenizer

    from serve.batching import by_length, padded
    from serve.reranker.requests import Limits, Reader
    from serve.runtimes import load_runtime

    folder = Path(spec["folder"])
    meta = json.loads((folder / "export.json").read_text())
    threads = spec.get("threads") or os.cpu_count() or 1
    torch.set_num_threads(threads)
    run = load_runtime(folder, meta, threads)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    names, pad = meta["inputs"], tokenizer.pad_token_id or 0
    longest = (meta.get("reranker") or {}).get("max_seq_length") or tokenizer.model_max_length
    reader = Reader(tokenizer, names, Limits(len(names), 0, int(longest)))

    def rows_of(pairs: list[list[str]]) -> list[Any]:
        rows: list[Any] = []
        for query, documents in _by_query(pairs):
            rows += reader.pair_rows(query, documents)
        return rows

    def one_pass(rows: list[Any]) -> list[float]:
        with torch.inference_mode():
            out = run(*padded(rows, pad, names))
        out = out[0] if isinstance(out, list | tuple) else out
        return out.float().reshape(-1).tolist()

    def score(pairs: list[list[str]]) -> np.ndarray:
        return np.asarray(by_length(rows_of(pairs), one_pass), dtype=np.float32)

    def model_call(pairs: list[list[str]]) -> Callable[[], Any]:
        tensors = padded(rows_of(pairs), pad, names)

        def call() -> Any:
            with torch.inference_mode():
                return run(*tensors)

        return call

    score.model_call = model_call  # type: ignore[attr-defined]
    return score


def _by_query(pairs: list[list[str]]) -> list[tuple[str, list[str]]]:
    """Consecutive pairs of one query as (query, its documents), in order."""
    grouped: list[tuple[str, list[str]]] = []
    for query, document in pairs:
        if not grouped or grouped[-1][0] != query:
            grouped.append((query, []))
        grouped[-1][1].append(document)
    return grouped


RERANKERS: dict[str, Callable[[dict[str, Any]], Scorer]] = {
    "ce": load_cross_encoder, "ce_onnx": load_cross_encoder,
    "compress": load_compress_reranker}


def fixed_pairs(batch: int, length: int) -> list[list[str]]:
    """`batch` pairs of `length` tokens each (special tokens included): a query of
    FIXED_QUERY_WORDS words and a document filling the rest, words of one token each."""
    document = max(length - 3 - FIXED_QUERY_WORDS, 1)
    return [[" ".join(["word"] * FIXED_QUERY_WORDS), " ".join(["word"] * document)]] * batch


def rerank(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the reranker row's model, time it on the pairs a batch a call, save
    its scores when asked; and at the fixed shape, the pairs in and the model alone on
    them tokenized once (`fixed_ms`, `fixed_model_ms`)."""
    pairs = json.loads(Path(spec["pairs"]).read_text())["pairs"]
    began = time.perf_counter()
    score = RERANKERS[spec["kind"]](spec)
    load_s = time.perf_counter() - began
    figures, scores = time_passes(score, pairs, spec["batch"], spec["warmup"],
                                  spec["passes"])
    if spec.get("scores"):
        np.save(spec["scores"], scores.reshape(-1))
    if spec.get("fixed"):
        shaped = fixed_pairs(*spec["fixed"])
        figures.update(fixed_shape=list(spec["fixed"]),
                       fixed_ms=_median_ms(lambda: score(shaped), spec["warmup"], 15),
                       fixed_model_ms=_median_ms(score.model_call(shaped),  # type: ignore[attr-defined]
                                                 spec["warmup"], 15))
    return {**figures, "load_s": round(load_s, 3), "pairs": len(pairs), "pid": os.getpid()}


def main(argv: list[str] | None = None) -> int:
    """Run the spec's mode and print its JSON line; 1 with {"error": ...} when it fails."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model and split here is on disk
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return run_modes({"measure": measure, "build_onnx": build_onnx,
                      "build_openvino": build_openvino, "rerank": rerank}, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
