"""Training telemetry: loss, learning rate, gradient norm, examples/s and step time per
optimizer step, written as TensorBoard event files in the stage's folder when `tensorboard`
is installed (`pip install 'compress[telemetry]'`), and summed up for the manifest.

    tensorboard --logdir runs/NAME    # every stage's curves, side by side
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path
from typing import Any

TAGS = ("train/loss", "train/learning_rate", "train/grad_norm", "train/examples_per_s",
        "train/step_s")


class Telemetry:
    """Per-step figures of one training run (rank 0 writes; other ranks keep nothing)."""

    def __init__(self, folder: Path | None, enabled: bool = True):
        self.enabled = enabled
        self.writer: Any = None
        self.folder = folder
        self.step_times: list[float] = []
        self.last: dict[str, float] = {}
        if enabled and folder is not None and importlib.util.find_spec("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter

            folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(folder))
        self.writes_events = self.writer is not None

    def step(self, step: int, loss: float, learning_rate: float, grad_norm: float,
             examples_per_s: float, step_s: float) -> None:
        """Record optimizer step `step` (1-based)."""
        if not self.enabled:
            return
        values = (loss, learning_rate, grad_norm, examples_per_s, step_s)
        self.last = dict(zip(TAGS, values, strict=True))
        self.step_times.append(step_s)
        if self.writer is not None:
            for tag, value in self.last.items():
                self.writer.add_scalar(tag, value, step)

    def summary(self) -> dict[str, Any]:
        """The run's final figures for the manifest (and where its event files are)."""
        if not self.enabled or not self.last:
            return {}
        out: dict[str, Any] = {
            "train_learning_rate_final": self.last["train/learning_rate"],
            "train_grad_norm_final": round(self.last["train/grad_norm"], 6),
            "train_step_s_median": round(statistics.median(self.step_times), 4)}
        if self.writes_events and self.folder is not None:
            out["telemetry_dir"] = self.folder.name
        return out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
