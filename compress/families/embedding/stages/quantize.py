"""Stage `quantize` on an embedding model: PT2E int8 (dynamic, or static with calibration)
through the shared runner; the encoder is captured as one graph, pooling and normalization
included (QAT, which trains against labels, is refused when the recipe is checked)."""

from compress.stages.quantize import run  # noqa: F401  (the family's runner for `quantize`)
