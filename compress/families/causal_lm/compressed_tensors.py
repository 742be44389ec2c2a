"""A causal LM exported as a compressed-tensors checkpoint (stage `export` with
`format: compressed_tensors`): the folder vLLM, SGLang and transformers load
(`export/compressed_tensors.py` writes it), and transformers' own reading of it held
against the model.

Parity: where the `compressed-tensors` package is installed, transformers loads the folder
(`from_pretrained` with `CompressedTensorsConfig(dequantize=True)`: each weight dequantized
once at load, the `(code - zero point) x scale` of the format) and scores the eval texts;
its logits at every position are compared with the model's in float32 activations (the
grouped kernels' exact mode). Where every group was on the format's grid
(`grid: compressed_tensors` in the quantize stage) both hold the same float32 weights, and
only the order of the sums differs: a largest difference above `tolerance` (default
`TOLERANCE`) fails the stage. Re-rounded groups are reported with the measured error and
never fail it. Without the package the stage says so in its metrics and log.

Why `dequantize=True`: transformers 5.x with compressed-tensors 0.20 cannot load an
asymmetric pack-quantized checkpoint the default way (its compressed placeholders hold the
zero points unpacked, the format packs them: a size mismatch), and its dequantizing loader
reads one scheme for every module (`export/compressed_tensors.py` keeps a head of another
width out of the quantized modules for that reason). vLLM reads the packed zero points.
"""

from __future__ import annotations

import importlib.util
import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compress.errors import ParityError, UserError
from compress.families.causal_lm.model import (
    grouped_activations,
    scored_sequences,
    sequence_scores,
)
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.export import COMPRESSED_TENSORS_FORMAT, ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from export.compressed_tensors import WEIGHTS, CompressedTensorsError, write_compressed_tensors

TOLERANCE = 1e-3  # largest |logit difference| when every weight was on the format's grid
PARITY_TEXTS = 16  # eval texts transformers and the model both score
EXTRA = "pip install 'compress-pipeline[compressed-tensors]'"


def transformers_model(folder: Path) -> torch.nn.Module:
    """The folder as transformers loads it (the weights dequantized once, float32)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    try:
        with warnings.catch_warnings():  # "the config of the folder will be used": it is
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            return AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32,
                quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    except Exception as exc:  # noqa: BLE001  (any failure to load is the parity's answer)
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        raise ParityError(f"transformers could not load {folder.name}: {line}") from None


def parity(bundle: ModelBundle, folder: Path, texts: list[str], log: Any) -> dict[str, Any]:
    """transformers' logits and perplexity on `texts` against the model's."""
    if importlib.util.find_spec("compressed_tensors") is None:
        log(f"parity: no compressed-tensors package here ({EXTRA}); the folder was checked "
            "by reading it back only")
        return {"ct_parity": "skipped: no compressed-tensors"}
    sequences = scored_sequences(bundle.tokenizer, texts)
    log(f"parity: transformers and the model score {len(sequences)} eval texts")
    loaded = transformers_model(folder)
    theirs, their_nll = sequence_scores(loaded, sequences)
    del loaded
    with grouped_activations(bundle.model.eval(), "float32"):  # the exact mode
        ours, our_nll = sequence_scores(bundle.model, sequences)
    tokens = sum(len(s) - 1 for s in sequences)
    our_ppl, their_ppl = math.exp(sum(our_nll) / tokens), math.exp(sum(their_nll) / tokens)
    import transformers

    return {"ct_parity": "transformers", "ct_transformers": transformers.__version__,
            "ct_logit_positions": len(ours),
            "ct_logit_max_abs_diff": float(np.abs(ours - theirs).max()),
            "ct_top1_agreement": round(float((ours.argmax(-1) == theirs.argmax(-1)).mean()), 6),
            "ct_perplexity": round(their_ppl, 4), "ct_source_perplexity": round(our_ppl, 4),
            "ct_perplexity_change_pct": round(100 * (their_ppl / our_ppl - 1), 6)}


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Write the compressed-tensors folder of the model that entered the stage, check it
    with transformers where it can, record it; the model goes on unchanged."""
    bundle = state.bundle
    facts = bundle.causal_lm_facts or {}
    final = ctx.folder / COMPRESSED_TENSORS_FORMAT
    try:
        written = write_compressed_tensors(bundle.model, bundle.tokenizer, final,
                                           int(facts.get("group_size") or 32))
    except CompressedTensorsError as exc:
        raise UserError(f"stages.{ctx.index} (export {COMPRESSED_TENSORS_FORMAT}): {exc}"
                        ) from None
    size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    ctx.metrics.update(written.facts(), size_mb=round(size / 1e6, 3),
                       runtime=COMPRESSED_TENSORS_FORMAT)
    if written.rerounded:
        ctx.log(f"{ctx.name}: {written.rerounded} of {written.groups} groups were off the "
                f"format's grid and were re-rounded (largest change "
                f"{written.max_rounding:.3g}); quantize with grid: compressed_tensors to keep "
                "them exact")
    texts = ctx.data.splits["eval"].texts[:cfg.parity_samples or PARITY_TEXTS]
    figures = parity(bundle, final, texts, lambda m: ctx.log(f"{ctx.name}: {m}"))
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    ctx.metrics.update(figures)
    bound = cfg.tolerance if cfg.tolerance is not None else TOLERANCE
    worst = figures.get("ct_logit_max_abs_diff")
    if worst is not None and not written.rerounded and worst > bound:
        raise ParityError(f"{final.relative_to(ctx.run_dir)}: transformers' logits are up to "
                          f"{worst:.3g} from the model's, every weight on the format's grid "
                          f"(tolerance {bound}); parity.json has the figures")
    ctx.add_output(artifact_record(final / WEIGHTS, ctx.run_dir, COMPRESSED_TENSORS_FORMAT,
                                   export_dir=str(final.relative_to(ctx.run_dir))))
    return State(bundle)
