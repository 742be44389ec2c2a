"""Stage `quantize` on a causal LM: a torchao weight scheme on every Linear (the output
projection by `head_scheme`), activations in bfloat16 where the CPU computes it natively.
`mode: qat` first trains the weights on the scheme's grid
(`compress.families.causal_lm.algorithms.qat`) against the entering model's next-token
distributions (KL at temperature 1, no label loss: the target is the float model, not the train
text). `equalize` first scales the Linears' input channels by their activations
(`compress.families.causal_lm.algorithms.equalize`), folded into the float weights."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

from compress.errors import CompressError
from compress.families.causal_lm.algorithms import equalize, qat
from compress.families.causal_lm.algorithms.distill import (
    make_causal_lm_kd_loss_fn,
    packed_examples,
)
from compress.families.causal_lm.model import quantize_weights
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.quantize import QuantizeConfig
from compress.stages.context import StageContext, State
from serve import cpu_features
from serve.causal_lm.runtime.loading import DTYPES, head_scheme_of

# the grouped schemes' modes whose kernels round float32 activations (`rounding_of`)
ROUNDED = ("int8", "bf16", "int8_where_vnni")


def activation_dtype(choice: str, scheme: str = "int8_weight_only") -> str:
    """The activation dtype of `choice` on this machine. auto: bfloat16 for the weight-only
    schemes on any CPU (Inductor turns an int8 weight-only linear into its int8 GEMV only
    with bfloat16 inputs: compiled SmolLM2 int8 decode ran 92 tok/s with bf16 activations
    and 41 with float32 ones on an AVX2-only EPYC; the int4 kernels are several times
    faster with bf16 inputs too), and for int8_dynamic only where the CPU computes bf16
    natively (AVX512-BF16 or AMX); the grouped schemes float32 (their int8 and bf16 modes
    keep float32 tensors: the kernels round the activations, see `run`)."""
    if scheme in ("int8_grouped", "int4_grouped", "int8_sparse24", "int4_sparse24"):
        return "float32" if choice == "auto" or choice in ROUNDED else choice
    if choice != "auto":
        return choice
    from compress.runfolder.files import bf16_supported

    weight_only = scheme in ("int8_weight_only", "int4_weight_only")
    return "bfloat16" if weight_only or bf16_supported() else "float32"


def rounding_of(choice: str) -> str | None:
    """The rounding the grouped schemes' kernels give float32 activations under `choice`
    on this machine: "int8" or "bf16", or None (exact float32). int8_where_vnni is int8
    where this CPU multiplies u8 by s8 into int32 in one instruction
    (serve.cpu_features.int32_dot_products: 1.9x the float32 products of an 8-row step on
    an Emerald Rapids), exact float32 elsewhere (on AVX2 alone the int8 products run
    0.86-1.24x the float32 ones: not worth their rounding)."""
    if choice == "int8_where_vnni":
        return "int8" if cpu_features.int32_dot_products() else None
    return choice if choice in ("int8", "bf16") else None


def run(state: State, cfg: QuantizeConfig, ctx: StageContext) -> State:
    """Quantize the current causal LM's weights, save it, record the scheme and timing."""
    source = state.bundle
    dtype = activation_dtype(cfg.activations, cfg.scheme)
    began = time.perf_counter()
    model = source.model
    head = head_scheme_of(cfg.scheme, cfg.head_scheme)
    if cfg.equalize:
        ctx.metrics.update(equalize_on_train_text(model, source.tokenizer, cfg, ctx))
    if cfg.mode == "qat":
        train_on_grid(model, source.tokenizer, cfg, head, ctx)
    for parameter in model.parameters():  # buffers (rotary inv_freq) stay float32, as in a
        parameter.data = parameter.data.to(DTYPES[dtype])  # model loaded in that dtype
    # the grouped schemes' opt-in modes: the kernels round float32 activations
    rounded = rounding_of(cfg.activations)
    try:
        quantize_weights(model, cfg.scheme, cfg.group_size, head,
                         activations=rounded or "float32", grid=cfg.grid)
    except ValueError as exc:  # a group size that does not divide a Linear's inputs, or
        # a Linear that is not 2:4 under a 2:4 scheme
        raise CompressError(f"{exc}") from None
    facts = {**(source.causal_lm_facts or {}), "scheme": cfg.scheme, "dtype": dtype,
             "group_size": cfg.group_size, "head_scheme": head, "grid": cfg.grid}
    if rounded:
        facts["activations"] = rounded
    bundle = ModelBundle(model.eval(), "causal-lm", [], tokenizer=source.tokenizer,
                         causal_lm_facts=facts)
    ctx.metrics.update({"scheme": cfg.scheme, "head_scheme": head,
                        "activation_dtype": rounded or dtype,
                        "quantize_s": round(time.perf_counter() - began, 2)})
    ctx.save_model(bundle)
    return State(bundle)


