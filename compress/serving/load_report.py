"""The load test's table, its default request texts and the record it leaves in a run
folder (`loadtest.json`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from compress.errors import UserError


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


def format_table(result: dict) -> str:
    """A fixed-width text table of a ``sweep`` result (or of one ``run_load`` result)."""
    runs = result.get("runs", [result])
    columns = [("concurrency", "concurrency"), ("requests", "requests"), ("ok", "ok"),
               ("errors", "errors"), ("rps", "throughput_rps"), ("p50 ms", "latency_ms_p50"),
               ("p90 ms", "latency_ms_p90"), ("p99 ms", "latency_ms_p99"),
               ("batch mean", "batch_size_mean"), ("batch max", "batch_size_max")]
    lines = fixed_width(columns, runs)
    if runs:
        high = max(run["concurrency"] for run in runs)
        low = min(run["concurrency"] for run in runs)
        ratio = result.get("throughput_ratio", concurrency_ratio(runs))
        shown = "n/a" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"throughput at concurrency {high} / concurrency {low}: {shown}")
    return "\n".join(lines)


SAMPLE_TEXTS = (
    "a gripping, beautiful film",
    "the plot is thin and the jokes fall flat",
    "an unexpectedly moving story told with real warmth and wit",
    "two hours of my life i will never get back",
    "the performances are strong, but the script meanders through a long and "
    "uneven second act before a satisfying finale",
    "dull",
)


def load_payloads(texts_file: str | None) -> list[bytes]:
    """JSON request bodies: one per non-empty line of `texts_file`, or SAMPLE_TEXTS."""
    from pathlib import Path

    texts = SAMPLE_TEXTS
    if texts_file:
        texts = tuple(line.strip() for line in Path(texts_file).read_text().splitlines()
                      if line.strip())
        if not texts:
            raise UserError(f"{texts_file}: no text lines to send")
    return [json.dumps({"text": t}).encode() for t in texts]


def record_result(run_dir: str, result: dict) -> str:
    """Write `loadtest.json` (the sweep and when it ran) into the run folder."""

    from compress.runfolder.files import atomic_write_json, now
    from compress.serving.server import read_info

    path = Path(run_dir) / "loadtest.json"
    info = read_info(Path(run_dir) / "serve")
    atomic_write_json(path, {"measured": now(), "server_settings": (info or {}).get("settings"),
                             **result})
    return str(path)
