"""Compare the pipeline-parallel causal LM (`pipeline.py`: its stages and decoder) with
the same model in one process, on every rank of a torchrun job; no compress code (shipped
in a causal-LM export's `causal_lm` package, run there by the export stage).

    cd FOLDER && torchrun --nproc-per-node 2 -m causal_lm.pipeline_parallel . \
        --prompts prompts.txt --out pp.json

prints (and writes to --out, from the last rank) the largest logit difference against the
same model in one process, the greedy tokens of both, the weight bytes each rank holds, and
generation tokens/s at batch 8 with 1, 2 and 4 micro-batches.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import decode, loading, pipeline

MICROBATCHES = (1, 2, 4)
BATCH = 8


def weight_bytes(module: nn.Module, projections_only: bool = False) -> int:
    """Bytes of the weights `module` holds (each storage once; a quantized tensor by its
    inner tensors), of the decoder layers' projections (`*_proj`) alone with
    `projections_only`."""
    def inner(t: torch.Tensor) -> list[torch.Tensor]:
        if hasattr(t, "__tensor_flatten__"):
            return [x for n in t.__tensor_flatten__()[0] for x in inner(getattr(t, n))]
        return [t]

    owners = [m for n, m in module.named_modules() if n.endswith("proj")] if (
        projections_only) else [module]
    tensors = [t for m in owners for w in (*m.parameters(), *m.buffers()) for t in inner(w)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _generate_rate(decoder: pipeline.PipelineDecoder | Any, prompts: list[list[int]],
                   max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """New tokens a second of one batch of `prompts` (every row to `max_new_tokens`), and
    the rows' tokens."""
    began = time.perf_counter()
    out = decoder.generate(prompts, max_new_tokens)
    return sum(len(r) for r in out.rows) / (time.perf_counter() - began), out.rows


def compare(folder: str, prompts: list[Any], max_new_tokens: int,
            chat_template: bool = True) -> dict[str, Any]:
    """Run on every rank of a torchrun job: the pipeline against the whole model in one
    process (the last rank loads it a second time); the figures on the last rank."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    lm = loading.load_folder(folder)
    ids = [loading.prompt_ids(lm.tokenizer, p, chat_template) for p in prompts]
    whole = loading.load_folder(folder).model if rank == ranks - 1 else None
    everything = weight_bytes(lm.model)
    pipe = pipeline.Pipe(lm.model, rank, ranks)
    cache = max(len(i) for i in ids) + max_new_tokens + 8
    decoder = pipeline.PipelineDecoder(pipe, cache)
    split_logits = [pipe.forward(torch.tensor([i]), torch.ones(1, len(i), dtype=torch.long),
                                 every_position=True) for i in ids]
    split_tokens = [decoder.generate([i], max_new_tokens).tokens for i in ids]
    batch = (ids * BATCH)[:BATCH]
    _generate_rate(decoder, batch, 2)  # warm-up
    rates, rows = {}, []
    for chunks in MICROBATCHES:
        decoder.microbatches = chunks
        rate, rows = _generate_rate(decoder, batch, max_new_tokens)
        rates[chunks] = round(rate, 2)
        split_tokens += rows  # left-padded rows, in micro-batches
    held = [None] * ranks
    dist.all_gather_object(held, (weight_bytes(pipe.module, True), weight_bytes(pipe.module)))
    if whole is None:
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # one process may use every core
    with torch.inference_mode():
        whole_logits = [whole(input_ids=torch.tensor([i])).logits[0].float() for i in ids]
    one = decode.StaticDecoder(whole, cache)
    whole_tokens = [one.generate([i], max_new_tokens).tokens for i in ids]
    one.generate(batch, 2)  # warm-up
    rate, rows = _generate_rate(one, batch, max_new_tokens)
    whole_tokens += rows * len(MICROBATCHES)
    diff = max(float((a[0] - b).abs().max()) for a, b in zip(split_logits, whole_logits,
                                                             strict=True))
    # each prompt alone, then the batch of 8 at each micro-batch count
    pairs = [(a, b) for x, y in zip(split_tokens, whole_tokens, strict=True)
             for a, b in zip(x, y, strict=False)]
    return {"pipeline_parallel": ranks, "schedule": "GPipe", "kv_cache": False,
            "layers_per_rank": [len(s) for s in pipe.spans], "prompts": len(ids),
            "max_logit_diff": diff,
            "greedy_agreement": round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4),
            "projection_weight_bytes_per_rank": [h[0] for h in held],
            "projection_weight_bytes_one_process": weight_bytes(whole, True),
            "weight_bytes_per_rank": [h[1] for h in held],
            "weight_bytes_one_process": everything,
            "generate_tok_s_b8": rates,
            "generate_tok_s_b8_one_process": round(rate, 2),
            "threads_per_rank": threads, "threads_one_process": torch.get_num_threads(),
            "tokens": split_tokens, "tokens_one_process": whole_tokens}


def main(argv: list[str] | None = None) -> None:
    """Compare the pipeline-parallel model with one process (run under torchrun)."""
    _tensor_parallel().run_comparison(compare, "causal_lm.pipeline_parallel", argv)


def _tensor_parallel() -> Any:
    from . import tensor_parallel

    return tensor_parallel


if __name__ == "__main__":
    main()
