"""Where a served causal LM's cold start goes: `compress serve TARGET` launched with an empty
Inductor cache (as `served.py` launches it) and watched until its first answered chat
completion, every process of its tree seen as it starts (its start time from /proc, against
the boot clock, 10 ms resolution), `compress serve`'s own lines as they arrive, and the
worker's stamped progress lines (`serve/worker_clock.py`: loading, weights, steps, warm-ups),
all on one clock from the launch. Each round prints its timeline; the table is each event's
median over the rounds. Several targets (an archive before and after a change) start in turn,
round by round, each with a table of its own.

    python -m benchmarks.causal_lm.micro.cold_start runs/llm_int8
    python -m benchmarks.causal_lm.micro.cold_start runs/llm_int8 --engine torchserve --rounds 3
    python -m benchmarks.causal_lm.micro.cold_start before/llm_int8.mar after/llm_int8.mar
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from benchmarks.causal_lm.served_servers import probe
from benchmarks.harness.provenance import header_text, scrubbed
from benchmarks.harness.servers import short_command
from compress.serving.serve_folder import SERVER_INFO, free_ports, read_info
from compress.serving.serve_target import resolve_target
from compress.serving.server_process import stop
from compress.system import processes

TICK = os.sysconf("SC_CLK_TCK")
# LitServe's worker log (the handler's lines: "2026-12-01 12:00:00,000") and TorchServe's
# ("2026-12-01T12:00:00,000")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d,\d{3}) .*?MODEL_LOG - (.*)$")


def boot_clock() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class Watch:
    """A thread that notes each process of the launch's tree once, as it appears: the tree
    below `root`, and below the server's own root once `server()` names it (the server
    process outlives `compress serve`, which returns once the server answers)."""

    def __init__(self, root: int, launched: float, server: Callable[[], int | None]):
        self.root, self.launched, self.server = root, launched, server
        self.seen: dict[int, tuple[float, str]] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            server = self.server()
            for pid in {*processes.tree(self.root), *(processes.tree(server) if server else ())}:
                if pid not in self.seen:
                    found, line = processes.stat(pid), processes.command_line(pid)
                    if found is not None and line:
                        self.seen[pid] = (found.start_ticks / TICK - self.launched,
                                          short_command(line))
            self.done.wait(0.02)

    def stop(self) -> list[tuple[float, str]]:
        self.done.set()
        self.thread.join()
        return [(at, f"process starts: {what}") for at, what in self.seen.values()]


def this_launch(serve_dir: Path, since_wall: float) -> dict | None:
    """The server.json `compress serve` wrote for the launch at `since_wall`, or None yet."""
    info = serve_dir / SERVER_INFO
    try:
        return read_info(serve_dir) if info.stat().st_mtime >= since_wall else None
    except OSError:
        return None


def worker_lines(log: Path, since_wall: float, launched_wall: float) -> list[tuple[float, str]]:
    """The model log's lines written since `since_wall`, each at its time from the launch."""
    if not log.is_file():
        return []
    events = []
    for line in log.read_text(errors="replace").splitlines():
        match = STAMP.match(line)
        if not match:
            continue
        wall = datetime.strptime(f"{match[1]} {match[2]}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if wall >= since_wall - 0.002:
            events.append((wall - launched_wall, f"worker: {match[3].strip()[:90]}"))
    return events


def one_start(target: str, engine: str, timeout_s: float) -> list[tuple[float, str]]:
    """One cold start's events, (seconds from the launch, what), in order."""
    serve_dir = resolve_target(target).serve_dir
    port = free_ports(1)[0]
    inductor = Path(tempfile.mkdtemp(prefix="cold_start_inductor-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    path = None
    command = [sys.executable, "-m", "compress", "serve", target, "--engine", engine,
               "--port", str(port), "--no-auth", "--timeout", str(int(timeout_s))]
    events: list[tuple[float, str]] = []
    launched_wall, launched = time.time(), boot_clock()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=env, start_new_session=True, text=True)
    watch = Watch(process.pid, launched,
                  lambda: (this_launch(serve_dir, launched_wall) or {}).get("pid"))

    def read_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            events.append((boot_clock() - launched, f"compress serve: {line.strip()[:90]}"))

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            record = None if path else this_launch(serve_dir, launched_wall)
            if record:
                path = (f"/predictions/{record['model_name']}/"
                        f"{record.get('model_version') or '1.0'}/v1/chat/completions")
            if path is not None and probe(port, path, 30) is None:
                events.append((boot_clock() - launched, "first answer"))
                break
            if process.poll() not in (None, 0):
                raise SystemExit(f"compress serve exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"no answer within {timeout_s:.0f} s")
            time.sleep(0.05)
        process.wait(timeout=timeout_s)
        reader.join(timeout=5)
    finally:
        events += watch.stop()
        stop(serve_dir, echo=lambda _: None)
        shutil.rmtree(inductor, ignore_errors=True)
    events += worker_lines(serve_dir / "logs" / "model_log.log", launched_wall, launched_wall)
    return sorted(events)


def table(rounds: list[list[tuple[float, str]]]) -> str:
    """Each event's median time over the rounds (events matched by their text, numbers and
    pids left out), in order."""
    by_event: dict[str, list[float]] = {}
    for events in rounds:
        for at, what in events:
            key = re.sub(r"\(at [\d.]+ s\)|\d+(\.\d+)?", "#", what)
            by_event.setdefault(key, []).append(at)
    rows = sorted((statistics.median(times), key, min(times), max(times), len(times))
                  for key, times in by_event.items())
    lines = ["| s from launch (median) | min | max | seen | event |", "|---:|---:|---:|---:|---|"]
    lines += [f"| {m:.2f} | {lo:.2f} | {hi:.2f} | {n} | {key.replace('|', '/')} |"
              for m, key, lo, hi, n in rows]
    return "\n".join(lines)


def label_of(target: str) -> str:
    """A target as a results file names it: its folder and file, no absolute path."""
    path = Path(target)
    return str(Path(path.parent.name) / path.name) if path.suffix == ".mar" else path.name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks.causal_lm.micro.cold_start",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="+", help="run folders or .mar files (as `compress "
                        "serve` takes them); several are started in turn, round by round")
    parser.add_argument("--engine", default="litserve", choices=("litserve", "torchserve"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--markdown", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    rounds: dict[str, list[list[tuple[float, str]]]] = {t: [] for t in args.targets}
    for index in range(args.rounds):
        for target in args.targets:
            events = one_start(target, args.engine, args.timeout)
            rounds[target].append(events)
            answered = [at for at, what in events if what == "first answer"]
            print(f"{label_of(target)} round {index + 1}: first answer at {answered[0]:.2f} s")
            for at, what in events:
                print(f"  {at:7.2f} s  {what}")
    shown = [*map(label_of, args.targets), "--engine", args.engine, "--rounds", str(args.rounds)]
    parts = ["# Cold start of a served causal LM, event by event\n",
             header_text("benchmarks.causal_lm.micro.cold_start", shown), ""]
    for target, seen in rounds.items():
        firsts = [at for events in seen for at, what in events if what == "first answer"]
        parts += [f"## {label_of(target)}: first answer at {statistics.median(firsts):.2f} s "
                  f"(median of {len(firsts)}; {min(firsts):.2f}-{max(firsts):.2f})\n",
                  table([[(at, scrubbed(what)) for at, what in events] for events in seen]),
                  ""]
    text = "\n".join(parts)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
