"""What the served benchmarks share (benchmarks/causal_lm/served*.py, embedding/served*.py):
a server's launch watched until it answers, its whole process tree's resident memory
sampled while it runs, the last line of its log, and the served tables' rows (a server's
rounds per concurrency level), ratios, cells and Markdown.

Cold start is the time from launching the command to the first answered request (one
every quarter second); resident memory is sampled every half second over the server's
process tree (its root and every descendant: TorchServe's Java frontend and its Python
workers) and its maximum kept, as the resident sum (RSS: a page shared by two processes
counted twice) and as the proportional set size (PSS: shared pages once), with each
process's share at the PSS peak."""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.provenance import header_lines
from benchmarks.harness.spread import ratio
from benchmarks.harness.venv import PeerError

READY_GRACE_S = 60  # how long `compress serve` may have said READY before its first answer


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of process `root` and all its descendants (0 when it is gone)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    total, todo, page = 0, [root], os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        todo += children.get(pid, [])
    return total


class RssSampler:
    """A thread that samples the memory of a process tree whose root `root()` names (None:
    not known yet): `peak` is the largest resident sum seen; `pss_peak` the largest
    proportional set size (shared pages once, `compress.system.processes.tree_pss_bytes`)
    and `pss_parts` each process's share at that moment, by its command line."""

    def __init__(self, root: Callable[[], int | None], every_s: float = 0.5):
        self.root, self.every_s, self.peak = root, every_s, 0
        self.pss_peak, self.pss_parts = 0, {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self.thread.start()

    def _run(self) -> None:
        from compress.system.processes import command_line, tree_pss_bytes

        while not self.stopped.is_set():
            pid = self.root()
            if pid is not None:
                self.peak = max(self.peak, tree_rss_bytes(pid))
                parts = tree_pss_bytes(pid)
                if sum(parts.values()) > self.pss_peak:
                    self.pss_peak = sum(parts.values())
                    self.pss_parts = {f"{member} {short_command(command_line(member))}":
                                      size for member, size in parts.items()}
            self.stopped.wait(self.every_s)

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join()
        return self.peak


def short_command(line: str) -> str:
    """A process's command line as a results file may hold it: the program's file name and
    its module (`-m`) or script's, no paths ("python -m compress.serving.litserve.main",
    "java org.pytorch.serve.ModelServer", "llama-server")."""
    words = line.split()
    if not words:
        return "?"
    shown = [Path(words[0]).name]
    if not shown[0].startswith("python") and shown[0] != "java":
        return shown[0]
    if "-m" in words[1:-1]:
        shown += ["-m", words[words.index("-m") + 1]]
    elif "-c" in words[1:-1]:
        shown.append("-c " + " ".join(words[words.index("-c") + 1:])[:40])
    elif any(w.startswith("org.pytorch.") for w in words):
        shown.append(next(w for w in words if w.startswith("org.pytorch.")))
    elif len(words) > 1 and words[1].endswith(".py"):
        shown.append(Path(words[1]).name)
    return " ".join(shown)


def tail(log: Path) -> str:
    """The last non-empty line of a server's log (300 characters at most)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return (lines or ["no output"])[-1][:300]


def wait_answered(process: subprocess.Popen, ask: Callable[[], str | None], key: str,
                  log: Path, timeout_s: float, began: float, exits_when_ready: bool) -> float:
    """Ask (`ask()`: None once answered, else what came back) every quarter second until
    the launched server answers; the seconds since `began`. PeerError when the process
    exits (but with 0 where `exits_when_ready`: `compress serve` returns once READY) or
    gives no answer within `timeout_s` (or READY_GRACE_S after it said READY)."""
    ready_at = None
    while (answer := ask()) is not None:
        waited = time.monotonic() - began
        code = process.poll()
        if code is not None and (code != 0 or not exits_when_ready):
            raise PeerError(f"{key}: the server exited with {code}: {tail(log)}")
        if code == 0:
            ready_at = ready_at or time.monotonic()
        if waited > timeout_s or (ready_at and time.monotonic() - ready_at > READY_GRACE_S):
            raise PeerError(f"{key}: no answer {waited:.0f} s after the launch (last: "
                            f"{answer[:200]}; log: {log})")
        time.sleep(0.25)
    return time.monotonic() - began


def visit(server: Any, timeout_s: float, load: Callable[[Any, dict[str, Any]], None]
          ) -> dict[str, Any]:
    """One round's figures of one server: started (`cold_start_s`), loaded
    (`load(server, figures)` adds what it measured), always stopped (`rss_peak_bytes`, the
    peak of its process tree); a failure is the round's `error`, one line."""
    from compress.errors import one_line

    figures: dict[str, Any] = {}
    try:
        figures["cold_start_s"] = round(server.start(timeout_s), 2)
        load(server, figures)
    except PeerError as exc:
        figures["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - this server's round failed; the rest go on
        figures["error"] = one_line(exc)
    finally:
        figures["rss_peak_bytes"] = server.stop()
        sampler = getattr(server, "sampler", None)
        if getattr(sampler, "pss_peak", 0):
            figures["pss_peak_bytes"] = sampler.pss_peak
            figures["pss_parts_mb"] = {name: round(size / 2**20, 1)
                                       for name, size in sampler.pss_parts.items()}
    return figures


# ------------------------------------------------------------------ the served tables


def median(values: list[float | None]) -> float | None:
    """The median of the values that are there, rounded to 0.01 (None when none are)."""
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 2) if kept else None


def shown(value: float | None) -> str:
    """A ratio as printed: `1.50x`, or `n/a`."""
    return "n/a" if value is None else f"{value:.2f}x"


def level_rows(items: list[dict[str, Any]], levels: list[int], figures: tuple[str, ...],
               copied: tuple[str, ...] = ("kind",)) -> list[dict[str, Any]]:
    """One row per server and concurrency level from its rounds (each {"runs": [a level's
    figures], "cold_start_s", "rss_peak_bytes", "error"?}): each of `figures` the median
    over the rounds, errors summed, resident memory the largest seen, cold start the median
    of the starts; the item's "key", "name" and `copied` keys kept."""
    rows = []
    for item in items:
        rounds = item.get("rounds") or []
        rss = max((r.get("rss_peak_bytes") or 0 for r in rounds), default=0)
        cold = median([r.get("cold_start_s") for r in rounds])
        for level in levels:
            runs = [run for r in rounds for run in r.get("runs") or []
                    if run["concurrency"] == level]
            rows.append({"key": item["key"], "name": item["name"],
                         **{k: item.get(k) for k in copied},
                         "concurrency": level, "rounds": len(runs),
                         "errors": sum(run["errors"] for run in runs) if runs else None,
                         "rss_mb": round(rss / 2**20) if rss else None, "cold_start_s": cold,
                         **{k: median([run.get(k) for run in runs]) for k in figures}})
    return rows


def rate_ratios(rows: list[dict[str, Any]], levels: list[int], key: str, unit: str,
                ours: str = "compress", peers: str = "infinity") -> list[str]:
    """At each level: the fastest of the `peers` rows (kind) by the rate `key` (in `unit`),
    then each of `ours` rows' rate over each peer's, and its p50 latency over the
    fastest's."""
    lines = []
    for level in levels:
        here = [r for r in rows if r["concurrency"] == level]
        others = [r for r in here if r["kind"] == peers and r.get(key)]
        fastest = max(others, key=lambda r: r[key], default=None)
        if fastest is not None:
            lines.append(f"c{level}: the fastest {peers} is {fastest['name']} "
                         f"({fastest[key]} {unit})")
        for row in (r for r in here if r["kind"] == ours):
            parts = [f"/ {peer['name']} " + shown(ratio(row.get(key), peer[key], 2))
                     for peer in others]
            if fastest is not None:
                parts.append("p50 latency / the fastest's " + shown(ratio(
                    row.get("latency_ms_p50"), fastest.get("latency_ms_p50"), 2)))
            if parts:
                lines.append(f"c{level}: {row['name']} {unit} " + ", ".join(parts))
    return lines


def cells(rows: list[dict[str, Any]], columns: tuple[tuple[str, str], ...]
          ) -> list[list[str]]:
    """Each row's cells under `columns` ((heading, key)): '-' where a figure is missing."""
    return [["-" if row.get(k) is None else str(row[k]) for _, k in columns] for row in rows]


def markdown(rows: list[dict[str, Any]], columns: tuple[tuple[str, str], ...], left: int,
             lines: list[str], header: dict[str, Any]) -> str:
    """A served table as Markdown under its header (title; the results header, provenance.py,
    unless `section` says the table is a section under another's; facts; the first `left`
    columns left-aligned), then the ratio lines and the notes."""
    out = [f"# {header['title']}", "", *([] if header.get("section") else header_lines(header))]
    out += [f"- {k}: {v}" for k, v in header["facts"].items()]
    out += ["", "| " + " | ".join(t for t, _ in columns) + " |",
            "|" + "|".join("---" if i < left else "---:" for i in range(len(columns))) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in cells(rows, columns)]
    out += (["", "Ratios:", ""] + [f"- {line}" for line in lines]) if lines else []
    out += ["", "Notes:", ""] + [f"- {note}" for note in header["notes"]]
    return "\n".join(out) + "\n"
