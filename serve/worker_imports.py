"""Modules a worker leaves out of its imports (the standard library only: shipped in every
archive beside its handler).

transformers imports some packages wherever they are installed, for features a served model
never runs: scipy for vision models' matching losses (`transformers.loss`), accelerate for
device maps and offloading, torchao for checkpoints quantized by torchao's transformers
integration (compress's torchao schemes quantize with torchao itself, which stays
importable). In a causal-LM worker they were 41 MB and about 0.9 s of its start on a Zen 1
(`docs/causal-lm.md`, "Where a worker's memory goes"). A module left out is absent to
`importlib.util.find_spec`, so transformers takes it for not installed, and an `import` of
it raises ImportError."""

from __future__ import annotations

import sys

UNUSED = ("scipy", "accelerate")  # what no handler reads


def leave_out(names: tuple[str, ...] = UNUSED) -> list[str]:
    """Mark each of `names` not imported yet as absent for the rest of this process; the
    names marked."""
    marked = [name for name in names if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]
    return marked
