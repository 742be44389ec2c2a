"""2:4 semi-structured sparse Linears against dense float16 ones on a CUDA GPU: the same
weights pruned 2:4 by magnitude, once as dense float16 matrices and once turned by
`compress.algorithms.semi_structured_gpu.to_semi_structured` into PyTorch's semi-structured
tensors (cuSPARSELt, PyTorch's default backend). Cases: MiniLM's products one by one
(hidden 384, FFN 1536: 384x384, 1536x384, 384x1536), MiniLM's six layers of Linears chained
(4 x 384x384, 384->1536, 1536->384 a layer), and a stack of eight 4096x4096 Linears, each
at 8x128 and 32x128 tokens. Times come from CUDA events around `--iters` calls, the two
variants alternating over `--rounds` rounds in one process, each called eagerly and replayed
from a CUDA graph (`semi_structured_gpu.graphed`): eager cuSPARSELt calls spend ~0.5 ms of
host time each setting up their plan, which the graph replay skips. The table gives the
median ms a call, the graph's spread (lowest-highest round) and dense / sparse. About 40 s
on an H100.

    python -m benchmarks.gpu.sparse24             # writes benchmarks/results/sparse24_gpu.md
    python -m benchmarks.gpu.sparse24 --rounds 5 --out /tmp/sparse24.md

Without a CUDA GPU of compute capability 8.0+ it exits 2 with one line.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness.paths import RESULTS as RESULTS_DIR
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from compress.algorithms.semi_structured import prune_n_m
from compress.algorithms.semi_structured_gpu import (
    graphed,
    require_sparse_gpu,
    sparse_backend,
    to_semi_structured,
)
from compress.errors import CompressError

RESULTS = RESULTS_DIR / "sparse24_gpu.md"
TOKENS = ((8, 128), (32, 128))  # batch x sequence
HIDDEN, FFN, LAYERS = 384, 1536, 6


def minilm_linears() -> nn.Sequential:
    """MiniLM's Linears of six layers chained: q, k, v, attention out, up, down."""
    shapes = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, FFN), (FFN, HIDDEN)]
    return nn.Sequential(*[nn.Linear(i, o) for _ in range(LAYERS) for i, o in shapes])


def cases() -> list[tuple[str, nn.Module, int]]:
    """(name, module, input width) of every case, on the CPU in float32."""
    return [
        ("MiniLM q/k/v/o 384x384", nn.Linear(HIDDEN, HIDDEN), HIDDEN),
        ("MiniLM up 1536x384", nn.Linear(HIDDEN, FFN), HIDDEN),
        ("MiniLM down 384x1536", nn.Linear(FFN, HIDDEN), FFN),
        ("MiniLM 6 layers' Linears chained", minilm_linears(), HIDDEN),
        ("8 x 4096x4096 stack", nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]), 4096),
    ]


def pair(module: nn.Module) -> tuple[nn.Module, nn.Module, int]:
    """The module pruned 2:4 as dense float16 on CUDA, and its semi-structured copy; and
    how many Linears were converted."""
    torch.manual_seed(0)
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.normal_(layer.weight, std=layer.in_features ** -0.5)
    prune_n_m(dict(module.named_modules()), 2, 4)
    dense = module.half().cuda().eval()
    sparse = copy.deepcopy(dense)
    converted = to_semi_structured(sparse)
    if converted.skipped:
        raise CompressError(f"left dense: {converted.skipped}")
    return dense, sparse, len(converted.converted)


def time_calls(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               iters: int) -> float:
    """Milliseconds a call, by CUDA events around `iters` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@torch.inference_mode()
def measure(name: str, module: nn.Module, width: int, rounds: int, iters: int) -> list[dict]:
    """Each token shape's times: the four variants (dense and 2:4, eager and replayed from a
    CUDA graph) alternating over `rounds` rounds."""
    dense, sparse, count = pair(module)
    rows = []
    for batch, length in TOKENS:
        x = torch.randn(batch, length, width, device="cuda", dtype=torch.float16)
        want, got = dense(x).float(), sparse(x).float()
        error = float((got - want).abs().max() / want.abs().max())
        variants = {"dense": dense, "sparse": sparse,
                    "dense graph": graphed(dense, x), "sparse graph": graphed(sparse, x)}
        for call in variants.values():  # warm-up: cuSPARSELt plans, cuBLAS heuristics
            time_calls(call, x, 3)
        times: dict[str, list[float]] = {label: [] for label in variants}
        for r in range(rounds):
            order = list(variants.items())
            for label, call in order if r % 2 == 0 else order[::-1]:
                times[label].append(time_calls(call, x, iters))
        rows.append({"case": name, "linears": count, "tokens": f"{batch}x{length}",
                     "error": error, **times})
    del dense, sparse, variants
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | Linears | tokens | dense eager ms | 2:4 eager ms | dense / 2:4 eager "
             "| dense graph ms (spread) | 2:4 graph ms (spread) | dense / 2:4 graph "
             "| max rel. diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        d, s = statistics.median(row["dense"]), statistics.median(row["sparse"])
        dg, sg = statistics.median(row["dense graph"]), statistics.median(row["sparse graph"])
        lines.append(
            f"| {row['case']} | {row['linears']} | {row['tokens']} | {d:.4f} | {s:.4f} "
            f"| {d / s:.2f}x | {dg:.4f} ({min(row['dense graph']):.4f}-"
            f"{max(row['dense graph']):.4f}) | {sg:.4f} ({min(row['sparse graph']):.4f}-"
            f"{max(row['sparse graph']):.4f}) | **{dg / sg:.2f}x** | {row['error']:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=50, help="calls timed per round")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        require_sparse_gpu()
    except CompressError as exc:
        print(f"sparse24_gpu: {exc}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    rows = [row for name, module, width in cases()
            for row in measure(name, module, width, args.rounds, args.iters)]
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# sparse24_gpu: 2:4 semi-structured Linears against dense fp16 on a GPU", "",
        *header_lines(results_header("benchmarks.gpu.sparse24",
                                     sys.argv[1:] if argv is None else argv)),
        f"- device: {props.name}, compute capability {props.major}.{props.minor}, "
        f"{props.multi_processor_count} SMs; CUDA {torch.version.cuda}, backend "
        f"{sparse_backend().BACKEND}",
        f"- {args.rounds} alternating rounds of {args.iters} calls in one process, "
        f"CUDA events; medians, spread = lowest-highest round; "
        f"{time.perf_counter() - began:.0f} s",
        "- max rel. diff: the largest |2:4 - dense| over the largest |dense| of the outputs",
        "- eager: the modules called from Python; graph: the same call captured once in a "
        "CUDA graph and replayed (a new input copied in), which removes the host time",
        "", *table(rows), ""]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    temporary = args.out.with_suffix(".tmp")
    temporary.write_text(scrubbed("\n".join(lines)))
    temporary.replace(args.out)
    print(f"sparse24_gpu: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
