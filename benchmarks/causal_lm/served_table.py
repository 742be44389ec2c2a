"""The table of benchmarks/causal_lm/served.py: one row per server and concurrency from
every round's figures (each figure the median over rounds; errors summed; resident memory
the largest seen; cold start the median of the starts), the ratios the issue asks for, and
the Markdown with the machine it ran on."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import servers
from benchmarks.harness.servers import shown

FIGURES = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
           "tokens_per_request")
COLUMNS = (("server", "name"), ("scheme", "scheme"), ("conc", "concurrency"),
           ("tok/s", "tokens_per_s"), ("TTFT p50 ms", "ttft_ms_p50"),
           ("TTFT p99 ms", "ttft_ms_p99"), ("ITL p50 ms", "itl_ms_p50"),
           ("ITL p99 ms", "itl_ms_p99"), ("tok/req", "tokens_per_request"),
           ("errors", "errors"), ("RSS MB", "rss_mb"), ("PSS MB", "pss_mb"),
           ("cold start s", "cold_start_s"))


def table_rows(items: list[dict[str, Any]], levels: list[int]) -> list[dict[str, Any]]:
    """One row per item and concurrency level, over the item's finished rounds."""
    rows = []
    for item in items:
        rounds = item["rounds"]
        colds = [r["cold_start_s"] for r in rounds if r.get("cold_start_s") is not None]
        rss = max((r.get("rss_peak_bytes") or 0 for r in rounds), default=0)
        pss = max((r.get("pss_peak_bytes") or 0 for r in rounds), default=0)
        for level in levels:
            runs = [run for r in rounds for run in r.get("runs", [])
                    if run["concurrency"] == level]
            row = {"key": item["key"], "name": item["name"], "scheme": item["scheme"],
                   "concurrency": level, "rounds": len(runs),
                   "errors": sum(run["errors"] for run in runs) if runs else None,
                   "rss_mb": round(rss / 2**20) if rss else None,
                   "pss_mb": round(pss / 2**20) if pss else None,
                   "cold_start_s": servers.median(colds),
                   **{k: servers.median([run.get(k) for run in runs]) for k in FIGURES}}
            rows.append(row)
    return rows


def memory_lines(items: list[dict[str, Any]]) -> list[str]:
    """Each server's largest PSS over its rounds, and where it went: each process's share
    at that moment (pid and command line), largest first."""
    lines = []
    for item in items:
        best = max(item["rounds"], key=lambda r: r.get("pss_peak_bytes") or 0, default={})
        if not best.get("pss_peak_bytes"):
            continue
        parts = sorted((best.get("pss_parts_mb") or {}).items(), key=lambda kv: -kv[1])
        lines.append(f"memory of {item['name']} {item['scheme']}: PSS "
                     f"{best['pss_peak_bytes'] / 2**20:.0f} MB at its peak; "
                     + "; ".join(f"{mb:.0f} MB {name}" for name, mb in parts))
    return lines


def _at(rows: list[dict[str, Any]], key: str, level: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["key"] == key and r["concurrency"] == level), None)


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 2) if top is not None and bottom else None


def ratios(items: list[dict[str, Any]], rows: list[dict[str, Any]], levels: list[int],
           at: int = 8) -> list[str]:
    """Ours at concurrency `at` over the paired llama-server's at `at` (tok/s, and TTFT
    p50 at the lowest level and at `at`); ours at `at` over ours at the lowest level;
    prefix cache on over off (TTFT p50). Without `at` among the levels, the highest."""
    low, lines = min(levels), []
    at = at if at in levels else max(levels)
    peers = [i for i in items if i["engine"] == "llama-server"]
    for item in items:
        if item["engine"] == "llama-server":
            continue
        mine = _at(rows, item["key"], at) or {}
        for peer in (p for p in peers if p["scheme"] in item["pairs"]):
            theirs = _at(rows, peer["key"], at) or {}
            ttft_low = _ratio((_at(rows, item["key"], low) or {}).get("ttft_ms_p50"),
                              (_at(rows, peer["key"], low) or {}).get("ttft_ms_p50"))
            lines.append(
                f"{item['name']} {item['scheme']} / {peer['name']} {peer['scheme']}: tok/s at "
                f"c{at} {shown(_ratio(mine.get('tokens_per_s'), theirs.get('tokens_per_s')))}"
                f", TTFT p50 at c{low} {shown(ttft_low)}, at c{at} "
                f"{shown(_ratio(mine.get('ttft_ms_p50'), theirs.get('ttft_ms_p50')))}")
        if low != at:
            base = _at(rows, item["key"], low) or {}
            lines.append(f"{item['name']} {item['scheme']}: tok/s at c{at} / c{low} "
                         f"{shown(_ratio(mine.get('tokens_per_s'), base.get('tokens_per_s')))}")
        if item.get("prefix_cache") is True:
            off = next((i for i in items if i.get("prefix_cache") is False
                        and i["engine"] == item["engine"] and i["scheme"] == item["scheme"]),
                       None)
            for level in levels if off else []:
                lines.append(f"compress {item['engine']} {item['scheme']}: TTFT p50 with the "
                             f"prefix cache / without at c{level} " + shown(_ratio(
                                 (_at(rows, item["key"], level) or {}).get("ttft_ms_p50"),
                                 (_at(rows, off["key"], level) or {}).get("ttft_ms_p50"))))
    return lines


def render_text(rows: list[dict[str, Any]], lines: list[str]) -> str:
    cells = servers.cells(rows, COLUMNS)
    widths = [max(len(t), *(len(c[i]) for c in cells)) for i, (t, _) in enumerate(COLUMNS)]
    out = ["  ".join(t.ljust(w) if i < 2 else t.rjust(w)
                     for i, ((t, _), w) in enumerate(zip(COLUMNS, widths, strict=True)))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in cells]
    return "\n".join(out + [""] + lines) + "\n"


def render_markdown(rows: list[dict[str, Any]], lines: list[str], header: dict[str, Any]
                    ) -> str:
    return servers.markdown(rows, COLUMNS, 2, lines, header)
