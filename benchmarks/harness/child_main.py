"""The `main` of a child process, `python -m benchmarks.<suite>.<child> SPEC_JSON`: the
spec's mode, its JSON line on stdout, the rest on stderr. `run_modes` is for a child that
runs in a peer's own environment, where compress cannot be imported (llama.cpp's, zentorch's,
sentence-transformers'; standard library only, as this module is); `run_in_compress` hands a
child of compress's environment to compress's own `child_main`. Both answer `--help` with
the child's docstring."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

Mode = Callable[[dict[str, Any]], dict[str, Any]]


def help_asked(argv: list[str], doc: str | None) -> bool:
    """Print the child's usage and `doc` when `argv` asks for help (`-h`, `--help`)."""
    if not argv or argv[0] not in ("-h", "--help"):
        return False
    print("usage: python -m MODULE SPEC_JSON (one JSON object, its \"mode\" choosing what "
          "runs; one JSON line answers)\n")
    print((doc or "").strip())
    return True


def run_modes(modes: dict[str, Mode], argv: list[str] | None = None,
              doc: str | None = None) -> int:
    """Run the mode SPEC_JSON (`argv[0]`) names (default "measure") and print its answer;
    1 with {"error": one line} when it fails (the traceback goes to stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, doc):
        return 0
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


def run_in_compress(handle: Mode, argv: list[str] | None = None, doc: str | None = None) -> int:
    """compress's `child_main(handle)` (its one-line errors), after `--help`."""
    argv = sys.argv[1:] if argv is None else argv
    if help_asked(argv, doc):
        return 0
    from compress.report.rebench import child_main

    return child_main(handle, argv)
