"""A causal-LM folder loaded and decoded with torch, transformers and torchao only (shipped
beside every causal-LM export and inside its TorchServe archive: it imports nothing from
compress). A folder, as `compress.lm_models.save_lm` writes it: a Hugging Face config and
tokenizer, `model.safetensors` (float) or `model.pt` (a torchao-quantized state dict, loaded
into the architecture after the same `quantize_` config), and `causal_lm.json`.

`StaticDecoder` decodes a batch over a static KV cache (prompts of any lengths left-padded
under an attention mask; each row stops on its own; greedy or top-p sampled) with a decode
step that compiles into one Inductor graph. From a shell:

    python lm_runtime.py FOLDER "What is the capital of France?" --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

LM_FILE = "causal_lm.json"
SCHEMES = ("int8_weight_only", "int4_weight_only", "int8_dynamic")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class LoadedLM:
    """A causal LM read from a folder, with its tokenizer and `causal_lm.json`."""

    model: nn.Module
    tokenizer: Any
    facts: dict[str, Any]


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
    raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}")


def head_scheme_of(scheme: str, head_scheme: str | None = None) -> str:
    """The scheme of the output projection: `head_scheme` when given and not "auto", else
    int8 weight-only under int4 (the tied head of a small LM is the layer int4 hurts most,
    as llama.cpp's Q4 files keep theirs at 6-8 bits) and `scheme` otherwise."""
    if head_scheme and head_scheme != "auto":
        return head_scheme
    return "int8_weight_only" if scheme == "int4_weight_only" else scheme


def untie_head(model: nn.Module) -> nn.Module | None:
    """The output projection, given its own weight when it shares the embedding's."""
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(),
                                   requires_grad=head.weight.requires_grad)
    return head


def quantize_weights(model: nn.Module, scheme: str, group_size: int = 32,
                     head_scheme: str | None = None) -> nn.Module:
    """Apply a weight scheme to every Linear of `model` in place and `head_scheme_of` to the
    output projection (untied from the embedding first, which stays in float)."""
    from torchao.quantization import quantize_

    head = untie_head(model)
    quantize_(model, weight_config(scheme, group_size),
              filter_fn=lambda module, name: isinstance(module, nn.Linear) and name != "lm_head")
    head_scheme = head_scheme_of(scheme, head_scheme)
    if head is not None and head_scheme != "float":
        quantize_(model, weight_config(head_scheme, group_size),
                  filter_fn=lambda module, name: name == "lm_head")
    return model


def load_folder(folder: str | Path) -> LoadedLM:
    """The model, tokenizer and facts of a causal-LM folder, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    facts = json.loads((folder / LM_FILE).read_text())
    dtype = DTYPES[facts.get("dtype") or "float32"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not facts.get("scheme"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
        quantize_weights(model, facts["scheme"], facts.get("group_size") or 32,
                         facts.get("head_scheme") or facts["scheme"])
        state = torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state, assign=True)
        if (folder / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(folder)
    return LoadedLM(model.eval(), tokenizer, facts)


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


@dataclass
class Sampling:
    """How one row picks its tokens: greedy at temperature 0, else top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Generation:
    """The tokens of a batch and how long they took."""

    tokens: list[int]  # the first row's
    ttft_s: float  # prefill: the prompts in, the first tokens out
    decode_tokens_per_s: float  # the tokens after each row's first, every row counted
    rows: list[list[int]] = field(default_factory=list)  # every row's tokens
    finish: list[str] = field(default_factory=list)  # per row: "stop" or "length"


# on_tokens(the token each row just produced, None for rows already finished) -> rows to
# finish now (a stop string seen, a client gone)
OnTokens = Callable[[list[int | None]], Iterable[int] | None]


