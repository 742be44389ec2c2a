"""What a served process tree listens on, read from /proc (`compress.system.processes`):
the served tests of split models check that no socket of TorchServe, torchrun's agent or a
rank listens beyond 127.0.0.1 / ::1."""

from __future__ import annotations

from typing import Any

from compress.system import processes


def assert_only_loopback_listeners(info: dict[str, Any], ranks: int) -> list[str]:
    """Every TCP socket that TorchServe (`info["pid"]`) and the processes it started listen
    on is a loopback one, and each of the `ranks` worker processes holds one (gloo's: the
    check saw the ranks); returns them, written out."""
    tree = processes.tree(info["pid"])
    found = processes.listeners(tree)
    beyond = [str(listener) for listener in found if not listener.loopback]
    assert not beyond, "listening beyond loopback: " + "; ".join(beyond)
    workers = {listener.pid for listener in found
               if "model_service_worker" in processes.command_line(listener.pid)}
    assert len(workers) == ranks, f"{len(workers)} rank(s) listen, not {ranks}: {found}"
    return [str(listener) for listener in found]
