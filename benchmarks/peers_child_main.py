"""The `main` of a peer's child script that runs in the peer's own environment, where
compress cannot be imported (llama.cpp's `peers_llm_llama.py`, zentorch's
`peers_llm_zentorch.py`; standard library only): the spec's mode, its JSON line on stdout,
the rest on stderr, as compress's `child_main` does in compress's environment."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def run_modes(modes: dict[str, Callable[[dict[str, Any]], dict[str, Any]]],
              argv: list[str] | None = None) -> int:
    """Run the mode SPEC_JSON (`argv[0]`) names (default "measure") and print its answer;
    1 with {"error": one line} when it fails (the traceback goes to stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    out = sys.stdout
    try:
        spec = json.loads(argv[0])
        with contextlib.redirect_stdout(sys.stderr):
            answer = modes[spec.get("mode", "measure")](spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        traceback.print_exc(file=sys.stderr)
        line = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        print(json.dumps({"error": line, "pid": os.getpid()}), file=out, flush=True)
        return 1
    print(json.dumps(answer), file=out, flush=True)
    return 0
