"""The peers' own virtual environments, each made once and reused, and the commands run in
them (standard library only).

A peer that cannot share compress's packages (Optimum pins transformers below 5,
llama-cpp-python compiles from source, zentorch is built for one torch...) lives in an
environment of its own: `python -m venv`, then one `pip install` a step (torch first, so
that the CPU wheel is the one installed), pip's output in `<venv>.log`. A marker written
after the last step, holding the facts the peer reports (versions, build flags), tells a
finished environment from a half-made one, which is made again (or, where the peer says
so, installed into again: pip keeps what is already there). A failure is one line:
`PeerError`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class PeerError(Exception):
    """A peer's environment, files or process could not be made (one line)."""


@dataclass(frozen=True)
class Venv:
    """One peer environment: where it lives, what goes in, what its marker holds."""

    name: str  # in messages: "the <name> environment"
    default: str  # its folder when `variable` is unset
    marker: str  # the file written last, holding the facts
    steps: tuple[tuple[str, ...], ...]  # `pip install` arguments, a call each, in order
    variable: str | None = None  # the environment variable naming its folder
    facts: tuple[str, ...] = ()  # the packages whose versions the marker records
    prefix: str = "peers"  # the progress lines' prefix
    note: str = ""  # what making it costs, said when it is made
    hold: bool = False  # every step after the first keeps the first's pin (pip -c)
    remove: tuple[str, ...] = ()  # uninstalled after: wheels that break the CPU torch
    settings: tuple[str, ...] = ()  # NAME=VALUE in pip's environment (CMAKE_ARGS)
    reuse: bool = False  # a half-made one is installed into again, not made anew
    pinned: bool = False  # made again when its install list changed (the marker has it)

    def path(self) -> Path:
        """`$<variable>`, else the default folder."""
        chosen = os.environ.get(self.variable) if self.variable else None
        return Path(chosen or self.default).expanduser()

    def python(self) -> Path:
        """Its Python, at its path."""
        return python_of(self.path())

    def install_list(self) -> list[str]:
        return [package for step in self.steps for package in step]


def python_of(folder: Path) -> Path:
    """The environment's Python."""
    return folder / "bin" / "python"


def ensure_venv(venv: Venv, echo: Callable[[str], None], folder: Path | None = None,
                facts: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Make `venv` in `folder` (default: its path) unless its marker says it is finished;
    the marker's facts: `facts(folder)` (default: the versions of `venv.facts`, "-" for one
    that is not installed). PeerError (one line, the log named) when a step fails."""
    folder = venv.path() if folder is None else folder
    marker = folder / venv.marker
    if marker.is_file():
        try:
            known = dict(json.loads(marker.read_text()))
        except (ValueError, TypeError):  # a marker without the facts: ask the environment
            known = None
        if known is not None and (not venv.pinned or known.get("install") == venv.install_list()):
            return known
        if venv.pinned:
            marker.unlink()
    if folder.exists() and not marker.is_file():
        if not (folder / "pyvenv.cfg").is_file():
            where = f"set {venv.variable} to another folder" if venv.variable else ""
            raise PeerError(f"{folder} exists and is not a virtual environment; remove it"
                            + (f" or {where}" if where else ""))
        if not venv.reuse:
            echo(f"{venv.prefix}: {folder} is a half-made{' or older' if venv.pinned else ''} "
                 "install; making it again")
            shutil.rmtree(folder)
    if not marker.is_file():
        _make(venv, folder, echo)
    found = (facts or (lambda f: {name: installed(f, name) for name in venv.facts}))(folder)
    if venv.pinned:
        found = {**found, "install": venv.install_list()}
    marker.write_text(json.dumps(found))
    return found


def _make(venv: Venv, folder: Path, echo: Callable[[str], None]) -> None:
    """`python -m venv` (unless a half-made one is reused), then the install steps."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"{folder.name}.log"
    log.write_text("")
    echo(f"{venv.prefix}: making the {venv.name} environment {folder} (once"
         + (f"; {venv.note}" if venv.note else "") + f"; pip's output in {log})")
    if not folder.exists():
        call([sys.executable, "-m", "venv", str(folder)], "python -m venv", log)
    held: list[str] = []
    if venv.hold:
        (folder / "constraints.txt").write_text("\n".join(venv.steps[0]) + "\n")
        held = ["-c", str(folder / "constraints.txt")]
    launch = ["env", *venv.settings] if venv.settings else []
    for i, step in enumerate(venv.steps):
        call([*launch, str(folder / "bin" / "pip"), "install", *(held if i else []), *step],
             f"pip install {' '.join(step)}", log)
    if venv.remove:
        call([str(folder / "bin" / "pip"), "uninstall", "-y", *venv.remove],
             f"pip uninstall {' '.join(venv.remove)}", log)


def version(folder: Path, package: str) -> str:
    """The package's version in the environment; PeerError where it is not installed."""
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return call([str(python_of(folder)), "-c", code], f"{package} version").strip()


def installed(folder: Path, package: str) -> str:
    """The package's version in the environment, or "-" where it is not installed."""
    try:
        return version(folder, package)
    except PeerError:
        return "-"


def call(command: list[str], what: str, log: Path | None = None) -> str:
    """Run `command`; its stdout. Output goes to `log`; a failure raises one line."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PeerError(f"{what}: cannot start {command[0]}: {exc}") from None
    if log is not None:
        with open(log, "a") as out:
            out.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.search(r"error", ln, re.IGNORECASE)]
        cause = (errors or lines or ["no output"])[-1][:300]
        where = f" (full output in {log})" if log else ""
        raise PeerError(f"{what} failed with exit code {done.returncode}: {cause}{where}")
    return done.stdout
