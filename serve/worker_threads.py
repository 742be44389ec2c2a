"""How many intra-op threads one TorchServe worker runs (torch only from the standard
library: shipped in every archive beside its handler, and used by compress when it
packages or serves one)."""

from __future__ import annotations

import os


def worker_threads(configured: int | None, workers: int) -> int:
    """Intra-op threads of one worker: `configured` (default: all it may have), never more
    than the cores divided among the workers."""
    per_worker = max(1, (os.cpu_count() or 1) // max(1, int(workers)))
    return max(1, min(int(configured or per_worker), per_worker))
