"""compress.serving.worker_log on TorchServe's model_log.log lines as TorchServe 0.12 writes
them: the handlers' progress lines, worker deaths counted whether the traceback comes
before or after "Backend worker process died.", the real exception kept (not TorchServe's
wrapper), and a line still being written left for the next read."""

from __future__ import annotations

from pathlib import Path

from compress.serving.worker_log import PROGRESS, WorkerLog
from serve.causal_lm.server import handler as causal_lm_handler
from serve.classifier import handler as classifier_handler


def _lines(worker: str, *messages: str, stream: str = "stdout") -> str:
    return "".join(f"2026-11-25T02:48:55,061 [INFO ] {worker}-tiny_1.0-{stream} MODEL_LOG - "
                   f"{m}\n" for m in messages)


def test_progress_deaths_and_the_exception_in_either_order(tmp_path: Path) -> None:
    log = tmp_path / "model_log.log"
    log.write_text(_lines("W-9000", "Torch worker started.", "model_name: tiny, batchSize: 4",
                          "compress worker: loading tiny", "compress worker: compiling bucket "
                          "1 of 3 (1 rows)")
                   + _lines("W-9000", "FutureWarning: `past_key_values` is deprecated",
                            stream="stderr"))
    watch = WorkerLog(log)
    assert watch.read() == ["W-9000: loading tiny", "W-9000: compiling bucket 1 of 3 (1 rows)"]
    assert watch.deaths == 0 and watch.error is None and watch.read() == []

    with open(log, "a") as out:  # died, then the traceback (an uncaught AssertionError)
        out.write(_lines("W-9000", "Backend worker process died.", "Traceback (most recent "
                         "call last):", '  File "x.py", line 1, in call',
                         "AssertionError: expected size 2==4, stride 2048==2048 at dim=0",
                         "Error in op: input"))
        out.write(_lines("W-9001", "Failed to load model tiny, exception corrupt",
                         "Traceback (most recent call last):",
                         "RuntimeError: corrupt", "Backend worker process died.",
                         "Traceback (most recent call last):",
                         "RuntimeError: 500 - Unknown exception"))
        out.write("2026-11-25T02:48:56,000 [INFO ] W-9000-tiny_1.0-stdout MODEL_LOG - compress")
    assert watch.read() == []
    assert watch.deaths == 2 and watch.error == "RuntimeError: corrupt"
    assert watch.failure() == (f"the model's worker died while starting (2 times): "
                               f"RuntimeError: corrupt (log: {log})")
    with open(log, "a") as out:  # the half-written line, finished
        out.write(" worker: compiling bucket 2 of 3 (2 rows)\n")
    assert watch.read() == ["W-9000: compiling bucket 2 of 3 (2 rows)"]


def test_a_missing_log_reads_as_nothing_yet(tmp_path: Path) -> None:
    watch = WorkerLog(tmp_path / "model_log.log")
    assert watch.read() == [] and watch.deaths == 0
    assert "no exception was logged" in watch.failure()


def test_the_handlers_log_the_prefix_the_watcher_reads() -> None:
    assert classifier_handler.PROGRESS == causal_lm_handler.PROGRESS == PROGRESS
