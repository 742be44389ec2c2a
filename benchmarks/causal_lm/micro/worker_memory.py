"""Where a served causal-LM worker's memory goes: the proportional set size (PSS, from
/proc/self/smaps_rollup: a shared page counted once across the processes that map it) of a
fresh process after each step of a worker's start, as `serve/causal_lm/server/handler.py`
takes them (imports, the tokenizer and model through `load_folder`, the kernel library, the
state dict's copies of the weights released and freed memory returned to the system, the
decoders' KV cache for the rows, a warm-up generation of every row, a prefill of a prompt
for every row at once as the continuous batcher runs it, with the prefix cache on), and
what the model's
tensors hold by kind (the state dict's codes, scales and offsets; the kernels' records; the
float tensors left).

The folder is SmolLM2-135M from the shipped GGUF with a weight scheme applied as the
quantize stage applies it, written once into a temporary folder. Each scheme is measured
in a process of its own.

    python -m benchmarks.causal_lm.micro.worker_memory
    python -m benchmarks.causal_lm.micro.worker_memory --schemes int4_grouped --rows 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.provenance import header_text

MB = 1 << 20


def pss_mb() -> dict[str, float]:
    """This process's PSS, RSS and private anonymous memory, MB (smaps_rollup)."""
    fields: dict[str, float] = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[name] = int(parts[0]) / 1024
    return {"pss": fields.get("Pss", 0.0), "rss": fields.get("Rss", 0.0),
            "anonymous": fields.get("Anonymous", 0.0)}


def tensor_kinds(model: Any) -> dict[str, float]:
    """MB of the model's tensors (parameters and buffers, each storage once) by what they
    are: the records the kernels read, the state dict's codes / scales / offsets, float
    weights left."""
    import torch

    seen: dict[int, tuple[str, int]] = {}
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            kind = ("kernel records" if name == "packed" else
                    "codes" if name == "qweight" else
                    "scales and offsets" if name in ("scale", "offset") else
                    f"other {str(tensor.dtype).removeprefix('torch.')}")
            seen[storage.data_ptr()] = (kind, storage.nbytes())
    kinds: dict[str, float] = {}
    for kind, size in seen.values():
        kinds[kind] = kinds.get(kind, 0.0) + size / MB
    return kinds


def child(folder: Path, rows: int, cache_len: int) -> dict[str, Any]:
    """The stages of a worker's start in this process: (stage, PSS) pairs, the model's
    tensors by kind, the KV cache's bytes."""
    stages: list[tuple[str, dict[str, float]]] = [("python", pss_mb())]
    import torch

    stages.append(("import torch", pss_mb()))
    from serve import worker_imports

    worker_imports.leave_out(worker_imports.UNUSED + ("torchao",))  # as the handler does
    import transformers  # noqa: F401 (what a worker imports: its cost is measured)

    stages.append(("import transformers", pss_mb()))
    from serve.causal_lm.runtime.decode import StaticDecoder
    from serve.causal_lm.runtime.grouped import release_sources
    from serve.causal_lm.runtime.kernels import grouped_mm_available
    from serve.causal_lm.runtime.loading import load_folder
    from serve.worker_memory import return_freed_memory

    stages.append(("import the runtime", pss_mb()))
    grouped_mm_available()
    stages.append(("kernel library loaded", pss_mb()))
    lm = load_folder(folder)
    stages.append(("load_folder (tokenizer, weights, records)", pss_mb()))
    release_sources(lm.model)
    stages.append(("the state dict's copies released", pss_mb()))
    return_freed_memory()
    stages.append(("freed memory returned (malloc_trim)", pss_mb()))
    decoder = StaticDecoder(lm.model, cache_len, always_mask=True)
    decoder.allocate(rows, dynamic_rows=True)
    stages.append((f"KV cache allocated ({rows} rows x {cache_len})", pss_mb()))
    torch.set_num_threads(2)
    decoder.generate([[1, 2, 3]] * rows, 4)
    stages.append((f"a warm-up generation of {rows} rows", pss_mb()))
    cache = sum(t.nbytes for layer in decoder.cache.layers
                for t in (layer.keys, layer.values)) / MB
    prefiller = prefill_of(lm.model, rows, cache_len)
    stages.append((f"a prefill of {rows} prompts of {PROMPT} tokens at once", pss_mb()))
    held = prefiller.prefix_cache.stats() if prefiller.prefix_cache else {"bytes": 0}
    return {"stages": stages, "tensors": tensor_kinds(lm.model), "cache_mb": cache,
            "prefill_mb": prefiller.cache_bytes() / MB, "prefix_mb": held["bytes"] / MB}


