"""Reports: built from the manifest alone, written after every run (finished or not),
compared across runs, and plotted with the Pareto front."""

from __future__ import annotations

from compress.report.plot import pareto_front


def test_pareto_front_keeps_only_undominated_points() -> None:
    points = [(10.0, 80.0, "a"), (5.0, 70.0, "b"), (20.0, 85.0, "c"), (12.0, 75.0, "d"),
              (5.0, 60.0, "e")]
    assert [p[2] for p in pareto_front(points)] == ["b", "a", "c"]


