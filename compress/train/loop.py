"""The one training loop shared by finetune, distill and quantization-aware training.

AdamW, linear warm-up and decay, gradient accumulation and clipping, bf16 autocast, a
progress bar (loss, examples/s, ETA), a checkpoint every N steps and on Ctrl-C, telemetry
per step. Under torchrun the model trains data-parallel (DDP) or sharded (`parallel: fsdp`,
`compress.distributed.fsdp`); `activation_checkpointing` recomputes each transformer block's
activations in backward. The data order is a pure function of (seed, step) and of the global
batch, not of the process count, so a resumed run ends with the same weights as an
uninterrupted one, and 2 processes at batch B see the examples 1 process sees at batch 2B.
"""

from __future__ import annotations

import contextlib
import copy
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from compress.data.datasets import Examples, collate
from compress.measure.evaluate import logits_of
from compress.models.blocks import checkpointed, transformer_blocks
from compress.train.checkpoint import CHECKPOINT, Checkpoints, say
from compress.train.step import (
    GracefulStop,
    agree_across_ranks,
    clip_gradients,
    held_memory,
    hold_zeros,
    make_optimizer,
    pruned_zeros,
)
from compress.train.telemetry import Telemetry

LossFn = Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]
__all__ = ["CHECKPOINT", "Schedule", "TrainResult", "TrainSetup", "total_steps", "train"]


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
    telemetry: dict[str, Any] = field(default_factory=dict)  # Telemetry.summary()
    memory: dict[str, Any] = field(default_factory=dict)  # what each rank held, peak RSS

    def figures(self) -> dict[str, Any]:
        """The training figures a stage records."""
        figures = {"train_steps": self.steps, "train_loss": self.final_loss,
                   "train_examples_per_s": self.examples_per_s,
                   "resumed_from_step": self.resumed_from, **self.telemetry, **self.memory}
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
    """Which examples each micro-batch of this process holds. Every epoch has one seeded
    permutation of the examples (padded cyclically to a multiple of the process count);
    micro-batch k of the job takes the next `batch_size x world` of it, and this rank its
    `rank`-th share. A pure function of (seed, index), so resuming replays the same order,
    and the same for any process count at the same global batch."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.padded = shard_size(n, world) * world
        self.per_epoch = math.ceil(shard_size(n, world) / batch_size)
        self._epoch, self._perm = -1, None

    def batch(self, micro_index: int) -> list[int]:
        epoch, within = divmod(micro_index, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            perm = torch.randperm(self.n, generator=gen).tolist()
            self._epoch, self._perm = epoch, (perm * self.world)[:self.padded]
        span = self.batch_size * self.world
        chunk = self._perm[within * span:(within + 1) * span]
        share = len(chunk) // self.world
        return chunk[self.rank * share:(self.rank + 1) * share]


def shard_size(n: int, world: int) -> int:
    """Examples each of `world` processes sees per epoch (padded to a multiple of `world`)."""
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
    telemetry_dir: Path | None = None  # TensorBoard event files (None: none written)

    def run(self, model: nn.Module, opts, tokenizer=None, **kwargs: Any) -> TrainResult:
        """`train` with these values (`kwargs`: loss_fn, on_step)."""
        if self.checkpoint_dir is None:
            with tempfile.TemporaryDirectory(prefix="compress-train-") as tmp:
                return replace(self, checkpoint_dir=Path(tmp)).run(model, opts, tokenizer,
                                                                   **kwargs)
        return train(model, self.examples, opts, seed=self.seed,
                     checkpoint_dir=self.checkpoint_dir, key=self.key, tokenizer=tokenizer,
                     max_length=self.max_length, desc=self.desc,
                     telemetry_dir=self.telemetry_dir, **kwargs)


def to_device(batch: Any, device: torch.device) -> Any:
    """A collated batch (tensors, dicts and tuples of them) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {name: to_device(value, device) for name, value in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def train(model: nn.Module, examples: Examples, opts, *, seed: int, checkpoint_dir: Path,
          key: str, tokenizer=None, max_length: int = 128, loss_fn: LossFn = cross_entropy,
          desc: str = "train", on_step: Callable[[int], None] | None = None,
          telemetry_dir: Path | None = None) -> TrainResult:
    """Train `model` in place; resume from `checkpoint_dir` when its checkpoint has `key`.

    Under torchrun each rank takes its share of every global batch; the model trains under
    DistributedDataParallel, or under `parallel: fsdp` as a sharded copy whose full weights
    are loaded back into `model` at the end. Only rank 0 writes files and shows progress."""
    from compress.distributed import process_group
    from compress.measure.memory import peak_rss_mb, reset_peak_rss
    from compress.runfolder.files import bf16_supported

    world, rank = (process_group.world_size(), process_group.rank()) if process_group.active() \
        else (1, 0)
    device = next(model.parameters()).device  # the model trains where its weights are
    bf16 = opts.bf16 and (torch.cuda.is_bf16_supported() if device.type == "cuda"
                          else bf16_supported())
    if opts.bf16 and not bf16 and device.type == "cpu":
        say(f"{desc}: this CPU has no bf16 instructions (AVX512-BF16 or AMX), where bf16 "
            f"autocast runs 10-20x slower than fp32; training in fp32 instead")
    is_sharded = getattr(opts, "parallel", "ddp") == "fsdp"
    if is_sharded and world == 1:
        say(f"{desc}: parallel: fsdp with one process trains unsharded (launch with "
            f"`compress run --nproc N` to shard); its checkpoints are sharded-format")
    torch.manual_seed(seed + rank)  # dropout differs per rank; weights come from rank 0
    steps = total_steps(len(examples), opts, world)
    trained = model
    if is_sharded and world > 1:
        from compress.distributed import fsdp

        trained = copy.deepcopy(model)
        fsdp.shard(trained, transformer_blocks(trained), opts.mixed_precision == "bf16")
    held = pruned_zeros(model)  # held on the full weights; an FSDP-sharded copy does not
    if held and trained is not model:  # hold them (its weights are sharded DTensors)
        say(f"{desc}: parallel: fsdp does not hold pruned zeros; {len(held)} pruned weight "
            f"matrices may fill in (train a pruned model with ddp to keep its pattern)")
        held = []
    elif held:
        say(f"{desc}: {len(held)} pruned weight matrices keep their zeros while training")
    optimizer, scheduler = make_optimizer(trained, opts, steps)
    store = Checkpoints(checkpoint_dir, key, world, is_sharded)
    start = store.resume(trained, optimizer, scheduler)
    schedule = Schedule(len(examples), opts.batch_size, seed, rank, world)
    wrapped, meter = trained, None
    if world > 1:
        from compress.distributed import comm

        meter = comm.meter_for_backend()
        if is_sharded:
            comm.watch_fsdp(trained, meter)
        else:
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(trained)  # copies rank 0's weights to every rank
            comm.watch_ddp(wrapped, meter)
    recompute = transformer_blocks(trained) if getattr(opts, "activation_checkpointing",
                                                       False) else []
    if getattr(opts, "activation_checkpointing", False) and not recompute:
        say(f"{desc}: activation_checkpointing: the model has no transformer blocks "
            f"(a list of identical layers); training without it")
    stop = GracefulStop()
    telemetry = Telemetry(telemetry_dir, enabled=rank == 0)
    bar = tqdm(total=steps, initial=start, desc=desc, unit="step", dynamic_ncols=True,
               mininterval=1.0, disable=True if rank != 0 else None)  # None: quiet off a TTY
    began, seen, loss_value = time.perf_counter(), 0, float("nan")
    trained.train()
    reset_peak_rss()
    try:
        with stop, checkpointed(recompute):
            for step in range(start, steps):
                step_began, loss_value = time.perf_counter(), 0.0
                for a in range(opts.grad_accum_steps):
                    idx = schedule.batch(step * opts.grad_accum_steps + a)
                    inputs, labels = to_device(collate(examples, idx, tokenizer,
                                                       max_length), device)
                    last = a == opts.grad_accum_steps - 1
                    sync = contextlib.nullcontext() if last or wrapped is trained \
                        else wrapped.no_sync()  # DDP all-reduces once per optimizer step
                    with sync:
                        with torch.autocast(device.type, dtype=torch.bfloat16,
                                            enabled=bf16):
                            loss = loss_fn(wrapped, inputs, labels) / opts.grad_accum_steps
                        loss.backward()
                    loss_value += float(loss.detach())
                    seen += len(idx)
                grad_norm = clip_gradients(trained, opts.max_grad_norm)
                optimizer.step()
                hold_zeros(held)
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                done = step + 1
                if on_step:
                    on_step(done)
                loss_value, stopping = agree_across_ranks(loss_value, stop.requested, world)
                rate = seen * world / max(1e-9, time.perf_counter() - began)
                telemetry.step(done, loss_value, scheduler.get_last_lr()[0], grad_norm, rate,
                               time.perf_counter() - step_began, meter.take() if meter else None)
                bar.set_postfix(loss=f"{loss_value:.4f}", ex_s=f"{rate:.1f}", refresh=False)
                bar.update(1)
                if stopping or (done % opts.checkpoint_every == 0 and done < steps):
                    store.save(done, trained, optimizer, scheduler)
                if stopping:
                    raise KeyboardInterrupt
    except RuntimeError as exc:
        if world > 1 and any(w in str(exc) for w in ("gloo", "NCCL", "Connection", "peer")):
            raise RuntimeError(f"another rank stopped during data-parallel training (it died "
                               f"or was killed): {str(exc).splitlines()[0][:160]}") from None
        raise
    finally:
        bar.close()
        telemetry.close()
        model.eval()
    wall = time.perf_counter() - began
    memory = held_memory(trained, optimizer, peak_rss_mb())
    if trained is not model:
        from compress.distributed import fsdp

        model.load_state_dict(fsdp.full_state(trained))
    if world > 1:
        process_group.sync_buffers(model)
    digests = process_group.gather(process_group.param_digest(model)) if world > 1 else None
    if digests and len(set(digests)) != 1:
        raise RuntimeError(f"data-parallel replicas diverged: parameter digests {digests}")
    return TrainResult(steps, start, round(loss_value, 6),
                       round(seen * world / max(wall, 1e-9), 2), round(wall, 2), world, digests,
                       bf16_fallback=opts.bf16 and not bf16, telemetry=telemetry.summary(),
                       memory=memory)
