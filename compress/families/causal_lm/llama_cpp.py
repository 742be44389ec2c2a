"""A causal LM exported for llama.cpp (stage `export` with `format: gguf`): one GGUF file
(`export.gguf`), an Ollama `Modelfile` beside it, and llama.cpp's own reading of the file held
against the model.

Parity, like for like: the model's grouped layers score with their activations rounded to
int8 per block of 32 (the kernels' int8 mode), as llama.cpp's Q8_0 and Q4_1 products round
them; a float model scores in float32, as llama.cpp's F32 file does; llama.cpp's KV cache
is float32, as the model's (its default f16 cache's perplexity is recorded beside:
`gguf_perplexity_f16_cache`, which on a model of high perplexity moves it by about half a
percent). Where a Python with
llama-cpp-python is at hand (`COMPRESS_LLAMA_PYTHON`, else this interpreter when it has it,
else the environment `benchmarks/causal_lm/llama_env.py` builds in
`~/.cache/compress/llama-venv`): llama.cpp loads the file and evaluates the eval texts; its
logits on the first `LOGIT_POSITIONS` positions are compared with the model's (max abs
difference, top-1 agreement: the two round and sum in different orders, so agreement, not
equality), and its perplexity on the same texts with the model's
(more than `MAX_PERPLEXITY_CHANGE_PCT`, 1%, fails the stage). Without llama-cpp-python
the stage says so in its metrics and log (the tests check files by reading them back:
every tensor's values are the model's, exactly where the weights were on llama.cpp's
grids).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
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
from compress.recipe.kinds.export import GGUF_FORMAT, ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from export import gguf_llama
from export.gguf import GgufError, write_gguf

LOGIT_POSITIONS = 100
PARITY_TEXTS = 16  # eval texts llama.cpp and the model both score
MAX_PERPLEXITY_CHANGE_PCT = 1.0
LLAMA_VENV = Path("~/.cache/compress/llama-venv").expanduser()
LLAMA_VENV_READY = ".compress-llama-ready"  # written by llama_env.py once the install is done


def llama_python() -> str | None:
    """A Python with llama-cpp-python (None: none found)."""
    if os.environ.get("COMPRESS_LLAMA_PYTHON"):
        return os.environ["COMPRESS_LLAMA_PYTHON"]
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    finished = (LLAMA_VENV / LLAMA_VENV_READY).is_file()
    return str(LLAMA_VENV / "bin" / "python") if finished else None


def modelfile(gguf_name: str, tokenizer: Any) -> str:
    """Ollama's Modelfile for the file beside it (the chat template is in the GGUF)."""
    stops = [t for t in (tokenizer.eos_token,) if t]
    lines = [f"FROM ./{gguf_name}", "PARAMETER temperature 0"]
    lines += [f'PARAMETER stop "{stop}"' for stop in stops]
    return "\n".join(lines) + "\n"


