"""What compress's handlers report to the serving engine's metrics (shipped in every archive;
no compress imports). TorchServe exposes them with its own (queue latency, requests by
status) in Prometheus format on its metrics port, once they are declared in its metrics
configuration (compress.serving.metrics_config writes it from `METRICS`).

Each metric carries the model's name as its one dimension."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

DIMENSION = "ModelName"
# name: (unit, kind) -- kind one of TorchServe's counter, gauge, histogram
METRICS = {
    "CompressBatchRows": ("Count", "gauge"),  # rows decoding together / a batch's requests
    # seconds: TorchServe's Prometheus histograms have the client's default buckets, 5 ms to
    # 10 s (in milliseconds every time fell in the last one, +Inf: only sum and count said
    # anything)
    "CompressQueueTime": ("Seconds", "histogram"),  # arrival to decoding (LM)
    "CompressTimeToFirstToken": ("Seconds", "histogram"),
    "CompressGeneratedTokens": ("Count", "counter"),  # its rate: tokens/s
    "CompressBadRequests": ("Count", "counter"),  # answered 4xx by the handler
    "CompressFailedRequests": ("Count", "counter"),  # answered 5xx by the handler
    "CompressPrefixCacheBytes": ("Bytes", "gauge"),  # keys and values the prefix cache holds
    # speculation (`speculate`): draft tokens verified, and those kept (their ratio: the
    # acceptance rate)
    "CompressDraftTokens": ("Count", "counter"),
    "CompressDraftTokensKept": ("Count", "counter"),
}


def record(context: Any, name: str, value: float) -> None:
    """Add `value` to metric `name` of this model (nothing where the engine keeps none)."""
    metrics = getattr(context, "metrics", None)
    if metrics is None or not hasattr(metrics, "add_metric_to_cache"):
        return
    try:
        from ts.metrics.metric_type_enum import MetricTypes

        unit, kind = METRICS[name]
        kind_enum = MetricTypes[kind.upper()]
        try:
            metric = metrics.get_metric(name, kind_enum)
        except Exception:  # noqa: BLE001 (not cached yet)
            metric = metrics.add_metric_to_cache(name, unit, [DIMENSION], kind_enum)
        metric.add_or_update(value, [str(getattr(context, "model_name", "") or "model")])
    except Exception:  # noqa: BLE001 (metrics never fail a request)
        logger.debug("compress metric %s not recorded", name, exc_info=True)
