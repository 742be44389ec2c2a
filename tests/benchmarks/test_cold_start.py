"""benchmarks/causal_lm/micro/cold_start.py: the worker's log lines put on the launch's
clock, and each event's median over rounds."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from benchmarks.causal_lm.micro.cold_start import (
    Watch,
    boot_clock,
    table,
    worker_lines,
)


def stamp(wall: float) -> str:
    return datetime.fromtimestamp(wall).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def test_worker_lines_are_timed_from_the_launch_and_earlier_starts_left_out(tmp_path: Path
                                                                             ) -> None:
    launched = datetime(2026, 12, 1, 12, 0, 0).timestamp()
    log = tmp_path / "model_log.log"
    prefix = " [INFO] W-9000-llm-stdout MODEL_LOG - "
    log.write_text(
        f"{stamp(launched - 30)}{prefix}loading llm (at 2.0 s)\n"  # an earlier start's
        f"{stamp(launched + 4.25)}{prefix}loading llm (at 2.1 s)\n"
        "a line that is not the worker's\n"
        f"{stamp(launched + 7.5)}{prefix}prefill (aoti) warmed up (at 5.4 s)\n"
        # TorchServe's worker log
        f"{stamp(launched + 8.0).replace(' ', 'T')} [INFO ] W-9000-llm_1.0-stdout MODEL_LOG - "
        "ready (at 6.0 s)\n")
    events = worker_lines(log, launched, launched)
    assert [round(at, 2) for at, _ in events] == [4.25, 7.5, 8.0]
    assert events[2][1] == "worker: ready (at 6.0 s)"
    assert events[0][1] == "worker: loading llm (at 2.1 s)"
    assert worker_lines(tmp_path / "absent.log", launched, launched) == []


def test_the_table_gives_each_event_its_median_min_and_max_over_rounds() -> None:
    rounds = [
        [(0.1, "process starts: python -m compress"), (4.0, "worker: loading x (at 2.0 s)"),
         (9.0, "first answer")],
        [(0.2, "process starts: python -m compress"), (5.0, "worker: loading x (at 2.5 s)"),
         (11.0, "first answer")],
        [(0.3, "process starts: python -m compress"), (6.0, "worker: loading x (at 3.1 s)"),
         (10.0, "first answer")],
    ]
    lines = table(rounds).splitlines()
    assert lines[2] == "| 0.20 | 0.10 | 0.30 | 3 | process starts: python -m compress |"
    assert lines[3] == "| 5.00 | 4.00 | 6.00 | 3 | worker: loading x # |"
    assert lines[4] == "| 10.00 | 9.00 | 11.00 | 3 | first answer |"


def test_the_watch_sees_a_child_of_the_launched_process() -> None:
    child = subprocess.Popen([sys.executable, "-c",
                              "import subprocess,sys,time;"
                              "subprocess.Popen(['sleep','2']);time.sleep(2)"],
                             start_new_session=True)
    try:
        watch = Watch(child.pid, boot_clock(), lambda: None)
        time.sleep(0.8)
        seen = watch.stop()
        assert any(what == "process starts: sleep" for _, what in seen), seen
        assert all(-1 < at < 5 for at, _ in seen)
    finally:
        child.kill()
        child.wait()


def test_a_target_is_named_without_its_absolute_path() -> None:
    from benchmarks.causal_lm.micro.cold_start import label_of

    assert label_of("/work/runs/after/llm_int8.mar") == "after/llm_int8.mar"
    assert label_of("/work/main/runs/llm_int8") == "llm_int8"