def llama_scores(python: str, path: Path, sequences: list[list[int]], threads: int,
                 kv_cache: str = "f32") -> tuple[np.ndarray, list[float], list[int], str]:
    """(logits of the first LOGIT_POSITIONS positions, each sequence's summed NLL and its
    scored token count, llama-cpp-python's version) from llama.cpp, its KV cache of type
    `kv_cache` (f32, or llama.cpp's default f16)."""
    with tempfile.TemporaryDirectory() as out:
        spec = {"gguf": str(path), "sequences": sequences, "out": out, "threads": threads,
                "logit_positions": LOGIT_POSITIONS, "kv_cache": kv_cache}
        done = subprocess.run([python, gguf_llama.__file__], input=json.dumps(spec),
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ParityError(f"llama.cpp could not load or run {path.name}: {tail}")
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        logits = np.load(Path(out) / "logits.npy")
    return logits, answer["nll"], answer["tokens"], answer["llama_cpp"]


def parity(bundle: ModelBundle, path: Path, texts: list[str], threads: int,
           log: Any) -> dict[str, Any]:
    """llama.cpp's logits and perplexity on `texts` against the model's."""
    python = llama_python()
    if python is None:
        log("parity: no llama-cpp-python here (set COMPRESS_LLAMA_PYTHON to a Python that has "
            "it); the file was checked by reading it back only")
        return {"gguf_parity": "skipped: no llama-cpp-python"}
    sequences = scored_sequences(bundle.tokenizer, texts)
    log(f"parity: llama.cpp and the model score {len(sequences)} eval texts")
    # like for like: llama.cpp's cache in float32, as the model's (its default f16 below)
    theirs, their_nll, counts, version = llama_scores(python, path, sequences, threads)
    _, default_nll, _, _ = llama_scores(python, path, sequences, threads, "f16")
    # like for like: activations rounded to int8 per 32, as llama.cpp's products round them
    with grouped_activations(bundle.model.eval(), "int8") as mode:
        ours, our_nll = sequence_scores(bundle.model, sequences, LOGIT_POSITIONS)
    rows = min(len(ours), len(theirs))
    ours, theirs = ours[:rows], theirs[:rows]
    tokens = sum(counts)
    our_ppl, their_ppl = math.exp(sum(our_nll) / tokens), math.exp(sum(their_nll) / tokens)
    default_ppl = math.exp(sum(default_nll) / tokens)
    return {"gguf_parity": "llama.cpp", "gguf_llama_cpp_python": version,
            "gguf_logit_positions": rows, "gguf_source_activations": mode,
            "gguf_logit_max_abs_diff": round(float(np.abs(ours - theirs).max()), 6),
            "gguf_top1_agreement": round(float((ours.argmax(-1) == theirs.argmax(-1)).mean()), 6),
            "gguf_perplexity": round(their_ppl, 4), "gguf_source_perplexity": round(our_ppl, 4),
            "gguf_perplexity_change_pct": round(100 * (their_ppl / our_ppl - 1), 4),
            "gguf_kv_cache": "f32",
            "gguf_perplexity_f16_cache": round(default_ppl, 4),
            "gguf_perplexity_f16_cache_change_pct": round(100 * (default_ppl / our_ppl - 1), 4),
            "gguf_parity_tokens": tokens}


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Write the GGUF of the model that entered the stage, check it with llama.cpp where it
    can be run, record it; the model goes on unchanged."""
    bundle = state.bundle
    facts = bundle.causal_lm_facts or {}
    scheme = facts.get("scheme")  # one GGUF holds (GGUF_SCHEMES: checked with the recipe)
    final = ctx.folder / GGUF_FORMAT
    path = final / f"{ctx.recipe.name}.gguf"
    from compress.recipe.sources import shipped_gguf

    source = shipped_gguf(ctx.recipe.model.source)
    try:
        written = write_gguf(bundle.model, bundle.tokenizer, path, scheme, ctx.recipe.name,
                             source)
    except GgufError as exc:
        raise UserError(f"stages.{ctx.index} (export gguf): {exc}") from None
    (final / "Modelfile").write_text(modelfile(path.name, bundle.tokenizer))
    ctx.metrics.update(written.facts(), size_mb=round(path.stat().st_size / 1e6, 3),
                       runtime=GGUF_FORMAT)
    if written.rerounded:
        ctx.log(f"{ctx.name}: {written.rerounded} of {written.groups} int8 groups were off "
                f"llama.cpp's Q8_0 grid and were re-rounded (largest change "
                f"{written.max_rounding:.3g}); quantize with grid: gguf to keep them exact")
    texts = ctx.data.splits["eval"].texts[:cfg.parity_samples or PARITY_TEXTS]
    figures = parity(bundle, path, texts, torch.get_num_threads(),
                     lambda m: ctx.log(f"{ctx.name}: {m}"))
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    ctx.metrics.update(figures)
    change = figures.get("gguf_perplexity_change_pct")
    if change is not None and abs(change) > MAX_PERPLEXITY_CHANGE_PCT:
        raise ParityError(f"{final.relative_to(ctx.run_dir)}: llama.cpp's perplexity "
                          f"{figures['gguf_perplexity']} is {change:+.2f}% from the model's "
                          f"{figures['gguf_source_perplexity']} (more than "
                          f"{MAX_PERPLEXITY_CHANGE_PCT}%); parity.json has the figures")
    ctx.add_output(artifact_record(path, ctx.run_dir, GGUF_FORMAT,
                                   export_dir=str(final.relative_to(ctx.run_dir))))
    return State(bundle)
