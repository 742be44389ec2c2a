"""What every load test reports: the ratio of its highest concurrency's throughput to its
lowest's, fixed-width tables, the line that counts its failed requests, and the record it
leaves in a run folder (`loadtest.json`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def concurrency_ratio(runs: list[dict]) -> float | None:
    """Requests/s at the highest concurrency over requests/s at the lowest (None: no runs)."""
    if not runs:
        return None
    high = max(runs, key=lambda r: r["concurrency"])
    low = min(runs, key=lambda r: r["concurrency"])
    if not high["throughput_rps"] or not low["throughput_rps"]:
        return None
    return round(high["throughput_rps"] / low["throughput_rps"], 2)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def plain(value: object) -> str:
    """A cell as it is ("-" for none)."""
    return "-" if value is None else str(value)


def fixed_width(columns: list[tuple[str, str]], runs: list[dict],
                cell: Callable[[object], str] = _cell) -> list[str]:
    """The lines of a right-aligned table: a header of `columns`' titles, a rule, and per
    run its values under each column's key, written by `cell`."""
    rows = [[cell(run.get(key)) for _, key in columns] for run in runs]
    widths = [max(len(title), *(len(row[i]) for row in rows))
              for i, (title, _) in enumerate(columns)]
    lines = ["  ".join(title.rjust(w) for (title, _), w in zip(columns, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    return lines + ["  ".join(text.rjust(w) for text, w in zip(row, widths, strict=True))
                    for row in rows]


def record_result(run_dir: str, result: dict) -> str:
    """Write `loadtest.json` (the sweep and when it ran) into the run folder."""
    from compress.runfolder.files import atomic_write_json, now
    from compress.serving.serve_folder import read_info

    path = Path(run_dir) / "loadtest.json"
    info = read_info(Path(run_dir) / "serve")
    atomic_write_json(path, {"measured": now(), "server_settings": (info or {}).get("settings"),
                             **result})
    return str(path)


def failure_summary(result: dict, credentials: bool) -> str | None:
    """`N of M requests failed (first: ...)` for a sweep or run_load result (None when all
    succeeded), with a hint when every request got HTTP 401 and no --token/--run was given."""
    runs = result.get("runs", [result])
    failed, sent = sum(r.get("errors", 0) for r in runs), sum(r.get("requests", 0) for r in runs)
    if not failed:
        return None
    first = next((e for r in runs for e in r.get("error_examples", [])), "no example kept")
    line = f"{failed} of {sent} requests failed (first: {first[:100].rstrip()}" + (
        "...)" if len(first) > 100 else ")")
    if not credentials and sum(r.get("error_kinds", {}).get("HTTP 401", 0) for r in runs) == sent:
        line += ("; the server has token authorization on: pass --token TOKEN or --run RUN_DIR "
                 "(the run folder it serves)")
    return line
