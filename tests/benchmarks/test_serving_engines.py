"""benchmarks/serving: the engines table's arithmetic and the engine list's parsing, without
serving anything (the benchmark itself runs by hand: its figures are in
benchmarks/results/serving_engines_*.md)."""

from __future__ import annotations

import pytest

from benchmarks.harness.provenance import results_header
from benchmarks.serving.engines import parse_engines
from benchmarks.serving.table import compare, engine_row, markdown
from compress.errors import UserError


def _round(rps: float, lone: float, p99: float = 50.0) -> dict:
    return {"rps": rps, "p50_ms": 20.0, "p99_ms": p99, "lone_p50_ms": lone, "start_s": 9.0,
            "errors": 0, "cpu_ms": 1000 / rps, "client_cpu_ms": 0.5,
            "cpu_where": f"ray::ServeReplica {600 / rps:.1f}"}


def test_rows_take_medians_and_compare_with_torchserve_and_litserve() -> None:
    rows = compare([engine_row("torchserve", [_round(100, 5.0), _round(120, 6.0)]),
                    engine_row("litserve", [_round(150, 4.0), _round(130, 4.0)]),
                    engine_row("ray 2 replicas", [_round(90, 7.5), _round(70, 6.5, 80),
                                                  _round(80, 7.0)])])
    torchserve, litserve, ray = rows
    assert torchserve["rps_median"] == 110 and torchserve["rps_vs_reference"] == 1.0
    assert litserve["rps_vs_reference"] == pytest.approx(140 / 110, abs=1e-3)
    assert ray["rps_median"] == 80 and ray["rps_range"] == "70-90"
    assert ray["p99_ms_median"] == 50.0 and ray["p99_ms_max"] == 80
    assert ray["lone_cost_ms"] == pytest.approx(3.0) and litserve["lone_cost_ms"] == 0
    assert torchserve["lone_cost_ms"] == pytest.approx(1.5)
    assert ray["cpu_ms_median"] == 12.5 and ray["cpu_where"] == "ray::ServeReplica 6.7"


def test_cpu_is_charged_to_each_kind_of_process_between_two_readings() -> None:
    from benchmarks.harness.process_cpu import cpu_spent, ray_or_named

    def row(pid: int, start: float, cpu: float, command: str) -> dict:
        return {"pid": pid, "start": start, "cpu_s": cpu, "name": "python3", "ppid": 1,
                "command": command}

    before = {(1, 0.0): row(1, 0.0, 5.0, "ray::ProxyActor"),
              (2, 0.0): row(2, 0.0, 1.0, "ray::ServeReplica:compress-m:m")}
    after = {(1, 0.0): row(1, 0.0, 7.5, "ray::ProxyActor"),
             (2, 0.0): row(2, 0.0, 4.0, "ray::ServeReplica:compress-m:m"),
             (3, 9.0): row(3, 9.0, 0.5, "/usr/bin/python3 -m compress.serving.litserve.main")}
    assert cpu_spent(before, after) == {"ray::ServeReplica": 3.0, "ray::ProxyActor": 2.5,
                                        "compress.serving.litserve.main": 0.5}
    assert ray_or_named(row(4, 0, 0, "java -cp ts.jar org.pytorch.serve.ModelServer")) == "java"


def test_a_failed_engine_is_a_row_with_its_error_and_no_ratio() -> None:
    rows = compare([engine_row("torchserve", [_round(100, 5.0)]),
                    engine_row("ray 1 replica", [{"error": "Ray Serve did not answer"}])])
    assert rows[1]["error"] == "Ray Serve did not answer"
    assert rows[1]["rps_median"] is None and rows[1]["rps_vs_reference"] is None
    text = markdown(rows, results_header("benchmarks.serving.engines", []), ["- setup"])
    assert "| torchserve | 100.0 |" in text
    assert "ray 1 replica: failed: Ray Serve did not answer" in text
    assert "family" in text  # the CPU named in the header


def test_the_engine_list() -> None:
    assert parse_engines("torchserve, ray:2,ray:1") == [
        ("torchserve", "torchserve", None), ("ray 2 replicas", "ray", 2),
        ("ray 1 replica", "ray", 1)]
    for bad in ("vllm", "ray", "ray:0", "litserve:2", ","):
        with pytest.raises(UserError):
            parse_engines(bad)
