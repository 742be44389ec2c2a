"""A causal-LM folder loaded and decoded with torch, transformers and torchao only (part of
the `causal_lm.runtime` package every causal-LM export and its TorchServe archive ship: it
imports nothing from compress). A folder, as
`compress.families.causal_lm.folder.save_causal_lm` writes it: a Hugging Face config and
tokenizer, `model.safetensors` (float) or `model.pt` (a torchao-quantized state dict, loaded
into the architecture after the same `quantize_` config), and `causal_lm.json`.

`int8_grouped` and `int4_grouped` weights are `grouped.py`'s modules (float32 activations,
with `kernels.py`'s operator), beside it too, and a mixture-of-experts model's
experts `experts.py`'s (the routers stay float); `int8_sparse24` and `int4_sparse24`
weights (2:4 sparse) are `sparse24.py`'s.

Decoding lives beside it in `decode.py` (`StaticDecoder`, `Sampling`, `Generation`), whose
names this module re-exports. From a shell:

    cd FOLDER && python -m causal_lm.runtime . "What is the capital of France?" \
        --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .decode import Generation, OnTokens, Sampling, StaticDecoder, left_pad
from .experts import is_experts, quantize_experts
from .fused import fuse_projections
from .grouped import BITS as GROUPED_BITS
from .grouped import GroupedLinear, quantize_embedding, quantize_grouped
from .sparse24 import BITS as SPARSE24_BITS
from .sparse24 import quantize_sparse24

__all__ = ["CAUSAL_LM_FILE", "DTYPES", "SCHEMES", "Generation", "LoadedCausalLM", "OnTokens",
           "Sampling", "StaticDecoder", "head_scheme_of", "left_pad", "load_folder", "prompt_ids",
           "quantize_weights", "stop_ids", "untie_head", "weight_config"]

CAUSAL_LM_FILE = "causal_lm.json"
SCHEMES = ("int8_weight_only", "int4_weight_only", "int8_dynamic", *GROUPED_BITS,
           *SPARSE24_BITS)
KERNEL_SCHEMES = (*GROUPED_BITS, *SPARSE24_BITS)  # compress's own kernels, float32 activations
PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # `load_tokenizer`
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedCausalLM:
    """A causal LM read from a folder, with its tokenizer and `causal_lm.json`."""

    model: nn.Module
    tokenizer: Any
    facts: dict[str, Any]
    released: int = 0  # grouped modules that keep their kernel records alone (`held_once`)


def weight_config(scheme: str, group_size: int = 32) -> Any:
    """torchao's `quantize_` config of a weight scheme: int8_weight_only (int8 weights per
    channel, float activations), int4_weight_only (int4 weights in groups of `group_size`,
    torchao's CPU packing for aten's `_weight_int4pack_mm_for_cpu`) or int8_dynamic (int8
    weights and per-token int8 activations)."""
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )

    if scheme == "int4_weight_only":
        from torchao.prototype.quantization.int4.inference_workflow import (
            PrototypeInt4WeightOnlyConfig,
        )

        return PrototypeInt4WeightOnlyConfig(group_size=group_size)
    if scheme == "int8_weight_only":
        return Int8WeightOnlyConfig()
    if scheme == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    raise ValueError(f"scheme {scheme!r} has no torchao config (those with one: "
                     f"{', '.join(x for x in SCHEMES if x not in KERNEL_SCHEMES)})")


def head_scheme_of(scheme: str, head_scheme: str | None = None) -> str:
    """The scheme of the output projection: `head_scheme` when given and not "auto", else
    int8 under int4 (the tied head of a small LM is the layer int4 hurts most, as llama.cpp's
    Q4 files keep theirs at 6-8 bits: int8 weight-only under torchao's int4, int8_grouped
    under int4_grouped), int8_grouped under the 2:4 schemes (a head is not pruned) and
    `scheme` otherwise."""
    if head_scheme and head_scheme != "auto":
        return head_scheme
    return {"int4_weight_only": "int8_weight_only",
            "int4_grouped": "int8_grouped", "int8_sparse24": "int8_grouped",
            "int4_sparse24": "int8_grouped"}.get(scheme, scheme)


def untie_head(model: nn.Module) -> nn.Module | None:
    """The output projection, given its own weight when it shares the embedding's."""
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(),
                                   requires_grad=head.weight.requires_grad)
    return head


