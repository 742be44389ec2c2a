"""The peers' own virtual environments for benchmarks/peers_embed.py and
serve_peers_embed.py, each made once and reused (like peers_optimum.py's Optimum one).

pip cannot put sentence-transformers' two backends in one environment, nor its ONNX one
beside sentence-transformers 6: the `onnx` extra needs optimum-onnx (0.1.0 at most), which
pins transformers below 4.58 and optimum ~=2.1, while sentence-transformers 6 needs
transformers 5 and optimum-intel 2.2 optimum ~=2.3. So there are three: `onnx` (the newest
sentence-transformers below 6 with its ONNX Runtime backend, and fastembed), `openvino`
(sentence-transformers 6.2.0 with OpenVINO and NNCF) and `infinity` (infinity-emb's server,
which pins sentence-transformers below 4 and numpy below 2). Each is `python -m venv`, then
`pip install torch==2.13.0` (the CPU wheel pip finds here), then its packages with torch
held at that version (`-c`: optimum-intel's torchvision would otherwise bring torch 2.14's
CUDA build), then a few removed (see OPENVINO); pip's output goes to `<venv>.log`, and a
marker written after the last step, holding the packages' versions, tells a finished
environment from a half-made one (which is installed into again: pip keeps what is
already there).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peers_optimum import PeerError, _call, _version

READY = ".compress-embed-peer-ready"
TORCH = "torch==2.13.0"  # first, so that the packages after it keep the CPU wheel


@dataclass(frozen=True)
class Venv:
    """One peer environment: where it lives, what goes in, which versions are recorded."""

    name: str
    variable: str  # the environment variable naming its folder
    default: str
    packages: tuple[str, ...]
    facts: tuple[str, ...]
    remove: tuple[str, ...] = ()  # uninstalled after: wheels that break the CPU torch

    def path(self) -> Path:
        """`$<variable>`, else the default folder."""
        return Path(os.environ.get(self.variable) or self.default).expanduser()

    def python(self) -> Path:
        return self.path() / "bin" / "python"


ONNX = Venv("onnx", "COMPRESS_EMBED_ONNX_VENV", "~/.cache/compress/embed-onnx-venv",
            ("sentence-transformers[onnx]<6", "fastembed==0.9.1"),
            ("sentence-transformers", "optimum-onnx", "optimum", "onnxruntime", "fastembed",
             "transformers", "torch"))
OPENVINO = Venv("openvino", "COMPRESS_EMBED_OPENVINO_VENV",
                "~/.cache/compress/embed-openvino-venv",
                ("sentence-transformers[openvino]==6.2.0", "optimum-intel[openvino]==2.2.0",
                 "datasets"),  # datasets: the calibration split; without the pin pip
                # takes optimum-intel 2.0 to fit the newest datasets
                ("sentence-transformers", "optimum-intel", "optimum", "openvino", "nncf",
                 "transformers", "torch"),
                # the index's torchvision is built for CUDA torch: with the CPU wheel its
                # ops do not register, and transformers' AutoProcessor import fails on it
                remove=("torchvision",))
INFINITY = Venv("infinity", "COMPRESS_INFINITY_VENV", "~/.cache/compress/infinity-venv",
                ("infinity-emb[server,torch,optimum]==0.0.78",),
                ("infinity-emb", "sentence-transformers", "optimum", "onnxruntime",
                 "transformers", "torch"))


def ensure(venv: Venv, echo: Callable[[str], None]) -> dict[str, str]:
    """Make `venv` unless its marker says it is finished; the versions the marker holds.
    PeerError (one line, the log named) when a step fails."""
    folder = venv.path()
    marker = folder / READY
    if marker.is_file():
        try:
            return dict(json.loads(marker.read_text()))
        except (ValueError, TypeError):
            pass  # a marker without the facts: ask the environment again below
    if folder.exists() and not (folder / "pyvenv.cfg").is_file():
        raise PeerError(f"{folder} exists and is not a virtual environment; remove it or set "
                        f"{venv.variable} to another folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"{folder.name}.log"
    if not marker.is_file():
        echo(f"peers_embed: making the {venv.name} environment {folder} (once; pip's output "
             f"in {log})")
        if not folder.exists():
            _call([sys.executable, "-m", "venv", str(folder)], "python -m venv", log)
        held = folder / "constraints.txt"
        held.write_text(TORCH + "\n")
        for step in ([TORCH], ["-c", str(held), *venv.packages]):
            _call([str(folder / "bin" / "pip"), "install", *step],
                  f"pip install {' '.join(step)}", log)
        if venv.remove:
            _call([str(folder / "bin" / "pip"), "uninstall", "-y", *venv.remove],
                  f"pip uninstall {' '.join(venv.remove)}", log)
    facts = {name: _installed(folder, name) for name in venv.facts}
    marker.write_text(json.dumps(facts))
    return facts


def _installed(folder: Path, package: str) -> str:
    """The package's version in the environment, or "-" where it is not installed."""
    try:
        return _version(folder, package)
    except PeerError:
        return "-"
