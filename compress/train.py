"""The one training loop shared by finetune, distill and quantization-aware training.

AdamW, linear warm-up and decay, gradient accumulation and clipping, bf16 autocast, a
progress bar (loss, examples/s, ETA), a checkpoint every N steps and on Ctrl-C. The data
order is a pure function of (seed, step), so a resumed run ends with the same weights as
an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from compress.data import Examples, collate
from compress.evaluate import logits_of

LossFn = Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]
CHECKPOINT = "checkpoint.pt"


def cross_entropy(model: nn.Module, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
    """Plain supervised loss."""
    return nn.functional.cross_entropy(logits_of(model, inputs), labels)


@dataclass
class TrainResult:
    steps: int
    resumed_from: int
    final_loss: float
    examples_per_s: float
    wall_s: float
    processes: int = 1
    param_digests: list[str] | None = None  # one per rank after a data-parallel run
    bf16_fallback: bool = False  # bf16 was asked for on a CPU without bf16 instructions

    def figures(self) -> dict[str, Any]:
        """The training figures a stage records."""
        figures = {"train_steps": self.steps, "train_loss": self.final_loss,
                   "train_examples_per_s": self.examples_per_s,
                   "resumed_from_step": self.resumed_from}
        if self.bf16_fallback:
            figures["bf16_fallback"] = True
        return figures

    def parallel_metrics(self) -> dict[str, Any]:
        """`train_processes`, and after a data-parallel run the proof that every rank
        ended with the same weights (`replicas_identical`, `param_digest`)."""
        out: dict[str, Any] = {"train_processes": self.processes}
        if self.param_digests:
            out.update(replicas_identical=len(set(self.param_digests)) == 1,
                       param_digest=self.param_digests[0])
        return out


class Schedule:
    """Which examples each micro-batch of this process holds: a seeded permutation per
    epoch, or under torchrun this rank's shard from `DistributedSampler` (`set_epoch`
    every epoch). A pure function of (seed, step), so resuming replays the same order."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.sampler = None
        if world > 1:
            from torch.utils.data import DistributedSampler

            self.sampler = DistributedSampler(range(n), num_replicas=world, rank=rank,
                                              shuffle=True, seed=seed)
        self.per_epoch = math.ceil(shard_size(n, world) / batch_size)
        self._epoch, self._perm = -1, None

    def batch(self, micro_index: int) -> list[int]:
        epoch, within = divmod(micro_index, self.per_epoch)
        if epoch != self._epoch:
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
                perm = list(self.sampler)
            else:
                gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
                perm = torch.randperm(self.n, generator=gen).tolist()
            self._epoch, self._perm = epoch, perm
        return self._perm[within * self.batch_size:(within + 1) * self.batch_size]


def shard_size(n: int, world: int) -> int:
    """Examples each of `world` processes sees per epoch (DistributedSampler pads)."""
    return math.ceil(n / world)


def total_steps(n: int, opts, world: int = 1) -> int:
    """Optimizer steps of a run: max_steps, or epochs over n examples split over `world`
    processes (each step takes batch_size x grad_accum_steps examples per process)."""
    if opts.max_steps:
        return opts.max_steps
    micro = math.ceil(shard_size(n, world) / opts.batch_size)
    return max(1, math.ceil(opts.epochs * micro / opts.grad_accum_steps))


@dataclass
class TrainSetup:
    """The plain values a training run needs besides the model and its options: the
    examples, the tokenization length, the seed, and where checkpoints go (None: a
    temporary folder, so nothing resumes)."""

    examples: Examples
    max_length: int = 128
    seed: int = 0
    checkpoint_dir: Path | None = None
    key: str = "api"
    desc: str = "train"

    def run(self, model: nn.Module, opts, tokenizer=None, **kwargs: Any) -> TrainResult:
        """`train` with these values (`kwargs`: loss_fn, on_step)."""
        if self.checkpoint_dir is None:
            with tempfile.TemporaryDirectory(prefix="compress-train-") as tmp:
                return replace(self, checkpoint_dir=Path(tmp)).run(model, opts, tokenizer,
                                                                   **kwargs)
        return train(model, self.examples, opts, seed=self.seed,
                     checkpoint_dir=self.checkpoint_dir, key=self.key, tokenizer=tokenizer,
                     max_length=self.max_length, desc=self.desc, **kwargs)