def quantize_weights(model: nn.Module, scheme: str, group_size: int = 32,
                     head_scheme: str | None = None, fit: bool = True,
                     activations: str = "float32", grid: str = "free") -> nn.Module:
    """Apply a weight scheme to every Linear of `model` (and, grouped schemes only, to every
    mixture-of-experts layer's experts: `experts.py`; other schemes refuse such a model) in
    place and `head_scheme_of` to the
    output projection (untied from the embedding first, which stays in float, except under
    the grouped and 2:4 schemes, which store it as int8 groups too; a 2:4 scheme refuses a
    Linear that is not 2:4 with `sparse24.NotSparse24Error`). `fit=False`, grouped schemes:
    modules of the right shapes only, their weights loaded next (`load_folder`).
    `activations`: the grouped schemes' mode, float32 or the opt-in int8 or bf16
    (`grouped.GroupedLinear`); `grid`: the grouped schemes' (`grouped.fit_groups`).
    Fitted grouped weights get their blocks' projections fused (`fused.py`)."""
    if scheme not in GROUPED_BITS and any(is_experts(m) for m in model.modules()):
        raise ValueError(f"scheme {scheme!r} cannot quantize a mixture-of-experts model's "
                         f"3D expert weights; use {' or '.join(GROUPED_BITS)}")
    head = untie_head(model)
    _apply(model, scheme, group_size, head=False, fit=fit, activations=activations, grid=grid)
    if scheme in KERNEL_SCHEMES:  # its float32 activations leave a float32 table otherwise
        quantize_embedding(model, group_size, fit, grid)
    head_scheme = head_scheme_of(scheme, head_scheme)
    if head is not None and head_scheme != "float":
        _apply(model, head_scheme, group_size, head=True, fit=fit, activations=activations,
               grid=grid)
    if fit and scheme in KERNEL_SCHEMES:  # else once the weights are loaded (`load_folder`)
        fuse_projections(model)
    return model


def _apply(model: nn.Module, scheme: str, group_size: int, head: bool,
           fit: bool = True, activations: str = "float32", grid: str = "free") -> None:
    """`scheme` on the output projection (`head`) or on every other Linear."""
    def chosen(module: nn.Module, name: str) -> bool:
        return (name == "lm_head") if head else (isinstance(module, nn.Linear)
                                                 and name != "lm_head")

    if scheme in GROUPED_BITS:
        quantize_grouped(model, group_size, chosen, GROUPED_BITS[scheme], fit, activations,
                         grid)
        if not head:  # a mixture of experts' 3D expert weights, per expert
            quantize_experts(model, GROUPED_BITS[scheme], fit, group_size, activations)
        return
    if scheme in SPARSE24_BITS:
        quantize_sparse24(model, chosen, SPARSE24_BITS[scheme], fit)
        return
    from torchao.quantization import quantize_

    quantize_(model, weight_config(scheme, group_size), filter_fn=chosen)


def needs_torchao(folder: str | Path) -> bool:
    """Whether the folder's weights are torchao's (its scheme one of torchao's configs)."""
    facts = json.loads((Path(folder) / CAUSAL_LM_FILE).read_text())
    return bool(facts.get("scheme")) and facts["scheme"] not in KERNEL_SCHEMES


