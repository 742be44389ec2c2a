"""Collectives timed under NCCL by the CUDA events ProcessGroupNCCL records around each
kernel (a host clock says nothing there: NCCL's futures complete when the work is queued).
One process on one GPU: a one-rank NCCL group still runs every collective's kernel."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from compress.distributed.comm import (
    CommMeter,
    TimedAllGather,
    TimedReduceScatter,
    meter_for_backend,
)


@pytest.fixture(scope="module")
def nccl_group():
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"  # what process_group.init sets under NCCL
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_the_meter_reads_an_all_reduce_from_its_cuda_events(nccl_group) -> None:
    meter = meter_for_backend()
    assert meter.cuda_events and meter.timed
    tensor = torch.ones(64 * 2**20, device="cuda")  # 256 MB
    work = dist.all_reduce(tensor, async_op=True)
    assert meter.after("all_reduce", meter.launched(tensor.numel() * 4), work) is work
    step = meter.take()
    assert step.nbytes == 256 * 2**20
    assert set(step.by_kind) == {"all_reduce"}
    assert step.seconds is not None and step.seconds > 0
    assert step.seconds == pytest.approx(step.by_kind["all_reduce"])
    assert meter.take().nbytes == 0


def test_fsdps_timed_collectives_read_their_cuda_events(nccl_group) -> None:
    """The all-gather and reduce-scatter that `watch_fsdp` hands FSDP2, run as FSDP runs
    them (async, on the default group). FSDP2 skips both at one rank, so they are called
    here directly."""
    meter = CommMeter(cuda_events=True)
    gather, scatter = TimedAllGather(meter), TimedReduceScatter(meter)
    shard = torch.randn(16 * 2**20, device="cuda")
    gathered = gather.allocate((shard.numel(),), dtype=shard.dtype, device=shard.device)
    gather(gathered, shard, dist.group.WORLD, async_op=True).wait()
    reduced = torch.empty_like(shard)
    scatter(reduced, gathered, dist.group.WORLD, dist.ReduceOp.SUM, async_op=True).wait()
    step = meter.take()
    assert set(step.by_kind) == {"all_gather", "reduce_scatter"}
    assert all(seconds > 0 for seconds in step.by_kind.values())
    assert step.seconds == pytest.approx(sum(step.by_kind.values()))
    assert step.nbytes == 2 * shard.numel() * 4
    assert torch.equal(reduced, shard)  # one rank: the sum of one shard is that shard