def left_pad(prompts: torch.Tensor | Sequence[Sequence[int]], pad_id: int = 0,
             always_mask: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(B x L ids, B x L mask, or None when no row is padded unless `always_mask`, pads
    per row)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    length = max(len(p) for p in prompts)
    pads = torch.tensor([length - len(p) for p in prompts])
    ids = torch.tensor([[pad_id] * (length - len(p)) + list(p) for p in prompts])
    if not int(pads.max()) and not always_mask:
        return ids, None, pads
    return ids, (torch.arange(length) >= pads[:, None]).long(), pads


class StaticDecoder:
    """Decoding over a `StaticCache` of `max_cache_len` positions. The decode step (one
    token per row in, next-token logits out) keeps its shapes from call to call, so
    `compile(mode)` turns it into one Inductor graph; the prefill stays eager. A decoder
    keeps the batch size of its first call (a new size allocates a new cache). With
    `always_mask`, batches with no padded row pass an attention mask too, so a compiled
    step has one graph for both."""

    def __init__(self, model: nn.Module, max_cache_len: int = 512, always_mask: bool = False):
        self.model, self.max_cache_len, self.always_mask = model, max_cache_len, always_mask
        self.cache: Any = None
        self.cache_rows = 0
        self.step: Callable[..., torch.Tensor] = self._forward
        self.compiled = False
        self.inductor: dict[str, Any] = {}  # Inductor settings while the step compiles

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor,
                 position_ids: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=ids, cache_position=positions, position_ids=position_ids,
                         attention_mask=mask, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def compile(self, mode: str = "default") -> StaticDecoder:
        """Run the decode step through torch.compile (fullgraph, Inductor freezing, and
        max-autotune's C++ GEMM templates when `mode` is `max-autotune`) from now on.

        The Inductor settings are set around each call of the step, where it compiles:
        passed as torch.compile `options`, max-autotune was not applied (no template was
        tried; measured). Graphs Dynamo holds from earlier decoders are dropped first
        (`torch._dynamo.reset`): on SmolLM2, a decoder reusing the graph of another
        decoder of the same model gave other tokens and once an out-of-bounds cache index.
        An earlier decoder still in use compiles again on its next call."""
        torch._dynamo.reset()
        self.inductor = {"freezing": True, "max_autotune": mode == "max-autotune"}
        self.step = torch.compile(self._forward, fullgraph=True)
        self.compiled = True
        return self

    def _fresh_cache(self, rows: int) -> None:
        if self.cache is None or rows != self.cache_rows:
            from transformers import StaticCache

            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
            self.cache_rows = rows
        else:
            self.cache.reset()

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor | Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int], stop: set[int] | None = None,
                 sampling: Sequence[Sampling | None] | None = None,
                 on_tokens: OnTokens | None = None) -> Generation:
        """Tokens after each prompt (a B x L tensor, or lists of ids of any lengths, left
        padded here), at most `max_new_tokens` (one limit, or one per row). A row ends at a
        token of `stop` (kept in its tokens), at its limit, or when `on_tokens` says so."""
        ids, mask, pads = left_pad(prompt, always_mask=self.always_mask)
        rows, length = ids.shape
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [
            max_new_tokens] * rows
        if length + max(limits) > self.max_cache_len:
            raise ValueError(f"prompt of {length} tokens + {max(limits)} new exceeds the "
                             f"cache of {self.max_cache_len}")
        picks = [s if s and s.temperature > 0 else None for s in (sampling or [None] * rows)]
        generators = [torch.Generator().manual_seed(s.seed) if s and s.seed is not None
                      else None for s in picks]
        self._fresh_cache(rows)
        padded = mask is not None
        if padded:
            mask = torch.cat([mask, torch.ones(rows, self.max_cache_len - length,
                                               dtype=mask.dtype)], dim=1)
        began = time.perf_counter()
        positions = torch.arange(length)
        logits = self._forward(ids, positions,
                               (positions - pads[:, None]).clamp(min=0) if padded else None, mask)
        token = _pick(logits, picks, generators)
        ttft = time.perf_counter() - began
        out: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        began, i = time.perf_counter(), 0
        while True:
            produced = _record(token, out, finish, limits, stop or set())
            for row in (on_tokens(produced) if on_tokens else None) or ():
                finish[row] = finish[row] or "stop"
            if all(finish):
                break
            # Inductor's settings apply where the step compiles (its first call, or a
            # recompile); Dynamo's full guard check stays on (skipping it ran a graph
            # compiled for another decoder's cache: an out-of-bounds cache index)
            with torch._inductor.config.patch(self.inductor):
                where = torch.tensor([length + i])
                logits = self.step(token.view(rows, 1), where,
                                   (where - pads)[:, None] if padded else None, mask)
            token = _pick(logits, picks, generators)
            i += 1
        spent = time.perf_counter() - began
        later = sum(max(len(r) - 1, 0) for r in out)
        rate = later / spent if spent > 0 and later else 0.0
        return Generation(out[0], ttft, rate, out, [str(f) for f in finish])


def _record(token: torch.Tensor, out: list[list[int]], finish: list[str | None],
            limits: list[int], stop: set[int]) -> list[int | None]:
    """Append each unfinished row's token; mark rows that end with it."""
    produced: list[int | None] = []
    for row, value in enumerate(token.tolist()):
        if finish[row]:
            produced.append(None)
            continue
        out[row].append(value)
        produced.append(value)
        if value in stop:
            finish[row] = "stop"
        elif len(out[row]) >= limits[row]:
            finish[row] = "length"
    return produced


def _pick(logits: torch.Tensor, picks: list[Sampling | None],
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """The next token of every row: argmax, or a top-p sample at the row's temperature."""
    greedy = logits.argmax(-1)
    if not any(picks):
        return greedy
    chosen = greedy.clone()
    for row, how in enumerate(picks):
        if how is None:
            continue
        probs = torch.softmax(logits[row].float() / how.temperature, dim=-1)
        ranked, order = probs.sort(descending=True)
        keep = (ranked.cumsum(-1) - ranked) < how.top_p  # the smallest set reaching top_p
        ranked = ranked * keep
        index = torch.multinomial(ranked / ranked.sum(), 1, generator=generators[row])
        chosen[row] = order[index[0]]
    return chosen


def main(argv: list[str] | None = None) -> None:
    """Print the text a causal-LM folder generates after a prompt."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--compile", choices=["none", "default", "max-autotune"],
                        default="none")
    args = parser.parse_args(argv)
    lm = load_folder(args.folder)
    ids = prompt_ids(lm.tokenizer, args.prompt)
    decoder = StaticDecoder(lm.model, max(512, len(ids) + args.max_new_tokens))
    if args.compile != "none":
        decoder.compile(args.compile)
    out = decoder.generate([ids], args.max_new_tokens, stop_ids(lm.model, lm.tokenizer),
                           [Sampling(args.temperature)])
    print(lm.tokenizer.decode(out.tokens, skip_special_tokens=True))


if __name__ == "__main__":
    main()
