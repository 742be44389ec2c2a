"""Issue 44 item 5: the two passes the AOTInductor export runs on an int8 encoder's graph:
the key-padding mask read from `attention_mask` (export/padding_mask.py), and 3-D
`linear -> gelu -> quantize` chains put on (tokens, features) so that Inductor fuses GELU
and the quantize into the int8 GEMM (export/flat_activations.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import needs_vnni
from test_encoder_attention import TOLERANCE, relative, tiny_encoder

from compress.algorithms.smoothing import SmoothedLinear
from export.attention_kernel import use_attention_kernel
from export.flat_activations import flatten_activation_linears
from export.graphs import TextLogits, export_graph, inductor_freezing, traced_inputs
from serve import encoder_attention

KERNEL = "compress_encoder.attention.default"


def _kernel_masks(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n.args[3] for n in program.graph.nodes if str(n.target) == KERNEL]


def test_an_encoder_mask_becomes_a_view_of_attention_mask_and_answers_stay() -> None:
    bundle = tiny_encoder(Path())
    program = export_graph(TextLogits(bundle.model), traced_inputs(bundle), True, 128)
    def mask_ops() -> int:  # transformers builds the full mask from aranges and an index
        return sum(1 for n in program.graph.nodes if "arange" in str(n.target)
                   or "bitwise_and" in str(n.target))

    before = mask_ops()
    assert use_attention_kernel(program) == 1
    (mask,) = _kernel_masks(program)
    # (batch, 1, 1, length) of attention_mask != 0: unsqueeze(unsqueeze(ne(input)))
    assert mask.target == torch.ops.aten.unsqueeze.default
    source = mask.args[0].args[0]
    assert source.target == torch.ops.aten.ne.Scalar and source.args[0].name == "attention_mask"
    assert tuple(mask.meta["val"].shape[1:]) == (1, 1, mask.meta["val"].shape[3])
    assert mask_ops() < before  # the full mask's nodes went
    ids = torch.randint(1000, 20000, (4, 11), generator=torch.Generator().manual_seed(1))
    padded = torch.ones_like(ids)
    padded[1, 6:], padded[2, 2:], padded[3, 1:] = 0, 0, 0
    with torch.inference_mode():
        want = bundle.model(ids, padded, token_type_ids=torch.zeros_like(ids)).logits
        got = program.module()(ids, padded, torch.zeros_like(ids))
    assert relative(got, want) < TOLERANCE


class _QueryLimited(torch.nn.Module):
    """Attention whose mask also depends on the query row: not a key-padding mask."""

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = x.view(batch, length, 2, 16).transpose(1, 2)
        rows = torch.arange(length)
        mask = attention_mask.bool()[:, None, None, :] & (rows[None, :] <= rows[:, None])
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_mask_that_is_not_only_padding_is_kept() -> None:
    assert encoder_attention.load(), encoder_attention.error()
    x, padded = torch.randn(2, 9, 32), torch.ones(2, 9, dtype=torch.long)
    padded[1, 5:] = 0
    program = torch.export.export(_QueryLimited(), (x, padded))
    assert use_attention_kernel(program) == 1
    (mask,) = _kernel_masks(program)
    assert mask.target != torch.ops.aten.unsqueeze.default
    with torch.inference_mode():
        want, got = _QueryLimited()(x, padded), program.module()(x, padded)
    assert relative(got, want) < TOLERANCE


class _FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def int8_program(x: torch.Tensor, model: torch.nn.Module | None = None
                  ) -> tuple[torch.export.ExportedProgram, torch.nn.Module]:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    dims = ({0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("length", max=512)},)
    torch.manual_seed(0)
    model = model or _FeedForward()
    graph = torch.export.export(model.eval(), (x,), dynamic_shapes=dims).module()
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(graph, quantizer)
    prepared(x)
    converted = convert_pt2e(prepared)
    return torch.export.export(converted, (x,), dynamic_shapes=dims), converted


@needs_vnni
def test_gelu_and_its_quantize_fuse_into_the_int8_gemm_on_dynamic_3d_inputs(
        tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    program, converted = int8_program(x)
    assert flatten_activation_linears(program) == 1
    assert flatten_activation_linears(program) == 0  # nothing left to rewrite
    counters.clear()
    with inductor_freezing(True), torch.no_grad():
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp_path / "ffn.pt2"))
    assert counters["inductor"]["qlinear_unary_matcher_count"] == 1  # GELU in the GEMM
    compiled = torch._inductor.aoti_load_package(path)
    for shape in [(3, 7, 64), (1, 40, 64)]:  # other batches and lengths than the traced
        sample = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, want = compiled(sample), converted(sample)
        assert got.shape == shape and relative(got, want) < 1e-2


class _SmoothedFeedForward(_FeedForward):
    """The feed-forward after SmoothQuant: its second Linear's input divided per channel."""

    def __init__(self) -> None:
        super().__init__()
        scale = torch.rand(256, generator=torch.Generator().manual_seed(2)) + 0.5
        self.down = SmoothedLinear(self.down, scale)


@needs_vnni
def test_gelu_fuses_into_the_int8_gemm_before_a_smoothing_multiply(tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    program, converted = int8_program(x, _SmoothedFeedForward())
    assert flatten_activation_linears(program) == 1
    counters.clear()
    with inductor_freezing(True), torch.no_grad():
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(tmp_path / "ffn.pt2"))
    # GELU in the GEMM's epilogue (float out); the multiply and quantize in a loop after
    assert counters["inductor"]["qlinear_unary_matcher_count"] == 1
    compiled = torch._inductor.aoti_load_package(path)
    sample = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = compiled(sample), converted(sample)
    assert got.shape == sample.shape and relative(got, want) < 1e-2
