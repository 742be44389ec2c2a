"""A GGUF file converted once to a Hugging Face folder, and read from that folder after.

Reading SmolLM2-135M's GGUF costs tens of seconds on every load: gguf's reader walks the
49,152-token vocabulary and its merges one numpy-memmap slice at a time (about 1.8 million
`memmap.__getitem__` calls, twice: once for the tokenizer, once for the model), then
dequantizes 272 tensors. The converted folder (float32 safetensors, config, tokenizer)
loads in about a second with the same weights and token ids.

The cache lives in `$COMPRESS_CACHE_DIR`, else `$XDG_CACHE_HOME/compress`, else
`~/.cache/compress`, keyed by the GGUF's name, size and modification time, so a changed
file converts again. A folder appears whole or not at all: it is written beside its final
name and renamed into place, so two processes converting at once both end with one whole
folder, and an interrupted conversion leaves a hidden temporary folder, never a half
folder under the final name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

COMPLETE = "converted.ok"  # written last, so a folder holding it is whole


def cache_root() -> Path:
    """Where compress keeps what it can rebuild (`COMPRESS_CACHE_DIR` first)."""
    if os.environ.get("COMPRESS_CACHE_DIR"):
        return Path(os.environ["COMPRESS_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "compress"


def cache_key(gguf: Path) -> str:
    """The GGUF's name, size and modification time: a changed file gets a new folder."""
    facts = gguf.stat()
    return f"{gguf.stem}-{facts.st_size}-{facts.st_mtime_ns}"


def tokenizer_folder(gguf: Path) -> Path:
    """A folder holding the tokenizer (and chat template) that `gguf` carries."""
    def write(folder: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)

    return _converted(cache_root() / "gguf" / f"{cache_key(gguf)}-tokenizer", write)


def model_folder(gguf: Path) -> Path:
    """A Hugging Face folder with `gguf`'s weights dequantized to float32, its config and
    its tokenizer."""
    def write(folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_folder(gguf)).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model.hf_quantizer = None  # dequantized: it saves as the plain float model it is
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(folder)

    return _converted(cache_root() / "gguf" / f"{cache_key(gguf)}-float32", write)


def _converted(final: Path, write) -> Path:
    """`final`, written by `write(folder)` into a temporary sibling first when missing."""
    if (final / COMPLETE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write(scratch)
        (scratch / COMPLETE).write_text("")
        if final.exists() and not (final / COMPLETE).is_file():
            shutil.rmtree(final, ignore_errors=True)  # an earlier conversion, cut short
        try:
            scratch.rename(final)
        except OSError:  # another process renamed its whole folder into place first
            if not (final / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final
