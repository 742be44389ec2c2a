"""An archive's handler as an engine other than TorchServe hosts it: imported from the
unpacked folder as TorchServe imports it (the folder first on `sys.path`, the one class the
module defines), TorchServe's token check and defaults, and an answer as TorchServe sends it.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import inspect
import json
import logging
import sys
from pathlib import Path
from typing import Any

from fastapi import HTTPException

TOKEN_FAILED = ("Token Authorization failed. Token either incorrect, expired, or not "
                "provided correctly")
MAX_REQUEST_SIZE = 6_553_500  # TorchServe's default max_request_size
RESPONSE_TIMEOUT_S = 120.0  # TorchServe's default responseTimeout
MODEL_LOG = "model_log.log"  # TorchServe's name and line format: WorkerLog reads both
DIED = "Backend worker process died."


def load_handler(model_dir: Path, handler_file: str) -> Any:
    """An instance of the one class the archive's handler module defines."""
    sys.path.insert(0, str(model_dir))
    module = importlib.import_module(Path(handler_file).stem)
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if c.__module__ == module.__name__]
    if len(classes) != 1:
        raise ValueError(f"{handler_file} defines {len(classes)} classes: a handler module "
                         f"defines exactly one")
    return classes[0]()


def check_token(authorization: str, token: str | None) -> None:
    """TorchServe's token check of an `Authorization` header: `Bearer <token>` (a 401
    otherwise; nothing is checked when `token` is None)."""
    if token is None:
        return
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                             token.encode()):
        raise HTTPException(401, TOKEN_FAILED)


def token_digest(token: str) -> str:
    """What an engine that runs on other machines keeps of the token: its SHA-256."""
    return hashlib.sha256(token.encode()).hexdigest()


def answer_bytes(value: Any) -> bytes:
    """An answer as TorchServe sends it: bytes as they are, text in UTF-8, else JSON."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return (value if isinstance(value, str) else json.dumps(value)).encode("utf-8")


def model_log(logs: Path, model_name: str, worker: int) -> logging.Logger:
    """The root logger writing `logs/model_log.log` in TorchServe's line format as worker
    `worker` (TorchServe numbers them from 9000), so that `compress serve` reads the
    handler's progress and failures as it does TorchServe's."""
    handler = logging.FileHandler(logs / MODEL_LOG)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [%(levelname)s] W-{worker}-{model_name}-stdout MODEL_LOG - %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return root
