"""Stage `quantize` on a reranker: PT2E int8 (dynamic, or static calibrated on the
calibration split's query-document pairs) through the shared runner, the cross-encoder
captured as one graph, its activation included (the recipe check refuses QAT for now)."""

from compress.stages.quantize import reload, run  # noqa: F401  (the family's runner)
