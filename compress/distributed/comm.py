"""Time and bytes of the collectives that data-parallel training runs, per optimizer step.

Every collective is torch.distributed's own; this module only watches them. Under DDP a
communication hook (`register_comm_hook`) wraps DDP's default all-reduce hook; under FSDP2
`set_custom_all_gather` and `set_custom_reduce_scatter` hand FSDP the same
`torch.distributed` all-gather and reduce-scatter it runs by default, timed. A collective
lasts from its launch until its future completes (on a gloo thread: the wall time, queueing
behind earlier collectives included); a step's communication time is the union of those
intervals, so collectives in flight together count once, and its share is that time over
the step's. Bytes follow nccl-tests' convention: the whole buffer of each collective (the
all-reduced tensor, the gathered output, the scattered input), not the bytes on the wire.

NCCL completes a future when its kernel is queued, not when it ends, so under NCCL the host
clock says nothing: there each collective is timed by the CUDA events ProcessGroupNCCL records
around its kernel (`TORCH_NCCL_ENABLE_TIMING=1`, set by `process_group.init`), read with
`Work._get_duration()` once the step's work is done. One process group's collectives run on
one NCCL stream, one after another, so their durations add up to the union.

Expert-parallel inference (`serve/causal_lm/runtime/expert_dispatch.py`) records its own
all-to-alls and all-gathers in the shipped runtime, which imports no compress code;
`step_of_record` reads a decode step's record into the same `StepComm`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time with anything in flight."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@dataclass
class StepComm:
    """One optimizer step's collectives on this rank: in-flight seconds (all and per kind)
    and bytes."""

    seconds: float | None
    nbytes: int
    by_kind: dict[str, float] = field(default_factory=dict)

    def share(self, step_s: float) -> float | None:
        """Communication time over the step's wall time (None when not timed)."""
        if self.seconds is None or step_s <= 0:
            return None
        return min(1.0, self.seconds / step_s)


class CommMeter:
    """What the watched collectives did since the last `take()` (thread-safe: completions
    arrive on the backend's threads)."""

    def __init__(self, timed: bool = True, cuda_events: bool = False):
        self.timed = timed or cuda_events
        self.cuda_events = cuda_events  # NCCL: durations from the Work's own CUDA events
        self._lock = threading.Lock()
        self._spans: list[tuple[str, float, float]] = []
        self._bytes = 0
        self._pending: list[Any] = []  # futures whose completion may not be recorded yet
        self._works: list[tuple[str, Any]] = []  # NCCL works to read durations from

    def launched(self, nbytes: int) -> float:
        """Note a collective of `nbytes` launched now; its start time."""
        with self._lock:
            self._bytes += nbytes
        return time.perf_counter()

    def finished(self, kind: str, started: float) -> None:
        """Note the end, now, of a collective launched at `started`."""
        ended = time.perf_counter()
        with self._lock:
            self._spans.append((kind, started, ended))

    def after(self, kind: str, started: float, work: Any) -> Any:
        """Record the end of a collective launched at `started`: now if it ran synchronously
        (`work` None), else when its Work's future completes; return `work`."""
        if work is None:
            self.finished(kind, started)
            return None
        if self.cuda_events:
            with self._lock:
                self._works.append((kind, work))
            return work
        done = work.get_future().then(lambda _: self.finished(kind, started))
        with self._lock:
            self._pending.append(done)
        return work

    def take(self) -> StepComm:
        """The step's figures since the last call; starts the next step."""
        with self._lock:
            pending, self._pending = self._pending, []
            works, self._works = self._works, []
        for future in pending:  # complete already (training waited on them): callbacks run
            future.wait()
        if works:
            torch.cuda.synchronize()  # the end events are recorded once the kernels ran
        with self._lock:
            spans, nbytes, self._spans, self._bytes = self._spans, self._bytes, [], 0
        if not self.timed:
            return StepComm(None, nbytes)
        if self.cuda_events:
            durations = [(kind, work._get_duration() / 1000) for kind, work in works]
            by_kind = {k: sum(s for kind, s in durations if kind == k)
                       for k in KINDS if any(kind == k for kind, _ in durations)}
            return StepComm(sum(s for _, s in durations), nbytes, by_kind)
        by_kind = {k: busy_seconds((s, e) for kind, s, e in spans if kind == k)
                   for k in KINDS if any(kind == k for kind, _, _ in spans)}
        return StepComm(busy_seconds((s, e) for _, s, e in spans), nbytes, by_kind)


def step_of_record(per_kind: dict[str, dict[str, float]]) -> StepComm:
    """One decode step's collectives as the shipped expert-parallel runtime records them
    (`serve/causal_lm/runtime/expert_dispatch.py`'s CommRecord, per step: {kind: {"s_per_step",
    "bytes_per_step"}}): its collectives run one after another, so their seconds add up."""
    by_kind = {k: float(v["s_per_step"]) for k, v in per_kind.items() if k in KINDS}
    return StepComm(sum(by_kind.values()),
                    int(sum(v["bytes_per_step"] for v in per_kind.values())), by_kind)


def watch_ddp(ddp: nn.Module, meter: CommMeter) -> None:
    """Time DDP's gradient all-reduce, bucket by bucket: what its default hook does (divide
    by the world size, all-reduce), with the collective's Work in hand for the meter."""
    import torch.distributed as dist

    # no annotations: DDP checks them against the real classes, and here they are strings
    def hook(group, bucket):  # noqa: ANN001, ANN202
        group = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer().div_(group.size())
        started = meter.launched(buffer.numel() * buffer.element_size())
        work = dist.all_reduce(buffer, group=group, async_op=True)
        meter.after("all_reduce", started, work)
        return work.get_future().then(lambda future: future.value()[0])

    ddp.register_comm_hook(None, hook)


class TimedAllGather:
    """FSDP2's all-gather (`torch.distributed.all_gather_into_tensor`), watched."""

    def __init__(self, meter: CommMeter):
        self.meter = meter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        import torch.distributed as dist

        nbytes = output_tensor.numel() * output_tensor.element_size()
        started = self.meter.launched(nbytes)
        work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)
        return self.meter.after("all_gather", started, work)


class TimedReduceScatter:
    """FSDP2's reduce-scatter (`torch.distributed.reduce_scatter_tensor`), watched."""

    def __init__(self, meter: CommMeter):
        self.meter = meter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Any:
        import torch.distributed as dist

        nbytes = input_tensor.numel() * input_tensor.element_size()
        started = self.meter.launched(nbytes)
        work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)
        return self.meter.after("reduce_scatter", started, work)


def watch_fsdp(model: nn.Module, meter: CommMeter) -> int:
    """Time the all-gathers and reduce-scatters of every `fully_shard`ed module of `model`;
    how many modules are watched."""
    from torch.distributed.fsdp import FSDPModule

    watched = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(TimedAllGather(meter))
            module.set_custom_reduce_scatter(TimedReduceScatter(meter))
            watched += 1
    return watched


def meter_for_backend() -> CommMeter:
    """A meter for this process group's backend: the host clock where futures complete with
    the work (gloo), the collectives' own CUDA events under NCCL."""
    import torch.distributed as dist

    return CommMeter(cuda_events=dist.get_backend() == "nccl")
