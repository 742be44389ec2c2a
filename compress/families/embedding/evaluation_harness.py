"""MTEB (the Massive Text Embedding Benchmark) over compress's embedding models: one MTEB
encoder (`MtebEncoder`) over three embedders that answer alike:

- `ExportEmbedder`: an embedding export folder (`export.json`'s `embedding` block), run as
  its served handler runs it: the archive's own request reader (prompts, truncation at
  max_seq_length, `dimensions`), passes of similar length, the file in its own runtime;
- `EndpointEmbedder`: a served OpenAI `/v1/embeddings` (TorchServe or LitServe), with the
  archive's inference token;
- `ModuleEmbedder`: a stage's model (in memory, or an exported file), for a recipe's
  `evaluation.mteb`, its texts read as the server reads them too.

MTEB's query and document texts become OpenAI's `input_type` query and document (the
model's prompt of that kind, none where it has none), so that the three read the same
tokens. `task_scores` runs tasks (the local ones in `local_tasks`, or any of MTEB's own
whose data can be reached) and names each main score `mteb_<task>_<metric>`.

    compress-mteb --folder runs/embed_int8/04-int8_aoti --tasks SST2LocalClassification
    compress-mteb --url http://127.0.0.1:8080/predictions/embed_int8/1.0/v1 --token T ...
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm

from compress.report.render import MTEB  # a metric's prefix: mteb_<task>_<main score>
from export.folder import META, load_export
from export.graphs import TEXT_INPUTS
from serve.batching import by_length, padded
from serve.embedding.requests import INPUT_TYPES, Limits, Reader, narrowed

REQUEST_TEXTS = 32  # texts in one request to an endpoint (and one offline read)


class Embedder(Protocol):
    """Texts in, one float32 row per text out (`input_type`: query, document or None)."""

    name: str

    def embed(self, texts: list[str], input_type: str | None) -> torch.Tensor: ...


class ServedReading:
    """Texts read as the served handler reads them (`serve.embedding.requests.Reader`: the
    prompt of the input type, truncation at max_seq_length tokens), run in passes of similar
    length and cut at the width an answer has; `forward` runs one pass (positional input
    tensors in the order of `names`)."""

    name = "model"
    buckets = True  # passes of similar length (a packed file: one pass)

    def __init__(self, tokenizer: Any, names: list[str], facts: dict[str, Any],
                 max_tokens: int, forward: Callable[..., Any]) -> None:
        self.tokenizer, self.names, self.forward = tokenizer, list(names), forward
        self.normalize = bool(facts.get("normalize"))
        facts = {**facts, "dimensions": facts.get("dimensions") or 1 << 30}
        self.reader = Reader(tokenizer, self.names,
                             Limits.of_export(facts, REQUEST_TEXTS, 1 << 30, max_tokens))

    def embed(self, texts: list[str], input_type: str | None) -> torch.Tensor:
        read = self.reader.openai({"input": texts, "input_type": input_type})
        vectors = torch.stack(by_length(read.rows, self.run_padded, self.buckets))
        return narrowed(vectors, read.dimensions, self.normalize)

    @torch.inference_mode()
    def run_padded(self, rows: list[Any]) -> list[torch.Tensor]:
        inputs = padded(rows, self.tokenizer.pad_token_id or 0, self.names)
        out = self.forward(*inputs)
        out = out[0] if isinstance(out, list | tuple) else out
        return list(out.float())


class ExportEmbedder(ServedReading):
    """An embedding export folder, embedding texts as its served endpoint does."""

    def __init__(self, folder: str | Path, threads: int | None = None) -> None:
        folder = Path(folder)
        meta_file = folder / META
        if not meta_file.is_file():
            raise ValueError(f"{folder}: not an export folder (no {META})")
        meta = json.loads(meta_file.read_text())
        facts = meta.get("embedding")
        if not facts:
            raise ValueError(f"{folder}: not an embedding export (its {META} has no "
                             "embedding block); export an embedding recipe's model")
        loaded = load_export(folder, threads)
        max_tokens = int(facts.get("max_seq_length") or loaded.tokenizer.model_max_length)
        super().__init__(loaded.tokenizer, meta["inputs"], facts, max_tokens, loaded.model.run)
        self.name = folder.name
        self.buckets = not meta.get("aoti_packed")


class EndpointEmbedder:
    """A served OpenAI `/v1/embeddings`: `url` is the route's base (`.../v1`)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/") + "/embeddings"
        self.token, self.timeout_s = token, timeout_s
        self.name = url

    def embed(self, texts: list[str], input_type: str | None) -> torch.Tensor:
        body = {"input": texts, "model": "compress"}
        if input_type:
            body["input_type"] = input_type
        request = urllib.request.Request(self.url, json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                answer = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{self.url} answered {exc.code}: "
                               f"{exc.read()[:300].decode(errors='replace')}") from None
        rows = sorted(answer["data"], key=lambda row: row["index"])
        return torch.tensor([row["embedding"] for row in rows], dtype=torch.float32)


