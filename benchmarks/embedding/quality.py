"""What benchmarks/embedding/peers.py computes in compress's environment from its children's
output: each row's fidelity and recall@10 against sentence-transformers fp32's embeddings of
the same texts (compress/families/embedding/measures.py; with --no-peers against the run's
own reference embeddings), and the encoder FLOPs of one pass over the texts in batches
padded to their longest (for the share of the int8 GEMM peak)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness.flops import forward_flops
from compress.families.embedding.family import REFERENCE as RUN_REFERENCE
from compress.families.embedding.measures import fidelity, recall_at_k

RECALL_K = 10


def quality(embeddings: Path, reference: Path) -> dict[str, Any]:
    """fidelity, fidelity_p1 and recall_at_10 of one row's .npy against the reference's;
    {"quality_error": why} when the two cannot be compared."""
    import numpy as np
    import torch

    ours = torch.from_numpy(np.load(embeddings))
    theirs = torch.from_numpy(np.load(reference))
    if ours.shape != theirs.shape:
        return {"quality_error": f"embeddings {tuple(ours.shape)} against the reference's "
                                 f"{tuple(theirs.shape)}"}
    return {**fidelity(ours, theirs),
            f"recall_at_{RECALL_K}": recall_at_k(ours, theirs, RECALL_K)}


def batch_lengths(source: Path, texts: list[str], batch: int, max_length: int
                  ) -> list[list[int]]:
    """The token count of each text, per batch of `batch` texts in order, by the source
    model's tokenizer, truncated at `max_length` as sentence-transformers does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    return [[len(row) for row in tokenizer(texts[i:i + batch], truncation=True,
                                           max_length=max_length)["input_ids"]]
            for i in range(0, len(texts), batch)]


def pass_shapes(batches: list[list[int]], bucketed: bool = False,
                packed: bool = False) -> list[tuple[int, int]]:
    """(rows, padded length) of each forward pass over batches of these token counts: a
    pass a batch, or with `bucketed` the passes of similar length compress's handlers cut a
    batch into (`serve.batching.length_buckets`), or with `packed` each text's own tokens
    (a packed file computes no padding: its FLOPs are those of the texts alone)."""
    from serve.batching import length_buckets

    if packed:
        return [(1, n) for lengths in batches for n in lengths]
    shapes = []
    for lengths in batches:
        for part in length_buckets(lengths) if bucketed else [range(len(lengths))]:
            shapes.append((len(part), max(lengths[k] for k in part)))
    return shapes


def pass_flops(source: Path, shapes: list[tuple[int, int]]) -> tuple[float | None, str]:
    """Encoder FLOPs of one pass (harness.flops.forward_flops per batch, summed) from the
    source model's config.json, and a note saying so."""
    try:
        config = json.loads((source / "config.json").read_text())
        flops = sum(forward_flops(config, rows, length) for rows, length in shapes)
    except (OSError, ValueError, KeyError) as exc:
        return None, f"no FLOPs: {exc}"
    return flops, (f"FLOPs {flops / 1e9:.1f} G a pass over the texts, from the source "
                   "model's config.json")


def mean_tokens(shapes: list[tuple[int, int]]) -> float | None:
    """The mean padded length over the batches."""
    return round(sum(n for _, n in shapes) / len(shapes), 1) if shapes else None


def score_rows(items: list[dict[str, Any]], work: Path, reference: Path | None,
               run_dir: Path, count: int) -> list[str]:
    """Each measured row's quality against `reference` (sentence-transformers fp32's .npy),
    else the run's own reference embeddings (compress's float model); the notes."""
    notes = []
    if reference is None:
        reference = work / "run_reference.npy"
        run_reference(run_dir, reference, count)
        notes.append("fidelity and recall@10 against the run's own reference embeddings "
                     "(compress's float model): sentence-transformers fp32 was not measured")
    for item in items:
        saved = work / f"{item['name']}.npy"
        if saved.is_file():
            item["quality"] = quality(saved, reference)
    return notes


def run_reference(run_dir: Path, out: Path, count: int) -> None:
    """The run's embedding_reference.safetensors (first `count` rows) as a .npy."""
    import numpy as np
    from safetensors.torch import load_file

    np.save(out, load_file(str(run_dir / RUN_REFERENCE))["embeddings"][:count].numpy())
