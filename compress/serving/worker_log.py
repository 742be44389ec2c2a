"""What TorchServe's workers are doing while they start, read from its `model_log.log`: the
progress lines compress's handlers log (`compress worker: ...`), and every worker that died
while loading, with the last line of its exception.

TorchServe restarts a worker that dies in `initialize` for as long as it is asked to wait,
so `compress serve` reads this log to say what is happening and to stop early."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROGRESS = "compress worker: "  # the handlers' progress lines start with this
DIED = "Backend worker process died."
# "2026-11-25T02:48:55,061 [INFO ] W-9001-broken_1.0-stdout MODEL_LOG - <message>"
LINE = re.compile(r"\] (W-\d+)\S*-std(?:out|err) MODEL_LOG - (.*)$")
# a traceback's last line: "AssertionError: ...", "torch._dynamo.exc.Unsupported: ..."
EXCEPTION = re.compile(r"^(?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::|$)"
                       r"|^(?:[a-z_]\w*\.)+[A-Z]\w*: ")
WRAPPER = "RuntimeError: 500 - Unknown exception"  # TorchServe's own, after the real one


@dataclass
class WorkerLog:
    """Reads `path` from where it stopped last time; counts deaths, keeps the last error."""

    path: Path
    deaths: int = 0
    error: str | None = None  # the last line of the latest exception a worker logged
    offset: int = 0

    def read(self) -> list[str]:
        """The progress messages logged since the last call ("W-9000: compiling ...")."""
        if not self.path.is_file():
            return []
        with open(self.path, "rb") as log:
            log.seek(self.offset)
            chunk = log.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line half-written stays for next time
        self.offset += len(complete)
        progress = []
        for raw in complete.decode(errors="replace").splitlines():
            match = LINE.search(raw)
            if not match:
                continue
            worker, message = match.group(1), match.group(2).strip()
            if message == DIED:  # TorchServe logs it before or after the traceback
                self.deaths += 1
            elif message.startswith(PROGRESS):
                progress.append(f"{worker}: {message[len(PROGRESS):]}")
            elif EXCEPTION.match(message) and message != WRAPPER:
                self.error = message
        return progress

    def failure(self) -> str:
        """One line: how often workers died, the exception, where the log is."""
        times = "once" if self.deaths == 1 else f"{self.deaths} times"
        error = self.error or "no exception was logged"
        return (f"the model's worker died while starting ({times}): {error} "
                f"(log: {self.path})")
