"""What the embedding and reranker handlers share (shipped in every archive's `serve/`;
imports nothing from compress): an exported encoder (`export.json` names its file and
runtime) loaded with a fixed intra-op thread count, with its tokenizer; each TorchServe
batch's requests read into token rows, all rows run together in passes of similar length
(unless the archive's `length_buckets` is false, or the file is packed), each request
answered or failed alone (`serve.batching.answer_batch`). A subclass says how a body reads
(`read`), which paths it answers (`routes`) and how its rows' outputs answer (`answer`)."""

from __future__ import annotations

import abc
import json
import logging
from pathlib import Path
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler

from serve.batching import Row, answer_batch, by_length, padded
from serve.handler_settings import HandlerSettings
from serve.runtimes import load_runtime
from serve.worker_threads import worker_threads

logger = logging.getLogger(__name__)
PROGRESS = "compress worker: "  # what `compress serve` echoes while the worker starts


class ExportedEncoderHandler(BaseHandler, abc.ABC):
    """Loads an exported encoder and answers each batch's rows together."""

    facts_key = ""  # export.json's block of what a server of the file must know
    routes: dict[str, str] = {}  # path under the model's URL -> its route's name

    def initialize(self, context) -> None:
        """Load the exported file with a fixed intra-op thread count, the tokenizer, and
        the subclass's reader (`make_reader`)."""
        from transformers import AutoTokenizer

        model_dir = Path(context.system_properties["model_dir"])
        config = context.model_yaml_config or {}
        self.settings = HandlerSettings.from_config(config.get("handler"))
        logger.info("%sloading %s", PROGRESS, model_dir.name)
        self.meta = json.loads((model_dir / "export.json").read_text())
        self.facts = self.meta.get(self.facts_key) or {}
        self.threads = worker_threads(self.settings.threads, config.get("maxWorkers", 1))
        torch.set_num_threads(self.threads)
        self.forward = load_runtime(model_dir, self.meta, self.threads, spinning=False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_name = context.model_name
        # a packed file (export.json's aoti_packed) computes no padding: a batch is one pass
        self.length_buckets = (self.settings.length_buckets
                               and not self.meta.get("aoti_packed"))
        self.max_tokens = int(self.facts.get("max_seq_length")
                              or self.tokenizer.model_max_length)
        self.reader = self.make_reader()
        self.initialized = True

    @abc.abstractmethod
    def make_reader(self) -> Any:
        """The subclass's reader of request bodies (after the file and tokenizer load)."""

    @abc.abstractmethod
    def read(self, body: Any, route: str | None) -> Any:
        """One request's body read (`.rows`); ValueError: a 400 that says why."""

    @abc.abstractmethod
    def answer(self, one: Any, outputs: list[Any] | Exception) -> Any:
        """One request's answer from its rows' outputs, or its error `(status, message)`."""

    def route_of(self, url_path: str | None) -> str | None:
        """The route of a request's `url_path` header (`routes`), None for the native
        route; LookupError (a 404) for another path."""
        path = (url_path or "").strip("/")
        if not path:
            return None
        if path not in self.routes:
            raise LookupError(f"unknown path {path!r}: this model answers "
                              f"{', '.join(self.routes)} and POST on its own URL")
        return self.routes[path]

    def handle(self, data: list[dict[str, Any]], context) -> list[str]:
        """Answer every request of the batch: forward passes over all good rows."""
        return answer_batch(data, context, self.model_name, self.route_of, self.read,
                            self.run_rows, self.answer)

    def run_rows(self, rows: list[Row]) -> list[torch.Tensor]:
        """The model's output of each row, in passes of similar length unless the archive's
        `length_buckets` is false."""
        return by_length(rows, self.run_padded, self.length_buckets)

    def run_padded(self, rows: list[Row]) -> list[torch.Tensor]:
        """The model's float32 output of each row, the rows right-padded into one pass."""
        inputs = padded(rows, self.tokenizer.pad_token_id or 0, self.meta["inputs"])
        with torch.inference_mode():
            out = self.forward(*inputs)
        out = out[0] if isinstance(out, list | tuple) else out
        return list(out.float())