def train_on_grid(model: nn.Module, tokenizer: Any, cfg: QuantizeConfig, head: str,
                  ctx: StageContext) -> None:
    """Quantization-aware training in place: fake-quantized weights, KL against a frozen
    copy of the entering model, then the weights snapped onto the grid. Records how far the
    weights moved (`qat_weight_change`, relative) and the KL to the float model on the first
    batch of train blocks with the weights on the grid, untrained (`qat_loss_before_training`,
    the no-training control) and trained (`qat_loss_after_training`)."""
    teacher = copy.deepcopy(model)
    prepared = qat.prepare(model, cfg.scheme, cfg.group_size, head)
    setup = ctx.training()
    setup.examples = packed_examples(tokenizer, setup.examples.texts, ctx.data.max_length)
    loss_fn = make_causal_lm_kd_loss_fn(teacher, 1.0, 0.0)
    probe = setup.examples.inputs[:cfg.qat.batch_size]
    before = kl_on(model, probe, loss_fn)
    result = setup.run(model, cfg.qat, None, loss_fn=loss_fn)
    after = kl_on(model, probe, loss_fn)
    moved = qat.weight_change(model, teacher)
    qat.snap(model.eval())
    ctx.metrics.update({"qat_linears": prepared, "train_blocks": len(setup.examples),
                        "qat_weight_change": round(moved, 8),
                        "qat_loss_before_training": before, "qat_loss_after_training": after,
                        **result.figures()})


@torch.no_grad()
def kl_on(model: nn.Module, blocks: torch.Tensor, loss_fn: Any) -> float:
    """`loss_fn` (the KL to the float model) of `model` in eval mode on `blocks`."""
    model.eval()
    return float(f"{float(loss_fn(model, blocks, None)):.6g}")


EQUALIZE_BLOCKS = 32  # calibration blocks of data.max_length train tokens
EQUALIZE_TEXTS = 4000  # train texts packed for them (SST-2: about 300 blocks of 128)


def equalize_on_train_text(model: nn.Module, tokenizer: Any, cfg: QuantizeConfig,
                           ctx: StageContext) -> dict[str, Any]:
    """Activation-aware scaling of `model` in place, calibrated on packed train text."""
    texts = ctx.data.splits["train"].texts[:EQUALIZE_TEXTS]
    blocks = packed_examples(tokenizer, texts, ctx.data.max_length).inputs[:EQUALIZE_BLOCKS]
    began = time.perf_counter()
    figures = equalize.equalize(model, blocks.split(4), cfg.scheme, cfg.group_size)
    ctx.log(f"equalize: {figures['equalized_pairs']} of {figures['equalize_pairs_seen']} "
            f"input groups scaled; {cfg.scheme} output error on {len(blocks)} train blocks "
            f"{figures['equalize_error_ratio']}x that of plain rounding")
    return {**figures, "equalize_s": round(time.perf_counter() - began, 2)}