PROMPT = 100  # tokens of each prompt the continuous batcher's prefill takes at once


def prefill_of(model: Any, rows: int, cache_len: int) -> Any:
    """The handler's prefiller (default settings: the prefix cache on) after a prefill of
    `rows` distinct prompts admitted together, as the continuous batcher runs one."""
    import torch

    from serve.causal_lm.runtime.attention import attention, decode_attention_for
    from serve.causal_lm.server.prefill import prefiller_of
    from serve.causal_lm.server.rows import Row
    from serve.handler_settings import HandlerSettings

    prefiller = prefiller_of(model, HandlerSettings(), cache_len)
    prompts = [[1 + (k * PROMPT + i) % 1000 for i in range(PROMPT)] for k in range(rows)]
    with torch.inference_mode(), attention(model, decode_attention_for(model)):
        job = prefiller.start([Row(ids, 1, lambda token, end: None) for ids in prompts])
        prefiller.step(job, whole=True)
    return prefiller


def make_folder(scheme: str, out: Path) -> Path:
    """SmolLM2-135M from the shipped GGUF, `scheme` applied as the quantize stage does."""
    import torch

    from benchmarks.causal_lm.inputs import MODEL
    from compress.families.causal_lm.folder import save_causal_lm
    from compress.families.causal_lm.model import load_causal_lm, quantize_weights
    from compress.models.bundle import ModelBundle
    from serve.causal_lm.runtime.loading import head_scheme_of

    lm = load_causal_lm(MODEL)
    head = head_scheme_of(scheme)
    with torch.no_grad():
        quantize_weights(lm.model, scheme, 32, head)
    facts = {"scheme": scheme, "dtype": "float32", "group_size": 32, "head_scheme": head}
    save_causal_lm(ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer,
                               causal_lm_facts=facts), out)
    return out


def table(scheme: str, found: dict[str, Any]) -> list[str]:
    lines = [f"{scheme}: PSS after each step of a worker's start (MB; RSS; added PSS)"]
    last = 0.0
    for stage, mem in found["stages"]:
        lines.append(f"  {stage:<46} {mem['pss']:8.1f}  rss {mem['rss']:8.1f}  "
                     f"+{mem['pss'] - last:7.1f}")
        last = mem["pss"]
    lines.append("  the model's tensors by kind (MB): " + ", ".join(
        f"{kind} {size:.1f}" for kind, size in sorted(found["tensors"].items())))
    lines.append(f"  the KV cache: {found['cache_mb']:.1f} MB; the prefill's workspace: "
                 f"{found.get('prefill_mb', 0):.1f} MB; the prefix cache: "
                 f"{found.get('prefix_mb', 0):.1f} MB")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="int8_grouped,int4_grouped")
    parser.add_argument("--rows", type=int, default=8, help="decode rows (8)")
    parser.add_argument("--cache-len", type=int, default=512, help="KV cache positions (512)")
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "ROWS", "CACHE_LEN"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), int(args.child[1]),
                               int(args.child[2]))))
        return 0
    print(header_text("benchmarks.causal_lm.micro.worker_memory", argv))
    with tempfile.TemporaryDirectory(prefix="worker_memory-") as tmp:
        for scheme in args.schemes.split(","):
            folder = make_folder(scheme, Path(tmp) / scheme)
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(folder),
                                   str(args.rows), str(args.cache_len)],
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                print(f"{scheme}: the child failed: {done.stderr.strip().splitlines()[-1:]}")
                continue
            found = json.loads(done.stdout.strip().splitlines()[-1])
            print("\n".join(table(scheme, found)))
            print(f"  ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