def load_folder(folder: str | Path, held_once: bool = False) -> LoadedCausalLM:
    """The model, tokenizer and facts of a causal-LM folder, in eval mode. `held_once` (a
    served worker of one process): each grouped module keeps its kernel records alone,
    its codes, scales and offsets dropped as it loads (`load_releasing`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    facts = json.loads((folder / CAUSAL_LM_FILE).read_text())
    dtype = DTYPES[facts.get("dtype") or "float32"]
    tokenizer = load_tokenizer(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not facts.get("scheme"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    else:
        with _no_init():  # every weight comes from model.pt
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                     dtype=dtype)
        quantize_weights(model, facts["scheme"], facts.get("group_size") or 32,
                         facts.get("head_scheme") or facts["scheme"], fit=False,
                         activations=facts.get("activations") or "float32")
        # read, not mapped: a mapping's pages stay resident while any tensor of the file
        # lives (the embedding's codes, bound into the AOTI steps), sources dropped or not
        state = torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
        released = load_releasing(model, state) if held_once else 0
        model.load_state_dict(state, assign=True, strict=not held_once)
        if facts["scheme"] in KERNEL_SCHEMES:  # a 2:4 model: its grouped head's alone
            fuse_projections(model)
        if (folder / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(folder)
        return LoadedCausalLM(model.eval(), tokenizer, facts, released)
    return LoadedCausalLM(model.eval(), tokenizer, facts)


def load_releasing(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Load `state` into `model`'s grouped modules one at a time, each dropping its codes,
    scales and offsets once its kernel records are packed (`GroupedLinear.release_sources`)
    and taking its entries out of `state`, whose other entries the caller loads next; how
    many modules hold their records alone. The file's copy of a weight is freed as its
    records are made, so the next module's records reuse its memory: a worker's start
    peaks about one weight copy lower than loading every record beside the whole file.
    Raises as a strict `load_state_dict` does where `state` names other tensors than the
    model's."""
    wanted = set(model.state_dict())  # the unwritten tensors' names: no copy is made
    if wanted != set(state):
        missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
        raise RuntimeError(f"the state dict does not fit the model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    released = 0
    for name, module in model.named_modules():
        if not isinstance(module, GroupedLinear):
            continue
        prefix = f"{name}."
        own = [key for key in state if key.startswith(prefix) and "." not in key[len(prefix):]]
        module.load_state_dict({key[len(prefix):]: state.pop(key) for key in own}, assign=True)
        released += module.release_sources()
    return released


def load_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer. One whose class is the plain `tokenizers` backend (what the
    export writes) is built by that class itself: AutoTokenizer resolves to the same class
    but first imports some 700 modules (torch.distributed, sympy, accelerate), 2.3 s and
    ~50 MB more in a worker (`benchmarks/results/worker_memory_zen1.md`)."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if config.get("tokenizer_class") in PLAIN_TOKENIZERS and \
            (folder / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _no_init() -> Any:
    """transformers' context that skips the random init of weights loaded next (a no-op
    where this transformers lacks it)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def stop_ids(model: nn.Module, tokenizer: Any) -> set[int]:
    """End-of-sequence token ids: the generation config's and the tokenizer's."""
    found: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        found.update([value] if isinstance(value, int) else value or [])
    return found


def prompt_ids(tokenizer: Any, prompt: str | list[dict[str, str]],
               chat_template: bool = True) -> list[int]:
    """Token ids of a prompt (a string or chat messages), through the tokenizer's chat
    template when asked and it has one (else the messages' contents, one a line)."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}] if chat_template else prompt
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                return_dict=True)["input_ids"]
            return [int(i) for i in ids]
        prompt = "\n".join(m["content"] for m in prompt)
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def main(argv: list[str] | None = None) -> None:
    """Print the text a causal-LM folder generates after a prompt."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--compile", choices=["none", "default", "max-autotune"],
                        default="none")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="the prompt as plain text, not through the tokenizer's chat template")
    args = parser.parse_args(argv)
    lm = load_folder(args.folder)
    ids = prompt_ids(lm.tokenizer, args.prompt, not args.no_chat_template)
    decoder = StaticDecoder(lm.model, max(512, len(ids) + args.max_new_tokens))
    if args.compile != "none":
        decoder.compile(args.compile)
    out = decoder.generate([ids], args.max_new_tokens, stop_ids(lm.model, lm.tokenizer),
                           [Sampling(args.temperature)])
    print(lm.tokenizer.decode(out.tokens, skip_special_tokens=True))
