"""The shared training loop: learning, schedule, Ctrl-C checkpoint and exact resume."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from compress.data.datasets import Examples
from compress.models.zoo import mlp
from compress.recipe.kinds.finetune import FinetuneConfig
from compress.train.loop import CHECKPOINT, Schedule, total_steps, train


def _blobs(n: int = 256, seed: int = 0) -> Examples:
    """Two Gaussian blobs in 64 dimensions: linearly separable."""
    gen = torch.Generator().manual_seed(seed)
    labels = [i % 2 for i in range(n)]
    centers = torch.tensor(labels, dtype=torch.float32)[:, None] * 2 - 1
    inputs = centers + 0.5 * torch.randn(n, 64, generator=gen)
    return Examples(labels=labels, inputs=inputs)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(mlp(64, 16, 2), torch.nn.Dropout(0.2))


OPTS = FinetuneConfig(epochs=3, batch_size=16, learning_rate=0.01, checkpoint_every=5,
                      grad_accum_steps=2)


def test_training_learns_and_counts_steps(tmp_path: Path) -> None:
    data = _blobs()
    model = _model()
    result = train(model, data, OPTS, seed=0, checkpoint_dir=tmp_path, key="k")
    assert result.steps == total_steps(len(data), OPTS) == 24  # 16 micro-batches / 2 x 3
    with torch.no_grad():
        model.eval()
        acc = (model(data.inputs).argmax(-1) == torch.tensor(data.labels)).float().mean()
    assert acc > 0.95
    assert result.final_loss < 0.3


def test_schedule_is_a_pure_function_of_seed_and_index() -> None:
    a, b = Schedule(50, 8, seed=1), Schedule(50, 8, seed=1)
    first = [a.batch(i) for i in range(14)]
    assert [b.batch(i) for i in reversed(range(14))] == list(reversed(first))
    epoch0 = sorted(i for batch in first[:7] for i in batch)
    assert epoch0 == list(range(50))  # one epoch sees every example once
    assert first[:7] != first[7:]  # a new order every epoch


def test_ctrl_c_saves_a_checkpoint_and_resume_matches_uninterrupted(tmp_path: Path) -> None:
    data = _blobs()
    reference = _model()
    train(reference, data, OPTS, seed=0, checkpoint_dir=tmp_path / "ref", key="k")

    def interrupt_at_7(step: int) -> None:
        if step == 7:
            os.kill(os.getpid(), signal.SIGINT)

    interrupted = _model()
    with pytest.raises(KeyboardInterrupt):
        train(interrupted, data, OPTS, seed=0, checkpoint_dir=tmp_path / "run", key="k",
              on_step=interrupt_at_7)
    saved = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)
    assert saved["step"] == 7

    resumed = _model()  # a fresh process would start from fresh weights too
    result = train(resumed, data, OPTS, seed=0, checkpoint_dir=tmp_path / "run", key="k")
    assert result.resumed_from == 7
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(),
                                strict=True):
        assert torch.equal(a, b), name


def test_checkpoint_of_another_config_is_ignored(tmp_path: Path) -> None:
    data = _blobs()
    train(_model(), data, OPTS.model_copy(update={"max_steps": 5}), seed=0,
          checkpoint_dir=tmp_path, key="old")  # leaves no checkpoint at its last step
    assert not (tmp_path / CHECKPOINT).exists()
    train(_model(), data, OPTS.model_copy(update={"max_steps": 6, "checkpoint_every": 5}),
          seed=0, checkpoint_dir=tmp_path, key="old")
    assert (tmp_path / CHECKPOINT).exists()
    result = train(_model(), data, OPTS, seed=0, checkpoint_dir=tmp_path, key="new")
    assert result.resumed_from == 0


def test_bf16_autocast_trains(tmp_path: Path) -> None:
    data = _blobs()
    model = _model()
    result = train(model, data, OPTS.model_copy(update={"bf16": True}), seed=0,
                   checkpoint_dir=tmp_path, key="k")
    assert result.final_loss < 0.5
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay fp32


@pytest.mark.parametrize("flags,fallback", [({"avx2"}, True), ({"avx2", "avx512_bf16"}, False)])
def test_bf16_falls_back_to_fp32_without_bf16_instructions(flags, fallback, tmp_path: Path,
                                                            monkeypatch) -> None:
    import compress.runfolder.files as runfolder

    monkeypatch.setattr(runfolder, "cpu_flags", lambda: set(flags))
    used = []
    real = torch.autocast

    def spy(*args, **kwargs):
        used.append(kwargs.get("enabled"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", spy)
    x = torch.rand(32, 1, 8, 8)
    examples = Examples(labels=[i % 10 for i in range(32)], inputs=x)
    result = train(mlp(64, 16, 10), examples, FinetuneConfig(max_steps=2, batch_size=16,
                                                             bf16=True),
                   seed=0, checkpoint_dir=tmp_path, key="k")
    assert used and all(flag is (not fallback) for flag in used)
    assert result.figures().get("bf16_fallback", False) is fallback


def test_collectives_in_flight_together_count_once() -> None:
    from compress.distributed.comm import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == pytest.approx(3.0)
    assert busy_seconds([(0.0, 5.0), (1.0, 2.0)]) == pytest.approx(5.0)  # queued behind


def test_the_meter_times_a_collective_until_its_future_completes() -> None:
    from compress.distributed.comm import CommMeter

    class Work:  # what torch.distributed returns for async_op=True
        def __init__(self) -> None:
            self.future: torch.futures.Future[None] = torch.futures.Future()

        def get_future(self) -> torch.futures.Future[None]:
            return self.future

    meter = CommMeter()
    work = Work()
    assert meter.after("all_gather", meter.launched(4_000), work) is work
    meter.after("reduce_scatter", meter.launched(1_000), None)  # ran synchronously
    work.future.set_result(None)
    step = meter.take()
    assert step.nbytes == 5_000 and set(step.by_kind) == {"all_gather", "reduce_scatter"}
    assert step.seconds is not None and step.seconds >= step.by_kind["all_gather"] > 0
    assert meter.take().nbytes == 0  # the next step starts empty
    assert CommMeter(timed=False).take().seconds is None  # untimed: bytes only


def test_communication_figures_per_step_and_for_the_manifest() -> None:
    from compress.distributed.comm import StepComm
    from compress.train.telemetry import comm_scalars, comm_summary

    steps = [StepComm(0.1, 2_000_000, {"all_gather": 0.06, "reduce_scatter": 0.05}),
             StepComm(0.3, 4_000_000, {"all_gather": 0.2, "reduce_scatter": 0.1})]
    assert comm_scalars(steps[0], 0.4) == pytest.approx({
        "train/comm_mb": 2.0, "train/comm_s": 0.1, "train/comm_share": 0.25,
        "train/comm_all_gather_s": 0.06, "train/comm_reduce_scatter_s": 0.05})
    assert comm_summary(steps, [0.4, 0.6]) == pytest.approx({
        "train_comm_mb_per_step": 3.0, "train_comm_mb_total": 6.0,
        "train_comm_s_total": 0.4, "train_comm_share": 0.4,  # 0.4 s of 1.0 s
        "train_comm_share_median": 0.375,  # of 0.25 and 0.5
        "train_comm_all_gather_s_total": 0.26, "train_comm_reduce_scatter_s_total": 0.15})
    untimed = [StepComm(None, 1_000_000)]
    assert comm_summary(untimed, [0.2]) == {"train_comm_mb_per_step": 1.0,
                                            "train_comm_mb_total": 1.0}
    assert comm_scalars(untimed[0], 0.2) == {"train/comm_mb": 1.0}
    assert comm_summary([], []) == {}
