"""Issue 44 item 5: kernels that write the next int8 linear's uint8 input themselves. The first
norm gathers its embedding rows (`compress_encoder.embed_layer_norm`, serve/encoder_norm.cpp,
swapped in by export/fused_norm.py), and the attention kernel quantizes its answer
(`attention_quantized`, `packed_attention_quantized`, serve/encoder_attention.cpp, swapped in
by export/quantized_attention.py). Each kernel is checked against aten, and each pass on the
graph and on the compiled package's answers at shapes other than the traced one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_vnni
from test_encoder_attention import relative
from test_encoder_graph_passes import int8_program
from test_encoder_int8_fusions import _compiled

from compress.algorithms.smoothing import SmoothedLinear
from export.attention_kernel import use_attention_kernel
from export.fused_norm import fuse_norms
from export.quantized_attention import quantize_attention_answers
from serve import encoder_attention

EMBED_NORM = "compress_encoder.embed_layer_norm.default"
QUANTIZED = "compress_encoder.attention_quantized.default"


def _quantize(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the q/dq ops)

    return torch.ops.quantized_decomposed.quantize_per_tensor(
        x, scale, zero_point, 0, 255, torch.uint8)


def test_the_embedding_norm_kernel_matches_aten() -> None:
    assert encoder_attention.load(), encoder_attention.error()
    kernel = torch.ops.compress_encoder.embed_layer_norm
    generator = torch.Generator().manual_seed(0)
    for width in (384, 100):  # the register path, and the loops with a vector tail
        word, position, kind = (torch.randn(rows, width, generator=generator)
                                for rows in (1000, 64, 2))
        ids = torch.randint(0, 1000, (5, 40), generator=generator)
        positions = torch.arange(40)[None]  # broadcast over the batch, as BERT's buffer is
        kinds = torch.randint(0, 2, (5, 40), generator=generator)
        weight, bias = (torch.randn(width, generator=generator) for _ in range(2))
        smooth = torch.rand(width, generator=generator) + 0.5
        lookups = ((word, ids), (position, positions), (kind, kinds))
        for count, by in ((3, None), (2, smooth), (1, None)):
            tables, indices = zip(*lookups[:count], strict=True)
            out, quantized = kernel(list(tables), list(indices), weight, bias, 1e-12, by,
                                    0.0312, 121, 0, 255)
            summed = sum(F.embedding(i, t) for t, i in zip(tables, indices, strict=True))
            want = F.layer_norm(summed.expand(5, 40, width), (width,), weight, bias, 1e-12)
            assert out.shape == (5, 40, width) and (out - want).abs().max() < 1e-4
            want_q = _quantize(want if by is None else want * by, 0.0312, 121)
            assert quantized.dtype == torch.uint8
            assert (quantized.int() - want_q.int()).abs().max() <= 1
            assert (quantized != want_q).float().mean() < 1e-3
    with pytest.raises(RuntimeError, match="id 1000 out of range for a table of 1000 rows"):
        kernel([word], [torch.tensor([[3, 1000]])], weight, bias, 1e-12, None, 0.03, 121, 0, 255)


class _Embeddings(torch.nn.Module):
    """BERT's embeddings (word + token type + position, then LayerNorm), then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.word, self.kind = torch.nn.Embedding(500, 64), torch.nn.Embedding(2, 64)
        self.position = torch.nn.Embedding(512, 64)
        self.register_buffer("positions", torch.arange(512)[None], persistent=False)
        self.norm, self.proj = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        summed = self.word(ids) + self.kind(torch.zeros_like(ids))
        summed = summed + self.position(self.positions[:, :ids.shape[1]])
        return self.proj(self.norm(summed))


@needs_vnni
def test_the_first_norm_gathers_its_embeddings(tmp_path: Path) -> None:
    assert encoder_attention.load(), encoder_attention.error()
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(ids, _Embeddings())
    assert fuse_norms(program) == 1
    (call,) = [n for n in program.graph.nodes if str(n.target) == EMBED_NORM]
    assert len(call.args[0]) == 3  # word, token type and position tables
    targets = {str(n.target) for n in program.graph.nodes}
    assert not targets & {"aten.embedding.default", "aten.layer_norm.default",
                          "aten.add.Tensor"}
    compiled = _compiled(program, tmp_path / "embeddings.pt2")
    for shape in [(3, 7), (1, 40)]:  # not the traced batch and length
        sample = torch.randint(0, 500, shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, want = compiled(sample), converted(sample)
        assert got.shape == (*shape, 64) and relative(got, want) < 1e-2


def test_the_attention_kernel_quantizes_its_answer() -> None:
    assert encoder_attention.load(), encoder_attention.error()
    ops = torch.ops.compress_encoder
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, head_dim = 3, 45, 4, 32
    x = torch.randn(batch, length, 3, heads, head_dim, generator=generator)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    mask[1, ..., 30:] = False
    smooth = torch.rand(heads * head_dim, generator=generator) + 0.5
    answer = ops.attention(q, k, v, mask, head_dim ** -0.5).reshape(batch, length, -1)
    offsets = torch.tensor([0, 20, 45])
    packed = ops.packed_attention(q[:1], k[:1], v[:1], offsets, head_dim ** -0.5)
    for by in (None, smooth):
        got = ops.attention_quantized(q, k, v, mask, head_dim ** -0.5, by, 0.01, 128, 0, 255)
        want = _quantize(answer if by is None else answer * by, 0.01, 128)
        assert got.dtype == torch.uint8 and got.shape == (batch, length, heads, head_dim)
        assert torch.equal(got.reshape(batch, length, -1), want)  # the same floats, quantized
        got = ops.packed_attention_quantized(q[:1], k[:1], v[:1], offsets, head_dim ** -0.5, by,
                                             0.01, 128, 0, 255)
        flat = packed.reshape(1, length, -1)
        assert torch.equal(got.reshape(1, length, -1),
                           _quantize(flat if by is None else flat * by, 0.01, 128))
    with pytest.raises(RuntimeError, match="one factor a feature"):
        ops.attention_quantized(q, k, v, mask, 0.1, smooth[:7], 0.01, 128, 0, 255)


class _Attention(torch.nn.Module):
    """Self-attention of 2 heads of 32 whose output projection SmoothQuant scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(64, 192)
        scale = torch.rand(64, generator=torch.Generator().manual_seed(5)) + 0.5
        self.out = SmoothedLinear(torch.nn.Linear(64, 64), scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 32).permute(2, 0, 3, 1, 4)
        answer = F.scaled_dot_product_attention(q, k, v)
        return self.out(answer.transpose(1, 2).reshape(batch, length, 64)) + x


@needs_vnni
def test_the_attention_answer_is_quantized_in_the_kernel(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(x, _Attention())
    assert use_attention_kernel(program) == 1
    assert quantize_attention_answers(program) == 1
    (call,) = [n for n in program.graph.nodes if str(n.target) == QUANTIZED]
    assert call.args[5] is not None  # SmoothQuant's multiply, applied by the kernel
    assert call.meta["val"].dtype == torch.uint8
    assert not any(n.target == torch.ops.aten.mul.Tensor for n in program.graph.nodes)
    assert quantize_attention_answers(program) == 0
    compiled = _compiled(program, tmp_path / "attention.pt2")
    for shape in [(3, 7, 64), (1, 40, 64)]:  # not the traced batch and length
        sample = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, want = compiled(sample.clone()), converted(sample)
        assert got.shape == shape and relative(got, want) < 2e-2  # bf16 products on AVX512-BF16
