"""What every load test accepts: a plain http:// URL on a loopback host (127.0.0.1,
localhost, ::1, so that the tool cannot be pointed at someone else's server), and bounded
concurrency, request and warm-up counts, request bodies and a timeout."""

from __future__ import annotations

from urllib.parse import urlsplit

from compress.errors import UserError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_CONCURRENCY = 256
MAX_REQUESTS = 100_000


def check_loopback(url: str) -> None:
    """Raise UserError unless ``url`` is http:// on 127.0.0.1, localhost or ::1."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        _ = parts.port  # raises ValueError on a malformed port
    except ValueError as exc:
        raise UserError(f"load test URL {url!r} is malformed ({exc}): give one like "
                        "http://127.0.0.1:8080/predictions/MODEL") from None
    if parts.scheme != "http":
        raise UserError(f"load test URL {url!r} uses scheme {parts.scheme or 'none'!r}: "
                        "only plain http:// to a local TorchServe is supported, e.g. "
                        "http://127.0.0.1:8080/predictions/MODEL")
    if host not in LOOPBACK_HOSTS:
        raise UserError(f"load test URL {url!r} points at host {host or 'none'!r}: only "
                        "loopback hosts (127.0.0.1, localhost, ::1) are allowed; run the load "
                        "test on the machine that serves the model")


def check_int(name: str, value: object, low: int, high: int) -> None:
    """Raise UserError unless ``value`` is an integer (not a bool) from ``low`` to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"{name} must be an integer from {low} to {high}, got {value!r}: "
                        "pick a value in that range")


def check_load_args(url: str, concurrency: int, requests: int, payloads: list[bytes],
                    warmup: int, timeout: float) -> None:
    """Raise UserError unless every argument of a load test is in range."""
    check_loopback(url)
    check_int("concurrency", concurrency, 1, MAX_CONCURRENCY)
    check_int("requests", requests, 1, MAX_REQUESTS)
    check_int("warmup", warmup, 0, MAX_REQUESTS)
    if not payloads or not all(isinstance(p, bytes | bytearray) for p in payloads):
        raise UserError("payloads must be a non-empty list of bytes: give at least one "
                        "request body, e.g. [b'{\"text\": \"hello\"}']")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise UserError(f"timeout must be a positive number of seconds, got {timeout!r}")
