"""The shared training loop on a GPU: the model trains where its weights are, under bf16
autocast, with fp32 master weights, and learns."""

from __future__ import annotations

from pathlib import Path

import torch

from compress.data.datasets import Examples
from compress.models.zoo import mlp
from compress.recipe.kinds.finetune import FinetuneConfig
from compress.train.loop import total_steps, train


def _blobs(n: int = 512) -> Examples:
    gen = torch.Generator().manual_seed(0)
    labels = [i % 2 for i in range(n)]
    centers = torch.tensor(labels, dtype=torch.float32)[:, None] * 2 - 1
    return Examples(labels=labels, inputs=centers + 0.5 * torch.randn(n, 64, generator=gen))


def test_bf16_autocast_training_steps_on_cuda(tmp_path: Path) -> None:
    data = _blobs()
    torch.manual_seed(0)
    model = mlp(64, 32, 2).cuda()
    seen: list[torch.dtype] = []
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    opts = FinetuneConfig(epochs=3, batch_size=32, learning_rate=0.01, bf16=True)
    result = train(model, data, opts, seed=0, checkpoint_dir=tmp_path, key="k")
    assert result.steps == total_steps(len(data), opts)
    assert not result.bf16_fallback
    assert seen and set(seen) == {torch.bfloat16}  # the products ran in bf16 on the GPU
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())
    assert result.final_loss < 0.3
    with torch.no_grad():
        model.eval()
        predicted = model(data.inputs.cuda()).argmax(-1).cpu()
    assert (predicted == torch.tensor(data.labels)).float().mean() > 0.95
