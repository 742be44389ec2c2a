"""Training telemetry: loss, learning rate, gradient norm, examples/s and step time per
optimizer step, and in a data-parallel run the step's communication (seconds with a
collective in flight, their share of the step, megabytes; `compress.distributed.comm`),
written as TensorBoard event files in the stage's folder when `tensorboard` is installed
(`pip install 'compress-pipeline[telemetry]'`), and summed up for the manifest.

    tensorboard --logdir runs/NAME    # every stage's curves, side by side
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path
from typing import Any

from compress.distributed.comm import StepComm

TAGS = ("train/loss", "train/learning_rate", "train/grad_norm", "train/examples_per_s",
        "train/step_s")


class Telemetry:
    """Per-step figures of one training run (rank 0 writes; other ranks keep nothing)."""

    def __init__(self, folder: Path | None, enabled: bool = True):
        self.enabled = enabled
        self.writer: Any = None
        self.folder = folder
        self.step_times: list[float] = []
        self.comms: list[StepComm] = []
        self.last: dict[str, float] = {}
        if enabled and folder is not None and importlib.util.find_spec("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter

            folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(folder))
        self.writes_events = self.writer is not None

    def step(self, step: int, loss: float, learning_rate: float, grad_norm: float,
             examples_per_s: float, step_s: float, comm: StepComm | None = None) -> None:
        """Record optimizer step `step` (1-based) and, when data-parallel, its collectives."""
        if not self.enabled:
            return
        values = (loss, learning_rate, grad_norm, examples_per_s, step_s)
        self.last = dict(zip(TAGS, values, strict=True))
        self.step_times.append(step_s)
        scalars = dict(self.last)
        if comm is not None:
            self.comms.append(comm)
            scalars.update(comm_scalars(comm, step_s))
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def summary(self) -> dict[str, Any]:
        """The run's final figures for the manifest (and where its event files are)."""
        if not self.enabled or not self.last:
            return {}
        out: dict[str, Any] = {
            "train_learning_rate_final": self.last["train/learning_rate"],
            "train_grad_norm_final": round(self.last["train/grad_norm"], 6),
            "train_step_s_median": round(statistics.median(self.step_times), 4)}
        out.update(comm_summary(self.comms, self.step_times[-len(self.comms):]))
        if self.writes_events and self.folder is not None:
            out["telemetry_dir"] = self.folder.name
        return out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def comm_scalars(comm: StepComm, step_s: float) -> dict[str, float]:
    """One step's communication curves: `train/comm_mb`, and when timed `train/comm_s`,
    `train/comm_share` and `train/comm_<kind>_s` per kind of collective."""
    out = {"train/comm_mb": comm.nbytes / 1e6}
    share = comm.share(step_s)
    if comm.seconds is not None and share is not None:
        out.update({"train/comm_s": comm.seconds, "train/comm_share": share})
        out.update({f"train/comm_{kind}_s": s for kind, s in comm.by_kind.items()})
    return out


def comm_summary(comms: list[StepComm], step_times: list[float]) -> dict[str, Any]:
    """The manifest's communication figures over the run's steps (none without any):
    megabytes per step (median) and in all, and when timed the seconds in all and per kind,
    the share of all step time (`train_comm_share`) and the median step's share."""
    if not comms:
        return {}
    out: dict[str, Any] = {
        "train_comm_mb_per_step": round(statistics.median(c.nbytes for c in comms) / 1e6, 4),
        "train_comm_mb_total": round(sum(c.nbytes for c in comms) / 1e6, 3)}
    timed = [(c, s) for c, s in zip(comms, step_times, strict=True) if c.seconds is not None]
    if not timed:
        return out
    seconds = sum(c.seconds or 0.0 for c, _ in timed)
    out["train_comm_s_total"] = round(seconds, 4)
    out["train_comm_share"] = round(seconds / max(1e-9, sum(s for _, s in timed)), 4)
    out["train_comm_share_median"] = round(statistics.median(
        c.share(s) or 0.0 for c, s in timed), 4)
    kinds = sorted({k for c, _ in timed for k in c.by_kind})
    for kind in kinds:
        out[f"train_comm_{kind}_s_total"] = round(sum(c.by_kind.get(kind, 0.0)
                                                      for c, _ in timed), 4)
    return out
