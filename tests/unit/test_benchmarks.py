"""benchmarks/headline.py: its ratios are the manifest's own numbers, divided as documented."""

from __future__ import annotations

import importlib.util

from conftest import REPO

spec = importlib.util.spec_from_file_location("headline", REPO / "benchmarks" / "headline.py")
headline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(headline)


def test_served_figures_divide_the_extreme_concurrencies() -> None:
    sweep = {"runs": [
        {"concurrency": 1, "requests": 20, "errors": 0, "throughput_rps": 40.0,
         "batch_size_mean": 1.0, "batch_size_max": 1, "latency_ms_p50": 24.0},
        {"concurrency": 32, "requests": 20, "errors": 1, "throughput_rps": 130.0,
         "batch_size_mean": 12.5, "batch_size_max": 16, "latency_ms_p50": 220.0}]}
    served = headline.served_figures(sweep)
    assert served["throughput_ratio"] == 130.0 / 40.0
    assert served["batch_size_mean_high"] == 12.5 and served["errors"] == 1
    assert headline.served_figures({"runs": []}) is None


