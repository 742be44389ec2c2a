"""Models as graphs of positional tensors: the shared ground of torch.export, PT2E
quantization and every export format (no torchao import here).

Text models take (input_ids, attention_mask, token_type_ids) and return logits; image
models take one tensor. `positional_inputs` turns the keyword call the rest of compress
makes (`model(**tokenizer_output)`) into that positional form. A model comes as any object
with the fields of `Bundle`.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
from torch import nn

from export.errors import CaptureError, one_line


class Bundle(Protocol):
    """What the formats read of a model (compress's `ModelBundle` is one)."""

    model: nn.Module
    kind: str
    label_names: list[str]
    tokenizer: Any
    input_shape: list[int]

    @property
    def is_text(self) -> bool: ...


TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EXPORT_BATCH, EXPORT_SEQ = 3, 16  # distinct sizes above 1, so no dim is specialised or tied
MAX_BATCH = 4096


class TextLogits(nn.Module):
    """A text model as a graph of positional tensors returning one tensor: a Hugging Face
    classifier's logits, or the output of a model that returns a tensor (an embedding)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.takes_token_types = "token_type_ids" in inspect.signature(model.forward).parameters

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        extra = {"token_type_ids": token_type_ids} if self.takes_token_types else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        return out if isinstance(out, torch.Tensor) else out.logits


def output_name(bundle: Bundle) -> str:
    """The name of the graph's one output: the model's `output_name` ("embedding"), else
    "logits"."""
    return getattr(bundle.model, "output_name", "logits")


def positional_inputs(text: bool, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
    """The graph's positional tensors for `model(x)` or `model(**tokenizer_output)`;
    a missing attention mask is all ones and missing token types all zeros."""
    if not text:
        return (args[0] if args else next(iter(kwargs.values())),)
    ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    mask = kwargs.get("attention_mask")
    types = kwargs.get("token_type_ids")
    return (ids, torch.ones_like(ids) if mask is None else mask,
            torch.zeros_like(ids) if types is None else types)


def graph_module(bundle: Bundle) -> nn.Module:
    """The bundle's model as a positional-tensor module (HF models wrapped in TextLogits)."""
    return TextLogits(bundle.model) if bundle.is_text else bundle.model


def export_inputs(bundle: Bundle) -> tuple[torch.Tensor, ...]:
    """Example inputs of an export: batch 3, sequence 16 for text."""
    inputs = example_inputs(bundle.tokenizer, bundle.input_shape, EXPORT_BATCH, EXPORT_SEQ)
    if bundle.is_text:
        return tuple(inputs[name] for name in TEXT_INPUTS)
    return (inputs,)


def dynamic_shapes(text: bool, max_seq: int) -> tuple[dict[int, Any], ...]:
    """Batch dynamic everywhere; the sequence too for text (from 2 to `max_seq`)."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    if not text:
        return ({0: batch},)
    seq = torch.export.Dim("seq", min=2, max=max_seq)
    return tuple({0: batch, 1: seq} for _ in TEXT_INPUTS)


def max_sequence(model: nn.Module) -> int:
    """The longest sequence the model embeds (its position table), 512 when unknown."""
    config = getattr(model, "config", None)
    return int(getattr(config, "max_position_embeddings", None) or 512)


def export_graph(module: nn.Module, args: tuple[torch.Tensor, ...], text: bool, max_seq: int
                 ) -> torch.export.ExportedProgram:
    """`torch.export` with dynamic dims; a failure becomes a one-line CaptureError."""
    try:
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes(text, max_seq))
    except Exception as exc:  # any capture failure: user code, guards, unsupported ops
        raise CaptureError(f"torch.export could not capture the model: {one_line(exc)}"
                           ) from None


def traced_inputs(bundle: Bundle) -> tuple[torch.Tensor, ...]:
    """`export_inputs` with padding in the first row, so a tracer records the masking path
    (an all-ones example lets attention skip the mask, which tracing would bake in)."""
    args = export_inputs(bundle)
    if bundle.is_text:
        args[1][0, EXPORT_SEQ // 2:] = 0
    return args


def inductor_freezing(enabled: bool = True):
    """Inductor's freezing switched on for the block only. It is read when Inductor
    compiles, which torch.compile does lazily at a call (and again at a recompile), so
    compiled models enter it around each call (a config patch: microseconds). A backend
    that patched it only around compile_fx broke freezing of int8 convolutions
    (onednn.qconv_prepack under fake tensors), and `torch.compile(options=...)` does not
    reach the freezing pass."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=enabled)


def example_inputs(tokenizer, input_shape: list[int], batch: int, seq_len: int) -> Any:
    """Inputs of one batch for timing: full-length token ids for text, random tensors else."""
    generator = torch.Generator().manual_seed(0)
    if tokenizer is None:
        return torch.rand(batch, *input_shape, generator=generator)
    low = max(tokenizer.all_special_ids, default=0) + 1
    ids = torch.randint(low, tokenizer.vocab_size, (batch, seq_len), generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
    }
