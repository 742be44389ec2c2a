"""Distilling a causal LM into a layer-dropped student: text packed into blocks, the
student built by keeping some of the teacher's decoder layers, and the loss (KL between
next-token distributions at temperature T, plus the next-token cross-entropy).

The training itself is the shared loop of `compress.train.loop` (checkpoints, resume, progress,
DDP): a packed block is an example whose input is its token ids.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from compress.algorithms.distill import evenly_spaced, kd_loss
from compress.data.datasets import Examples


def pack_texts(tokenizer, texts: list[str], block: int) -> torch.Tensor:
    """The texts' tokens, each text followed by the end-of-sequence token, concatenated and
    cut into rows of `block` tokens (the remainder dropped): N x block."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    rows = len(stream) // block
    if rows == 0:
        raise ValueError(f"the train text has {len(stream)} tokens, fewer than one block of "
                         f"{block} (data.max_length)")
    return torch.tensor(stream[:rows * block]).view(rows, block)


def packed_examples(tokenizer, texts: list[str], block: int) -> Examples:
    """Packed blocks as training examples for the shared loop (labels unused)."""
    blocks = pack_texts(tokenizer, texts, block)
    return Examples(labels=[0] * len(blocks), inputs=blocks)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a Hugging Face causal LM (`model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers list to take layers from")
    return layers


def drop_layers(model: nn.Module, keep: list[int]) -> nn.Module:
    """A copy of `model` with only the decoder layers at `keep` (renumbered for the KV
    cache, the config's layer count and per-layer lists trimmed to match)."""
    total = len(decoder_layers(model))
    if not keep or max(keep) >= total or min(keep) < 0 or len(set(keep)) != len(keep):
        raise ValueError(f"cannot keep layers {keep} of a model with layers 0..{total - 1}")
    student = copy.deepcopy(model)
    kept = nn.ModuleList([decoder_layers(student)[i] for i in sorted(keep)])
    for new_index, layer in enumerate(kept):
        attention = getattr(layer, "self_attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = new_index
    student.model.layers = kept
    config = student.config
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[i] for i in sorted(keep)]
    config.num_hidden_layers = len(kept)
    for p in student.parameters():
        p.requires_grad_(True)
    return student


def kept_layers(spec, total: int) -> list[int]:
    """The teacher layers a StudentSpec keeps (`layers`: evenly spaced, first and last
    included; or `layer_indices`)."""
    if spec.layer_indices is not None:
        return sorted(spec.layer_indices)
    if spec.layers > total:
        raise ValueError(f"the student keeps {spec.layers} layers but the teacher has {total}")
    return evenly_spaced(spec.layers, total)


def make_causal_lm_kd_loss_fn(teacher: nn.Module, temperature: float, alpha: float):
    """A `loss_fn(student, ids, _)` for the shared loop: per next-token position,
    alpha * CE + (1 - alpha) * T^2 * KL(teacher || student), averaged over positions."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    def loss_fn(student: nn.Module, ids: torch.Tensor, _: Any) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids).logits[:, :-1]
        student_logits = student(input_ids=ids).logits[:, :-1]
        vocab = student_logits.shape[-1]
        return kd_loss(student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab),
                       ids[:, 1:].reshape(-1), temperature, alpha)

    return loss_fn


def causal_lm_loss(model: nn.Module, ids: torch.Tensor, _: Any) -> torch.Tensor:
    """Next-token cross-entropy of a packed block (the fine-tuning loss)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                       ids[:, 1:].reshape(-1))


def recovery(ppl_teacher: float, ppl_dropped: float, ppl_student: float) -> float | None:
    """Share of the perplexity gap that dropping layers opened which distillation closed:
    (dropped - student) / (dropped - teacher); None when dropping opened no gap."""
    gap = ppl_dropped - ppl_teacher
    return round((ppl_dropped - ppl_student) / gap, 4) if gap > 0 else None
