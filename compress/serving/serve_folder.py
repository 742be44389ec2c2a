"""The serve folder's files and the machine's state for compress.serving.server: the registry of
servers compress started, tokens, `server.json` and ports."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

SERVER_INFO = "server.json"  # mode 0600: it holds the inference token
KEY_FILE = "key_file.json"
PID_FILE = ".model_server.pid"  # in the server's temporary folder
TEMP_PREFIX = "compress-serve-"


def server_temp() -> Path:
    """A new temporary folder for one server, its processes' TMPDIR, removed when it stops:
    TorchServe's launcher writes its pid file there, and what the workers unpack goes with
    the server (AOTInductor extracts each .pt2 it loads, 60 MB for a SmolLM2 decode step,
    and a killed worker never removes it). Under the system's, not the serve folder: the
    AF_UNIX sockets LitServe's processes make there allow 107 bytes of path."""
    return Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))


def remove_server_temp(folder: str | Path | None) -> None:
    """Remove a folder `server_temp` made (any other path is left alone)."""
    path = Path(folder or "")
    if path.name.startswith(TEMP_PREFIX) and path.parent == Path(tempfile.gettempdir()):
        shutil.rmtree(path, ignore_errors=True)


def registry_dir() -> Path:
    """Where started servers are listed for `compress serve --stop` without a target."""
    base = os.environ.get("COMPRESS_STATE_DIR") or Path.home() / ".local/state/compress"
    return Path(base) / "servers"


def token_of(run_dir: str | Path) -> str | None:
    """The inference token of the server of a run folder (None when auth is off)."""
    info = read_info(Path(run_dir) / "serve")
    return info.get("token") if info else None


def write_keys(serve_dir: Path, token: str) -> None:
    """TorchServe's key file with `token` for every API, readable by its owner only (the
    LitServe and Ray engines' token, read back with `read_keys`)."""
    from compress.runfolder.files import atomic_write_json

    atomic_write_json(serve_dir / KEY_FILE,
                      {name: {"key": token} for name in ("management", "inference", "API")},
                      mode=0o600)


def read_keys(serve_dir: Path) -> dict[str, str]:
    """TorchServe's tokens: {"management", "inference", "api"}."""
    keys = json.loads((serve_dir / KEY_FILE).read_text())
    return {"management": keys["management"]["key"], "inference": keys["inference"]["key"],
            "api": keys["API"]["key"]}


def read_info(serve_dir: Path) -> dict[str, Any] | None:
    """The server.json of a serve folder, or None."""
    try:
        return json.loads((serve_dir / SERVER_INFO).read_text())
    except (OSError, ValueError):
        return None


def write_info(serve_dir: Path, info: dict[str, Any]) -> None:
    """Write server.json readable by its owner only (like TorchServe's key file)."""
    from compress.runfolder.files import atomic_write_json

    atomic_write_json(serve_dir / SERVER_INFO, info, mode=0o600)


def record_server(serve_dir: Path, info: dict[str, Any]) -> None:
    """Write server.json and list the server in the registry (`compress serve --stop`)."""
    write_info(serve_dir, info)
    registry_dir().mkdir(parents=True, exist_ok=True)
    (registry_dir() / f"{info['pid']}.json").write_text(json.dumps({"serve_dir": str(serve_dir)}))


def token_command(info: dict[str, Any]) -> str:
    """A shell line that puts the server's inference token into $TOKEN."""
    import shlex

    path = Path(info["serve_dir"]) / SERVER_INFO
    return ("TOKEN=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))"
            f"[\"token\"])' {shlex.quote(str(path))})")


def port_in_use(port: int) -> bool:
    """Whether something listens on (or holds) 127.0.0.1:`port`. Connections a stopped
    server closed first (TIME_WAIT, as uvicorn's) do not count: servers bind with
    SO_REUSEADDR, as this probe does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def free_ports(n: int, avoid: set[int] = frozenset()) -> list[int]:
    """`n` distinct free loopback ports (the OS picks them)."""
    ports: list[int] = []
    sockets = []
    try:
        while len(ports) < n:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            if sock.getsockname()[1] not in avoid:
                ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports
