"""Two model files timed as a new user would time them: each round loads each file in a
fresh Python process with nothing but its runtime (`torch._inductor.aoti_load_package` for a
`.pt2`, after `torch.ops.load_library` of any operator library beside it; a default
`onnxruntime.InferenceSession` for a `.onnx`; every core), runs the same
random token batch (default 8 x 128) a few times to warm up, then times `--iters` calls and
prints their median (`--json` keeps every round). Rounds alternate the order. The ratio of
the first file to the second is given by the median of the rounds' medians and by each
file's fastest round. From the repository root:

    python -m benchmarks.classifier.plain_pair \\
        runs/bert_search_chain/01-search/trials/WINNER/aoti/model.aoti.pt2 \\
        runs/bert_search_chain/peers/optimum_int8_O2/model.onnx --rounds 6

(`peers/optimum_int8_LEVEL/` is Optimum's int8 of the teacher at one `--optimize` level, as
benchmarks/classifier/peers.py builds it; `peers/<stage>-<shape>/optimum_int8_LEVEL/` the
same of the winner's student weights: take the level its table names.)

No compress code is imported by the timed processes (this module, run as `python -m
benchmarks.classifier.plain_pair --child`, imports the standard library and the harness's
standard-library modules alone). `--json` writes the rounds under the results header
(benchmarks/harness/provenance.py). Exit 2: a file missing or of a kind neither runtime
loads; 1: a timed process failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.provenance import header_lines, results_header, scrubbed, shown
from benchmarks.harness.rounds import child_env
from benchmarks.harness.spread import ratios, spread

KINDS = (".pt2", ".onnx")
MODULE = "benchmarks.classifier.plain_pair"


def child(path: str, batch: int, length: int, warmup: int, iters: int) -> float:
    """Load `path` alone; the median ms of `iters` calls on one random (batch, length)
    token batch."""
    import numpy as np

    ids = np.random.default_rng(0).integers(1000, 20000, (batch, length), dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             "token_type_ids": np.zeros_like(ids)}
    if path.endswith(".onnx"):
        import onnxruntime as ort

        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        feed = {name: feeds[name] for name in names}

        def call() -> None:
            session.run(None, feed)
    else:
        import torch

        for library in Path(path).parent.glob("*.so"):  # operators the package calls
            torch.ops.load_library(str(library))
        runner = torch._inductor.aoti_load_package(path)
        # the inputs compress exported, in order (its export.json beside the file)
        meta = Path(path).parent / "export.json"
        names = (json.loads(meta.read_text())["inputs"] if meta.is_file()
                 else ["input_ids", "attention_mask"])
        arguments = [torch.from_numpy(feeds[name]) for name in names]

        def call() -> None:
            with torch.inference_mode():
                runner(*arguments)
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_in_fresh_process(path: Path, args: argparse.Namespace) -> float:
    """One child process's median ms (its last stdout line)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.classifier.plain_pair", "--child", str(path),
         "--batch", str(args.batch), "--length", str(args.length), "--warmup", str(args.warmup),
         "--iters", str(args.iters)], capture_output=True, text=True, check=False,
        env=child_env())
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{path.name}: the timed process failed: {last}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="two files: ours, then the peer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the rounds and ratios here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(child(str(args.files[0]), args.batch, args.length, args.warmup, args.iters))
        return 0
    if len(args.files) != 2:
        print("error: give two files: ours, then the peer's", file=sys.stderr)
        return 2
    for path in args.files:
        if not path.is_file() or path.suffix not in KINDS:
            print(f"error: {path}: not a .pt2 or .onnx file", file=sys.stderr)
            return 2
    rounds: dict[Path, list[float]] = {path: [] for path in args.files}
    try:
        for r in range(args.rounds):
            for path in args.files if r % 2 == 0 else args.files[::-1]:
                rounds[path].append(time_in_fresh_process(path, args))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{p.name} {rounds[p][-1]:.1f} ms" for p in args.files), flush=True)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    ours, peer = (spread(rounds[path], "ms", digits=3) for path in args.files)
    for path, row in zip(args.files, (ours, peer), strict=True):
        print(f"{path}: median {row['ms_median']:.2f} ms (min {row['ms_min']:.2f}, max "
              f"{row['ms_max']:.2f}) over {args.rounds} rounds at {args.batch} x {args.length}")
    by_median, by_best = ratios(ours, peer, "ms", lower_is_better=True)
    print(f"x faster ({args.files[0].name} against {args.files[1].name}): {by_median:.2f} by "
          f"the median, {by_best:.2f} by the best round")
    if args.json:  # both files timed by the runtimes of compress's environment
        header = results_header(MODULE, sys.argv[1:] if argv is None else list(argv),
                                ours=("torch", "onnxruntime"))
        print("\n".join(header_lines(header)))
        args.json.write_text(json.dumps(scrubbed({
            "header": header, "batch": args.batch, "length": args.length, "iters": args.iters,
            "files": [shown(p) for p in args.files],
            "rounds_ms": [rounds[p] for p in args.files], "spread_ms": [ours, peer],
            "x_faster_median": by_median, "x_faster_best": by_best}), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