class ModuleEmbedder(ServedReading):
    """A stage's model (a pipeline `ModelBundle`: an in-memory encoder, or an exported file
    in its runtime) read as its server would read it: `facts` says what export.json's
    embedding block would (prompts, default prompt, truncate_dim), `max_tokens` where texts
    are cut."""

    def __init__(self, bundle: Any, facts: dict[str, Any], max_tokens: int,
                 name: str = "model") -> None:
        from compress.measure.evaluate import logits_of

        model = bundle.model.eval()
        super().__init__(bundle.tokenizer, list(TEXT_INPUTS), facts, max_tokens,
                         lambda *inputs: logits_of(model, dict(zip(TEXT_INPUTS, inputs,
                                                                   strict=True))))
        self.name = name


class MtebEncoder:
    """An `Embedder` as an MTEB encoder (its EncoderProtocol), cosine similarity."""

    def __init__(self, embedder: Embedder, progress: bool | None = None) -> None:
        from mteb.models.model_meta import ModelMeta

        self.embedder = embedder
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.mteb_model_meta = ModelMeta.create_empty(overwrites={
            "name": f"compress/{embedder.name}", "revision": "local",
            "similarity_fn_name": "cosine", "framework": ["PyTorch"]})

    def encode(self, inputs: Any, *, task_metadata: Any, hf_split: str, hf_subset: str,
               prompt_type: Any = None, **kwargs: Any) -> np.ndarray:
        texts = [str(text) for batch in inputs for text in batch["text"]]
        input_type = getattr(prompt_type, "value", prompt_type)  # PromptType.query: "query"
        if input_type not in INPUT_TYPES:
            input_type = None
        chunks = range(0, len(texts), REQUEST_TEXTS)
        rows = [self.embedder.embed(texts[i:i + REQUEST_TEXTS], input_type)
                for i in tqdm(chunks, desc=f"embed {task_metadata.name}", unit="batch",
                              disable=not self.progress)]
        return torch.cat(rows).numpy() if rows else np.zeros((0, 0), np.float32)

    def similarity(self, embeddings1: Any, embeddings2: Any) -> Any:
        from mteb.similarity_functions import cos_sim

        return cos_sim(embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1: Any, embeddings2: Any) -> Any:
        from mteb.similarity_functions import pairwise_cos_sim

        return pairwise_cos_sim(embeddings1, embeddings2)


def tasks_named(names: list[str], limit: int | None = None) -> list[Any]:
    """The MTEB tasks `names`: the local ones (`local_tasks.LOCAL_TASKS`, shrunk to `limit`
    validation sentences), else MTEB's own (ValueError: neither)."""
    import mteb

    from compress.families.embedding.local_tasks import LOCAL_TASKS

    tasks = []
    for name in names:
        if name in LOCAL_TASKS:
            task = LOCAL_TASKS[name]()
            task.limit = limit
        else:
            try:
                task = mteb.get_task(name)
            except KeyError:
                raise ValueError(f"MTEB task {name!r} not found: not one of MTEB's, nor a "
                                 f"local one ({', '.join(LOCAL_TASKS)})") from None
        tasks.append(task)
    return tasks


def task_scores(embedder: Embedder, tasks: list[str], limit: int | None = None,
                progress: bool | None = None) -> dict[str, float]:
    """MTEB's main score of each of `tasks` for `embedder`, as `mteb_<task>_<metric>`
    (rounded to 6 places; scores on a 0-1 scale, as MTEB gives them)."""
    import datasets
    import mteb

    encoder = MtebEncoder(embedder, progress)
    chosen = tasks_named(tasks, limit)
    metrics = {task.metadata.name: task.metadata.main_score for task in chosen}
    bars = datasets.is_progress_bar_enabled()
    if not encoder.progress:
        datasets.disable_progress_bars()  # its map's bars, in MTEB's data preparation
    try:
        result = mteb.evaluate(encoder, chosen, cache=None,
                               show_progress_bar=encoder.progress,
                               encode_kwargs={"batch_size": REQUEST_TEXTS,
                                              "show_progress_bar": encoder.progress})
    finally:
        if bars:
            datasets.enable_progress_bars()
    scores = {}
    for task in result.task_results:  # each split's and subset's main score: their mean
        values = [float(subset["main_score"]) for split in task.scores.values()
                  for subset in split]
        scores[f"{MTEB}{task.task_name}_{metrics[task.task_name]}"] = round(
            sum(values) / len(values), 6)
    return scores
