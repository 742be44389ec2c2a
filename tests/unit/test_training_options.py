"""The training loop's options beyond one process, checked in one: transformer blocks,
activation checkpointing, telemetry event files, the global-batch schedule, held bytes,
and a sharded-format checkpoint resuming exactly."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from compress.data.datasets import Examples
from compress.measure.memory import held_bytes
from compress.models.blocks import checkpointed, transformer_blocks
from compress.models.zoo import mlp
from compress.recipe.kinds.finetune import FinetuneConfig
from compress.train.loop import Schedule, train


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def test_the_blocks_are_the_longest_list_of_one_layer_class() -> None:
    model = _tiny_llama()
    blocks = transformer_blocks(model)
    assert blocks == list(model.model.layers) and len(blocks) == 3
    assert transformer_blocks(mlp(8, 4, 2)) == []


def _loss_grads_and_saved_bytes(model: nn.Module, ids: torch.Tensor
                                ) -> tuple[float, list[torch.Tensor], int]:
    """The loss, the gradients, and the bytes autograd kept from the forward for backward."""
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    kept = sum(saved)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], kept


def test_activation_checkpointing_keeps_less_gives_the_same_gradients_and_leaves_no_trace(
        ) -> None:
    model = _tiny_llama().train()
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
    names = list(model.state_dict())
    plain_loss, plain, plain_kept = _loss_grads_and_saved_bytes(model, ids)
    with checkpointed(transformer_blocks(model)):
        loss, grads, kept = _loss_grads_and_saved_bytes(model, ids)
    assert kept < 0.5 * plain_kept, (kept, plain_kept)  # the blocks keep only their inputs
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for a, b in zip(plain, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert list(model.state_dict()) == names and "forward" not in vars(model.model.layers[0])


def test_the_schedule_gives_two_ranks_the_batches_one_process_takes_at_twice_the_size() -> None:
    one = Schedule(50, 8, seed=3)
    ranks = [Schedule(50, 4, seed=3, rank=r, world=2) for r in range(2)]
    for step in range(14):  # two epochs
        assert sorted(ranks[0].batch(step) + ranks[1].batch(step)) == sorted(one.batch(step))
        assert not set(ranks[0].batch(step)) & set(ranks[1].batch(step))


def test_held_bytes_count_a_tied_weight_once() -> None:
    model = _tiny_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # unique params
    assert held_bytes(model.parameters()) == total


def _blobs(n: int = 128) -> Examples:
    gen = torch.Generator().manual_seed(0)
    labels = [i % 2 for i in range(n)]
    centers = torch.tensor(labels, dtype=torch.float32)[:, None] * 2 - 1
    return Examples(labels=labels, inputs=centers + 0.5 * torch.randn(n, 16, generator=gen))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp(16, 8, 2)


def test_telemetry_writes_one_point_per_step_for_every_curve(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opts = FinetuneConfig(max_steps=6, batch_size=16, learning_rate=0.01)
    result = train(_mlp(), _blobs(), opts, seed=0, checkpoint_dir=tmp_path / "ck", key="k",
                   telemetry_dir=tmp_path / "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/loss", "train/learning_rate", "train/grad_norm",
                    "train/examples_per_s", "train/step_s"}
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [1, 2, 3, 4, 5, 6]
    assert losses[-1].value == pytest.approx(result.final_loss, rel=1e-5)
    assert all(e.value > 0 for e in events.Scalars("train/grad_norm"))
    figures = result.figures()
    assert figures["telemetry_dir"] == "tensorboard" and figures["train_step_s_median"] > 0
    assert figures["train_state_mb_per_rank"] > 0


def test_a_sharded_format_checkpoint_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    opts = FinetuneConfig(epochs=3, batch_size=16, learning_rate=0.01, checkpoint_every=4,
                          parallel="fsdp")
    reference = _mlp()
    train(reference, _blobs(), opts, seed=0, checkpoint_dir=tmp_path / "ref", key="k")

    def interrupt_at_5(step: int) -> None:
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(_mlp(), _blobs(), opts, seed=0, checkpoint_dir=tmp_path / "run", key="k",
              on_step=interrupt_at_5)
    assert (tmp_path / "run/sharded/.metadata").is_file()
    resumed = _mlp()
    result = train(resumed, _blobs(), opts, seed=0, checkpoint_dir=tmp_path / "run", key="k")
    assert result.resumed_from == 5
    for (name, a), b in zip(reference.state_dict().items(), resumed.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
