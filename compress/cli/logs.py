"""The log files the CLI writes, outside any run folder: a crash's traceback, and the
warnings third-party libraries log as they load (torchao's optional CUDA extensions, torch's
pytree deprecations), so that a command's output holds only compress's own lines and bars.

Both live in $COMPRESS_STATE_DIR/logs, else ~/.local/state/compress/logs, else the temp
folder."""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

# loggers whose warnings say nothing a compress user can act on; py.warnings: Python
# warnings (torch's and Inductor's UserWarnings) once logging captures them
LIBRARY_LOGGERS = ("torchao", "torch.utils._pytree", "py.warnings")
LIBRARY_LOG = "libraries.log"


def log_dirs() -> list[Path]:
    """Where the CLI's logs go, in order of preference."""
    base = os.environ.get("COMPRESS_STATE_DIR") or os.path.expanduser("~/.local/state/compress")
    return [Path(base) / "logs", Path(tempfile.gettempdir())]


def divert_library_warnings() -> Path | None:
    """Send LIBRARY_LOGGERS' records, Python warnings among them, to LIBRARY_LOG instead of
    the terminal (the file is created at the first record), and turn off the Hugging Face
    libraries' own progress bars (loading weights, converting a GGUF: compress shows its
    own); the log's path, or None when no folder is writable."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by hub and transformers
    for folder in log_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        handler = logging.FileHandler(folder / LIBRARY_LOG, delay=True)
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s pid {os.getpid()} %(name)s %(levelname)s: %(message)s"))
        for name in LIBRARY_LOGGERS:
            library = logging.getLogger(name)
            library.addHandler(handler)
            library.propagate = False
        logging.captureWarnings(True)
        return folder / LIBRARY_LOG
    return None


def write_crash_log() -> Path | None:
    """Write the current exception's traceback and command line (tokens masked) to a log
    file; its path."""
    name = f"compress-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    argv = [re.sub(r"^(--token=).*", r"\1***", a) for a in sys.argv]
    argv = ["***" if i and argv[i - 1] == "--token" else a for i, a in enumerate(argv)]
    text = f"command: {' '.join(argv)}\n\n{traceback.format_exc()}"
    for folder in log_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
            return folder / name
        except OSError:
            continue
    return None