def train(model: nn.Module, examples: Examples, opts, *, seed: int, checkpoint_dir: Path,
          key: str, tokenizer=None, max_length: int = 128, loss_fn: LossFn = cross_entropy,
          desc: str = "train", on_step: Callable[[int], None] | None = None) -> TrainResult:
    """Train `model` in place; resume from `checkpoint_dir` when its checkpoint has `key`.

    Under torchrun the model is wrapped in DistributedDataParallel, each rank takes its
    shard of every epoch, and only rank 0 writes checkpoints and shows the progress bar."""
    from compress import distributed

    world, rank = (distributed.world_size(), distributed.rank()) if distributed.active() \
        else (1, 0)
    from compress.runfolder import bf16_supported

    bf16 = opts.bf16 and bf16_supported()
    if opts.bf16 and not bf16 and rank == 0:
        _say(f"{desc}: this CPU has no bf16 instructions (AVX512-BF16 or AMX), where bf16 "
             f"autocast runs 10-20x slower than fp32; training in fp32 instead")
    torch.manual_seed(seed + rank)  # dropout differs per rank; weights come from rank 0
    steps = total_steps(len(examples), opts, world)
    warmup = int(opts.warmup_ratio * steps)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opts.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}], lr=opts.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / max(1, warmup) if s < warmup
        else max(0.0, (steps - s) / max(1, steps - warmup)))
    start = _resume(checkpoint_dir, key, model, optimizer, scheduler, world)
    schedule = Schedule(len(examples), opts.batch_size, seed, rank, world)
    model.train()
    wrapped = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)  # copies rank 0's weights to every rank
    stop = _GracefulStop()
    bar = tqdm(total=steps, initial=start, desc=desc, unit="step", dynamic_ncols=True,
               mininterval=1.0, disable=rank != 0)
    began, seen, loss_value = time.perf_counter(), 0, float("nan")
    try:
        with stop:
            for step in range(start, steps):
                loss_value = 0.0
                for a in range(opts.grad_accum_steps):
                    idx = schedule.batch(step * opts.grad_accum_steps + a)
                    inputs, labels = collate(examples, idx, tokenizer, max_length)
                    last = a == opts.grad_accum_steps - 1
                    sync = contextlib.nullcontext() if last or world == 1 \
                        else wrapped.no_sync()  # all-reduce once per optimizer step
                    with sync:
                        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                            loss = loss_fn(wrapped, inputs, labels) / opts.grad_accum_steps
                        loss.backward()
                    loss_value += float(loss.detach())
                    seen += len(idx)
                if opts.max_grad_norm:
                    nn.utils.clip_grad_norm_(model.parameters(), opts.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                rate = seen / max(1e-9, time.perf_counter() - began)
                bar.set_postfix(loss=f"{loss_value:.4f}", ex_s=f"{rate:.1f}", refresh=False)
                bar.update(1)
                done = step + 1
                if on_step:
                    on_step(done)
                due = stop.requested or (done % opts.checkpoint_every == 0 and done < steps)
                if due and rank == 0:
                    save_checkpoint(checkpoint_dir, key, done, model, optimizer, scheduler,
                                    world)
                if stop.requested:
                    raise KeyboardInterrupt
    except RuntimeError as exc:
        if world > 1 and any(w in str(exc) for w in ("gloo", "NCCL", "Connection", "peer")):
            raise RuntimeError(f"another rank stopped during data-parallel training (it died "
                               f"or was killed): {str(exc).splitlines()[0][:160]}") from None
        raise
    finally:
        bar.close()
        model.eval()
    wall = time.perf_counter() - began
    if world > 1:
        distributed.sync_buffers(model)
    digests = distributed.gather(distributed.param_digest(model)) if world > 1 else None
    if digests and len(set(digests)) != 1:
        raise RuntimeError(f"data-parallel replicas diverged: parameter digests {digests}")
    return TrainResult(steps, start, round(loss_value, 6),
                       round(seen * world / max(wall, 1e-9), 2), round(wall, 2), world, digests,
                       bf16_fallback=opts.bf16 and not bf16)


def save_checkpoint(folder: Path, key: str, step: int, model: nn.Module, optimizer,
                    scheduler, world: int = 1) -> Path:
    """Atomically write everything needed to continue after `step` (and the number of
    processes that trained, so a resume with another number is reported)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {"key": key, "step": step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": torch.get_rng_state(), "world_size": world}
    tmp = folder / f".{CHECKPOINT}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / CHECKPOINT)
    return folder / CHECKPOINT


def _resume(folder: Path, key: str, model: nn.Module, optimizer, scheduler,
            world: int = 1) -> int:
    path = folder / CHECKPOINT
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("key") != key:
        _say(f"ignoring {path}: it belongs to another configuration")
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if world == 1:
        torch.set_rng_state(state["rng"])
    saved = int(state.get("world_size", 1))
    if saved != world:
        _say(f"{path} was written by {saved} process(es) and resumes with {world}: from step "
             f"{state['step']} on, the data order and the steps per epoch follow {world}, so "
             f"the weights will not match an uninterrupted {saved}-process run")
    _say(f"resuming from {path} at step {state['step']}")
    return int(state["step"])


def _say(message: str) -> None:
    """A progress message from rank 0 only."""
    from compress import distributed

    if distributed.is_main():
        tqdm.write(message, file=sys.stderr)


class _GracefulStop:
    """Turn the first Ctrl-C into a flag checked between optimizer steps."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _GracefulStop:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C stops at once
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("interrupted: saving a checkpoint after this step (Ctrl-C again to abort)",
                   file=sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
