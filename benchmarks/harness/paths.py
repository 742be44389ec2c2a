"""Where the benchmarks read and write: the repository root, the measured results
(`benchmarks/results/`) and the SST-2 mirror beside the repository (standard library only)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
MIRROR = REPO.parent / "shared" / "data"  # the data the tests read, where it is checked out


def default_data_dir(env: dict[str, str] | None = None) -> dict[str, str]:
    """`COMPRESS_DATA_DIR` set to the mirror beside the repository in `env` (default: this
    process's environment, which children inherit) when it is unset and the mirror exists;
    `env`."""
    env = os.environ if env is None else env
    if not env.get("COMPRESS_DATA_DIR") and MIRROR.is_dir():
        env["COMPRESS_DATA_DIR"] = str(MIRROR)
    return env
