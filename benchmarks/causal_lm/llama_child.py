"""One fresh process of benchmarks/causal_lm/peers.py on llama.cpp's side, run by the llama
environment's Python (llama-cpp-python and numpy; no torch, no compress: the standard
library and benchmarks/harness/child_main.py besides): `python -m
benchmarks.causal_lm.llama_child SPEC_JSON` prints one JSON line (the figures, or {"error":
one line}).

Modes:
- "measure": one GGUF through llama.cpp's own C API (the bindings' low-level functions, so
  that several sequences share one `llama_decode`): the token ids checked against the ones
  compress's tokenizer gave, perplexity and greedy tokens (when asked), greedy decode tok/s
  at batch 1 and at batch 8 (one sequence a row, one token a row a step), and the time to
  the first token of a long prompt.
- "quantize": `llama_model_quantize` (with `allow_requantize`) of a GGUF to another type.
- "facts": versions and llama.cpp's system info (the instruction sets ggml was built for).
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.child_main import run_modes


class Context:
    """A llama.cpp context on a loaded model, with one reusable batch."""

    def __init__(self, ll: Any, model: Any, n_ctx: int, n_seq: int, n_batch: int,
                 threads: int):
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq, threads, threads
        self.ll, self.ctx = ll, ll.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx}, n_seq {n_seq})")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        self.batch = ll.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch

    def close(self) -> None:
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One `llama_decode` of (token, position, sequence, wants logits) entries."""
        if len(entries) > self.n_batch:
            raise ValueError(f"{len(entries)} tokens in one batch, at most {self.n_batch}")
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, int(logits)
        b.n_tokens = len(entries)
        code = self.ll.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def logits(self, index: int, rows: int = 1) -> np.ndarray:
        """`rows` rows of logits from the output of the last decode's `index`-th token
        (rows > 1: the tokens after it all asked for logits)."""
        pointer = self.ll.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab))

    def clear(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def generate(self, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float,
                                                                    float]:
        """Greedy tokens of each prompt (one sequence each, no EOS stop), the seconds to the
        first tokens, and the tokens per second after them (every row counted)."""
        self.clear()
        began = time.perf_counter()
        self.decode([(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts)
                     for j, t in enumerate(p)])
        last = np.cumsum([len(p) for p in prompts]) - 1  # batch index of each prompt's end
        tokens = [int(self.logits(int(i))[0].argmax()) for i in last]
        ttft = time.perf_counter() - began
        out = [[t] for t in tokens]
        began = time.perf_counter()
        for step in range(1, new):
            self.decode([(t, len(p) + step - 1, s, True)
                         for s, (t, p) in enumerate(zip(tokens, prompts, strict=True))])
            tokens = [int(self.logits(s)[0].argmax()) for s in range(len(prompts))]
            for row, token in zip(out, tokens, strict=True):
                row.append(token)
        spent = time.perf_counter() - began
        return out, ttft, len(prompts) * (new - 1) / spent if new > 1 else 0.0


def nll(logits: np.ndarray, ids: list[int]) -> float:
    """Summed next-token negative log-likelihood of `ids` under `logits` (one row a
    position, the last row unused)."""
    rows = logits[:len(ids) - 1].astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
    return float((log_z - rows[np.arange(len(ids) - 1), ids[1:]]).sum())


def tokenize(ll: Any, model: Any, text: str, special: bool) -> list[int]:
    """llama.cpp's token ids of `text` (the file's BOS setting; special tokens parsed when
    `special`)."""
    vocab, raw = ll.llama_model_get_vocab(model), text.encode("utf-8")
    ids = (ll.llama_token * (len(raw) + 8))()
    n = ll.llama_tokenize(vocab, raw, len(raw), ids, len(ids), True, special)
    if n < 0:
        raise RuntimeError(f"llama_tokenize needed {-n} tokens")
    return list(ids[:n])


def check_tokens(ll: Any, model: Any, inputs: dict[str, Any]) -> None:
    """llama.cpp's tokenizer gives the ids compress's gave: every perplexity text (truncated
    as compress truncates it) and the first chat prompt (special tokens parsed)."""
    pairs = [(t, ids, False) for t, ids in zip(inputs["texts"], inputs["text_ids"], strict=True)]
    pairs.append((inputs["chat_text"], inputs["prompts"][0], True))
    for i, (text, expected, special) in enumerate(pairs):
        got = tokenize(ll, model, text, special)[:None if special else inputs["max_length"]]
        if got != expected:
            raise AssertionError(f"text {i} tokenizes differently in llama.cpp: {got[:12]}... "
                                 f"against compress's {expected[:12]}...")


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the GGUF and measure it (see the module's docstring)."""
    import llama_cpp as ll

    inputs = json.loads(Path(spec["inputs"]).read_text())
    threads, tokens, repeats = spec.get("threads") or os.cpu_count() or 1, spec["tokens"], \
        spec.get("repeats", 3)
    ll.llama_backend_init()
    began = time.perf_counter()
    model = ll.llama_model_load_from_file(spec["model"].encode(), ll.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {spec['model']}")
    prompts, long = inputs["prompts"], inputs["ttft_prompt"]
    longest = max(len(p) for p in [*prompts, long]) + max(tokens, spec["greedy_tokens"])
    one = Context(ll, model, max(512, longest + 8), 1, 512, threads)
    figures: dict[str, Any] = {"load_s": round(time.perf_counter() - began, 3),
                               "threads": threads}
    if spec.get("quality"):
        check_tokens(ll, model, inputs)
        total = 0.0
        for ids in inputs["text_ids"]:
            one.clear()
            one.decode([(t, j, 0, True) for j, t in enumerate(ids)])
            total += nll(one.logits(0, len(ids)), ids)
        count = sum(len(ids) - 1 for ids in inputs["text_ids"])
        figures.update(perplexity=round(float(np.exp(total / max(count, 1))), 4),
                       eval_tokens=count, tokens_checked=len(inputs["texts"]) + 1)
        figures["greedy"] = [one.generate([p], spec["greedy_tokens"])[0][0] for p in prompts]
    one.generate([prompts[0]], 4)  # warm-up
    figures["tok_s_b1"] = statistics.median(one.generate([prompts[0]], tokens)[2]
                                            for _ in range(repeats))
    figures["ttft_ms"] = 1000 * statistics.median(one.generate([long], 1)[1]
                                                  for _ in range(repeats))
    one.close()
    batch = prompts[:spec.get("batch", 8)]
    try:
        many = Context(ll, model, len(batch) * max(512, longest + 8), len(batch),
                       max(512, sum(map(len, batch))), threads)
        many.generate(batch, 4)  # warm-up
        runs = [many.generate(batch, tokens) for _ in range(repeats)]
        figures["tok_s_b8"] = statistics.median(r[2] for r in runs)
        if spec.get("quality"):  # checked against batch 1's greedy tokens by the parent
            figures["b8_rows"] = runs[0][0]
        many.close()
    except (RuntimeError, ValueError) as exc:
        figures["b8_note"] = f"not measured: {exc}"
    ll.llama_model_free(model)
    return {**figures, "pid": os.getpid()}


def quantize(spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's quantize of spec["source"] to spec["quant"] (Q8_0, Q4_0...)."""
    import llama_cpp as ll

    params = ll.llama_model_quantize_default_params()
    params.ftype = getattr(ll, f"LLAMA_FTYPE_MOSTLY_{spec['quant']}")
    params.allow_requantize, params.nthread = True, spec.get("threads") or 1
    code = ll.llama_model_quantize(spec["source"].encode(), spec["target"].encode(),
                                   ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
    return {"target": spec["target"], "bytes": Path(spec["target"]).stat().st_size}


def facts(spec: dict[str, Any]) -> dict[str, Any]:
    """Versions of the environment's packages and ggml's system info."""
    import importlib.metadata as metadata

    import llama_cpp as ll

    return {"llama-cpp-python": metadata.version("llama-cpp-python"),
            "numpy": metadata.version("numpy"),
            "system_info": ll.llama_print_system_info().decode().strip()}


MODES = {"measure": measure, "quantize": quantize, "facts": facts}


def main(argv: list[str] | None = None) -> int:
    """The spec's mode, its JSON line on stdout (`child_main.run_modes`)."""
    return run_modes(MODES, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
