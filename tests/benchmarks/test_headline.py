"""benchmarks/headline/run.py: its ratios are the manifest's own numbers, divided as
documented."""

from __future__ import annotations

from benchmarks.headline import run as headline


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




def _stage(index, name, kind, config, metrics, made, entered):
    return {"index": index, "name": name, "kind": kind, "status": "done", "config": config,
            "inputs": [{"sha256": entered, "format": "safetensors"}],
            "outputs": [{"path": f"{index:02d}/f", "format": "x", "sha256": made, "bytes": 1}],
            "metrics": metrics}


def test_headline_rows_of_a_hand_written_manifest(tmp_path) -> None:
    """Known figures in, known ratios out: 40 ms against its input's 80 ms timed in the same
    process is 0.5; against the fine-tuned model's own 100 ms it is 0.4."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    stages = [
        _stage(0, "finetune", "finetune", {"kind": "finetune"},
               {"accuracy": 0.90, "latency_ms_b8": 100.0, "size_mb": 80.0}, "ft", "src"),
        _stage(1, "int8", "quantize", {"kind": "quantize", "mode": "static"},
               {"accuracy": 0.88, "latency_ms_b8": 40.0, "input_latency_ms_b8": 80.0,
                "size_mb": 20.0}, "q", "ft"),
    ]
    manifest = {"name": "hand", "recipe": {
        "stages": [{"kind": "finetune"}, {"kind": "quantize", "mode": "static"}],
        "evaluation": {"latency": {"batch_sizes": [1, 8]}}}, "stages": stages}
    (run / "manifest.json").write_text(json.dumps(manifest))
    rows = {(r["stage"], r["reference"], r["timing"]): r
            for r in headline.headline_rows({"hand": run})}
    assert set(rows) == {("int8", "finetune", "same process")}
    row = rows[("int8", "finetune", "same process")]
    assert row["batch"] == 8 and row["latency_ratio"] == 0.5
    assert row["size_ratio"] == 0.25 and round(row["accuracy_delta_pt"], 6) == -2.0
    assert row["runtime"] == "PT2E int8 static, torch.compile"
