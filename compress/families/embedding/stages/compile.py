"""Stage `compile` on an embedding model: the shared runner, unchanged (a sentence encoder
is a module of token ids in, one tensor out, as a classifier is)."""

from compress.stages.compile import run  # noqa: F401  (the family's runner for `compile`)
