"""The part of TorchServe's `Context` that compress's handlers use, for a handler run by
another engine (LitServe, Ray Serve: `server_name` says which): the model's folder and
config, the requests' ids and headers, and each answer's status, headers and content type;
`send_chunk(i, chunk)` streams a piece of answer `i` (the handlers use it where a context
has it, TorchServe's intermediate responses elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Reply:
    """What a handler set for one answer so far."""

    status: int = 200
    phrase: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str | None = None

    def head(self) -> tuple[int, dict[str, str], str | None]:
        """(status, headers, content type): what goes out before the body."""
        return self.status, dict(self.headers), self.content_type


class HandlerContext:
    """One batch's context: the handler reads requests from it and sets answers on it."""

    def __init__(self, model_name: str, model_dir: Path, config: dict[str, Any],
                 manifest: dict[str, Any], request_ids: list[str] | None = None,
                 headers: list[dict[str, Any]] | None = None,
                 send: Callable[[int, str | bytes], None] | None = None,
                 server_name: str = "LitServe"):
        self.model_name = model_name
        self.model_yaml_config = config
        self.manifest = manifest
        self.system_properties = {"model_dir": str(model_dir), "gpu_id": None,
                                  "batch_size": int(config.get("batchSize", 1)),
                                  "server_name": server_name, "limit_max_image_pixels": True}
        self.request_ids = dict(enumerate(request_ids or []))
        self.metrics = None
        self.stopping_criteria = None
        self._headers = headers or [{} for _ in self.request_ids]
        self.replies = [Reply() for _ in self.request_ids]
        self._send = send

    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx)

    def get_request_header(self, idx: int, key: str) -> Any:
        return self._headers[idx].get(key)

    def get_all_request_header(self, idx: int) -> dict[str, Any]:
        return self._headers[idx]

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self.replies[idx].status, self.replies[idx].phrase = int(code), phrase or ""

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for idx in range(len(self.replies)):
            self.set_response_status(code, phrase, idx)

    def get_response_status(self, idx: int) -> tuple[int, str]:
        return self.replies[idx].status, self.replies[idx].phrase

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.replies[idx].headers[key] = str(value)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self.replies[idx].headers

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.replies[idx].content_type = value

    def get_response_content_type(self, idx: int) -> str | None:
        return self.replies[idx].content_type

    def send_chunk(self, idx: int, chunk: str | bytes) -> None:
        """Stream `chunk` as the next piece of answer `idx` (its status and headers go out
        with the first)."""
        if self._send is None:
            raise RuntimeError("this context has no requests to stream to")
        self._send(idx, chunk)
