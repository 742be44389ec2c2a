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


def length_sorted(texts: list[str]) -> list[str]:
    """The texts as sentence-transformers' `encode` orders them before it cuts the list into
    batches: longest first by characters (`-len(text)`; its argsort may break ties in
    another order, which moves a pass's padding by a token or two at most)."""
    return sorted(texts, key=lambda text: -len(text))


def batch_lengths(source: Path, texts: list[str], batch: int, max_length: int,
                  sort: bool = False) -> list[list[int]]:
    """The token count of each text, per batch of `batch` texts in order (with `sort`, in
    sentence-transformers' order, `length_sorted`), by the source model's tokenizer,
    truncated at `max_length` as sentence-transformers does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    texts = length_sorted(texts) if sort else texts
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


# how a row's passes are shaped (each library's own batching): a key of `pass_kinds`
SHAPE_NAMES = {"sorted": "sentence-transformers' length-sorted batches",
               "order": "the batches in order, each padded to its longest (fastembed, "
                        "`one pass`)",
               "bucketed": "compress's passes of similar length",
               "packed": "a packed file (each text's own tokens, no padding)"}


def shape_kind(item: dict[str, Any]) -> str:
    """How the row's library shapes its passes over the whole list: sentence-transformers
    sorts it by length, fastembed takes its batches in order, compress's rows cut each
    batch into passes of similar length (or run a packed file's real tokens)."""
    if item.get("kind") in ("st", "st_onnx", "st_openvino"):
        return "sorted"
    if item.get("packed"):
        return "packed"
    return "bucketed" if item.get("length_buckets") else "order"


def config_folder(item: dict[str, Any], source: Path) -> Path:
    """The folder whose config.json counts the row's FLOPs: a peer's model folder (the
    user's model or the student, as built for it), an export's float weights (`model`),
    else the source."""
    if item.get("peer") and item.get("folder"):
        return Path(item["folder"])
    return Path(item.get("model") or source)


def config_key(folder: Path) -> str:
    """What the FLOPs depend on: the folder's config.json (a built copy of a model counts as
    the model), else the folder's name."""
    try:
        return json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True)
    except (OSError, ValueError):
        return str(folder)


def assign_flops(items: list[dict[str, Any]], source: Path, texts: list[str], batch: int,
                 max_length: int, fixed: tuple[int, int]) -> list[str]:
    """Each item's `flops` (a pass over the texts, shaped as its library shapes it, from its
    own model's config) and `fixed_flops` (one call of the `fixed` shape); the notes saying
    each figure used, one a model."""
    in_order = batch_lengths(source, texts, batch, max_length)
    batches = {"order": in_order, "bucketed": in_order, "packed": in_order,
               "sorted": batch_lengths(source, texts, batch, max_length, sort=True)}
    found: dict[tuple[str, str], float | None] = {}
    folders: dict[str, Path] = {config_key(source): source}
    for item in items:
        folder, kind = config_folder(item, source), shape_kind(item)
        model = config_key(folder)
        folders.setdefault(model, folder)
        if (model, kind) not in found:
            found[(model, kind)], _ = pass_flops(folder, pass_shapes(
                batches[kind], bucketed=kind == "bucketed", packed=kind == "packed"))
        if (model, "fixed") not in found:
            found[(model, "fixed")], _ = pass_flops(folder, [fixed])
        item["flops"], item["fixed_flops"] = found[(model, kind)], found[(model, "fixed")]
    notes = []
    for model, folder in folders.items():
        said = [f"{SHAPE_NAMES[kind]} {flops / 1e9:.1f} G" for (m, kind), flops in found.items()
                if m == model and kind in SHAPE_NAMES and flops]
        if not said:
            continue
        fixed_flops = found.get((model, "fixed"))
        whose = "the user's model" if folder == source else _layers(folder)
        notes.append(f"FLOPs of a pass over the texts ({whose}, from its config.json): "
                     + "; ".join(said) + (f"; b{fixed[0]}x{fixed[1]} {fixed_flops / 1e9:.2f} G "
                                          "a call" if fixed_flops else ""))
    return notes


def _layers(folder: Path) -> str:
    """`the 4-layer student`: a model by its layer count."""
    try:
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    except (OSError, ValueError, KeyError):
        return f"`{folder.name}`"
    return f"the {layers}-layer student"
