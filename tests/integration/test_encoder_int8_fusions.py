"""Issue 44 item 5: more passes the AOTInductor export runs on an int8 encoder's graph:
`add -> layer_norm -> quantize` on compress's kernel (export/fused_norm.py,
serve/encoder_norm.cpp), `gelu -> SmoothQuant multiply -> quantize` on it too
(export/fused_gelu.py, serve/encoder_activation.cpp), and int8 linears reading one tensor
merged into one GEMM (export/fused_projections.py). Each is checked on the graph, on the
compiled package's answers at shapes other than the traced one, and the kernels against
aten."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import needs_vnni
from test_encoder_attention import relative
from test_encoder_graph_passes import int8_program

from compress.algorithms.smoothing import SmoothedLinear
from export.flat_activations import flatten_activation_linears
from export.fused_gelu import fuse_gelus
from export.fused_norm import fuse_norms
from export.fused_projections import fuse_projections
from export.graph_edits import merge_repeats
from export.graphs import inductor_freezing
from serve import encoder_attention

NORM = "compress_encoder.add_layer_norm.default"
GELU = "compress_encoder.gelu_quantize.default"


def _compiled(program: torch.export.ExportedProgram, path: Path):
    with inductor_freezing(True), torch.no_grad():
        return torch._inductor.aoti_load_package(
            torch._inductor.aoti_compile_and_package(program, package_path=str(path)))


def _same_answers(compiled, converted: torch.nn.Module, features: int) -> None:
    for shape in [(3, 7, features), (1, 40, features)]:  # not the traced batch and length
        sample = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():  # a copy: Inductor's int8 GEMM may add its residual in place,
            # into the buffer of an input it reads last (a block whose residual is the input)
            got, want = compiled(sample.clone()), converted(sample)
        assert got.shape == shape and relative(got, want) < 1e-2


def test_the_norm_kernel_matches_aten_and_quantizes_as_pt2e() -> None:
    assert encoder_attention.load(), encoder_attention.error()
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the q/dq ops)

    kernel = torch.ops.compress_encoder.add_layer_norm
    generator = torch.Generator().manual_seed(0)
    for shape in [(8, 128, 384), (3, 5, 100)]:  # a vector width and a tail
        x, residual = (torch.randn(*shape, generator=generator) * 3 for _ in range(2))
        weight, bias = (torch.randn(shape[-1], generator=generator) for _ in range(2))
        smooth = torch.rand(shape[-1], generator=generator) + 0.5
        for res, by in ((residual, None), (None, None), (residual, smooth)):
            out, quantized = kernel(x, res, weight, bias, 1e-12, by, 0.0578, 116, 0, 255)
            want = F.layer_norm(x if res is None else x + res, shape[-1:], weight, bias, 1e-12)
            assert (out - want).abs().max() < 1e-4  # the float answer is never multiplied
            want_q = torch.ops.quantized_decomposed.quantize_per_tensor(
                want if by is None else want * by, 0.0578, 116, 0, 255, torch.uint8)
            assert quantized.dtype == torch.uint8 and quantized.shape == shape
            assert (quantized.int() - want_q.int()).abs().max() <= 1
            assert (quantized != want_q).float().mean() < 1e-3


class _Block(torch.nn.Module):
    """A norm without an add (an encoder's embeddings), then a post-norm residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm = torch.nn.LayerNorm(64), torch.nn.LayerNorm(64)
        self.proj, self.out = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(self.first(x), 0.1, training=False)
        hidden = self.norm(self.proj(hidden) + hidden)
        return self.out(hidden) + hidden


@needs_vnni
def test_add_norm_and_quantize_run_on_the_kernel(tmp_path: Path) -> None:
    assert encoder_attention.load(), encoder_attention.error()
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(x, _Block())
    assert fuse_norms(program) == 2
    calls = [n for n in program.graph.nodes if str(n.target) == NORM]
    assert [c.args[1] is None for c in calls] == [True, False]  # the block's add folded in
    targets = {str(n.target) for n in program.graph.nodes}
    assert "aten.layer_norm.default" not in targets and "aten.dropout.default" not in targets
    assert fuse_norms(program) == 0
    _same_answers(_compiled(program, tmp_path / "norm.pt2"), converted, 64)


class _Projections(torch.nn.Module):
    """Query, key and value of one input, of two widths."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.value = torch.nn.Linear(64, 32)
        self.out = torch.nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (self.query(x) * self.key(x)).sum(-1, keepdim=True).softmax(1)
        return self.out(scores * self.value(x))


@needs_vnni
def test_linears_of_one_input_become_one_int8_gemm(tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(x, _Projections())
    def linears() -> list[torch.fx.Node]:
        return [n for n in program.graph.nodes if n.target == torch.ops.aten.linear.default]

    assert len(linears()) == 4
    assert fuse_projections(program) == 2
    merged = linears()
    assert len(merged) == 2 and merged[0].meta["val"].shape[-1] == 160  # 64 + 64 + 32
    assert fuse_projections(program) == 0
    counters.clear()
    compiled = _compiled(program, tmp_path / "qkv.pt2")
    assert counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 2  # both int8
    _same_answers(compiled, converted, 64)


def test_linears_of_different_inputs_are_left_apart() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, _ = int8_program(x, model)
    assert fuse_projections(program) == 0


class _SmoothedBlock(torch.nn.Module):
    """A post-norm block after SmoothQuant: three Linears reading the norm's output, each
    multiplying it by the same scale (compress/algorithms/smoothing.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        scale = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5
        self.query, self.key, self.value = (
            SmoothedLinear(torch.nn.Linear(64, 64), scale) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(x + 1.0)
        return self.query(hidden) * self.key(hidden) + self.value(hidden) + hidden


@needs_vnni
def test_smoothquant_multiplies_are_merged_and_fused(tmp_path: Path) -> None:
    assert encoder_attention.load(), encoder_attention.error()
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(x, _SmoothedBlock())
    graph = program.graph_module.graph
    assert merge_repeats(graph) == 4  # two of the three multiplies, two of the quantizes
    program.graph_module.recompile()
    assert fuse_projections(program) == 2
    assert fuse_norms(program) == 1
    (call,) = [n for n in program.graph.nodes if str(n.target) == NORM]
    assert call.args[5] is not None  # the scale, applied by the kernel to the quantized copy
    assert not any(n.target == torch.ops.aten.mul.Tensor  # no multiply left before a quantize
                   and any("quantize_per_tensor" in str(u.target) for u in n.users)
                   for n in program.graph.nodes)
    _same_answers(_compiled(program, tmp_path / "smoothed.pt2"), converted, 64)


def test_the_gelu_kernel_quantizes_as_pt2e() -> None:
    assert encoder_attention.load(), encoder_attention.error()
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the q/dq ops)

    kernel = torch.ops.compress_encoder.gelu_quantize
    generator = torch.Generator().manual_seed(0)
    for shape in [(1024, 1536), (3, 5, 100)]:  # a layer at 8 x 128, and a vector tail
        x = torch.randn(*shape, generator=generator) * 3  # past erf's clamp at |x| > 5.7
        smooth = torch.rand(shape[-1], generator=generator) + 0.5
        for by, scale, zero_point in ((smooth, 0.0231, 60), (None, 0.0952, 2)):
            got = kernel(x, by, scale, zero_point, 0, 255)
            gelu = F.gelu(x) if by is None else F.gelu(x) * by
            want = torch.ops.quantized_decomposed.quantize_per_tensor(
                gelu, scale, zero_point, 0, 255, torch.uint8)
            assert got.dtype == torch.uint8 and got.shape == shape
            assert (got.int() - want.int()).abs().max() <= 1
            assert (got != want).float().mean() < 1e-3  # a level off where GELU sits on a step


class _SmoothedFeedForward(torch.nn.Module):
    """An encoder's feed-forward after SmoothQuant: GELU, then the second Linear's multiply."""

    def __init__(self, smoothed: bool) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        down = torch.nn.Linear(256, 64)
        scale = torch.rand(256, generator=torch.Generator().manual_seed(4)) + 0.5
        self.down = SmoothedLinear(down, scale) if smoothed else down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) + x


@needs_vnni
def test_gelu_multiply_and_quantize_run_on_the_kernel(tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    assert encoder_attention.load(), encoder_attention.error()
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(x, _SmoothedFeedForward(smoothed=True))
    assert flatten_activation_linears(program) == 1  # as the export runs it: on 2-D first
    assert fuse_gelus(program) == 1
    targets = [str(n.target) for n in program.graph.nodes]
    assert targets.count(GELU) == 1 and "aten.gelu.default" not in targets
    assert not any(n.target == torch.ops.aten.mul.Tensor for n in program.graph.nodes)
    assert fuse_gelus(program) == 0
    counters.clear()
    compiled = _compiled(program, tmp_path / "gelu.pt2")
    assert counters["inductor"]["qlinear_weight_prepack_matcher_count"] == 2  # both int8
    _same_answers(compiled, converted, 64)


def test_a_gelu_without_a_multiply_is_left_to_inductor() -> None:
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, _ = int8_program(x, _SmoothedFeedForward(smoothed=False))
    assert fuse_gelus(program) == 0  # Inductor folds its GELU and quantize into the GEMM
    assert "aten.gelu.default" in {str(n.target) for n in program.graph.nodes}
