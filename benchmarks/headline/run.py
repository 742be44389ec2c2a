"""The project's headline ratios, measured on this machine, side by side.

Runs each shipped recipe with `python -m compress run recipes/<name>.yaml output_dir=<runs
dir> [overrides]` in a subprocess (so a re-run reuses every cached stage), reads the run
folders' manifest.json, serves the bert_int8 archive with TorchServe and load-tests it,
then prints one table. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.headline.run
    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.headline.run --shrink \
        --runs-dir /tmp/bench_runs --recipes bert_int8
    python -m benchmarks.headline.run --recipes bert_int8 bert_onnx_int8 --skip-serve \
        --json headline.json

`--shrink` appends, per recipe, the overrides the integration tests use (800 training
sentences, 200 evaluation sentences, 40 fine-tuning steps, batch 8 timing only: a few
minutes per recipe on 2 cores). COMPRESS_DATA_DIR defaults to ../shared/data when that
mirror exists. Each recipe's `compress run` output goes to `<runs dir>/<recipe>.log`.

What every row compares: see benchmarks/headline/ratios.py.

Served: the bert_int8 package behind TorchServe (auth on, a free loopback port), swept at
concurrency 1, 8 and 32 with `compress.serving.loadtest.predictions.sweep`; throughput at 32 /
throughput at 1 and the mean observed batch size at 32. The sweep is written to the run
folder's loadtest.json.

Exit code 1 when any recipe or the load test failed (the others are still reported).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.paths import REPO, default_data_dir
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from benchmarks.headline.ratios import (
    SERVED_RECIPE,
    hardware,
    headline_rows,
    render,
    served_figures,
)
from compress.runfolder.records import read_manifest

DEFAULT_RECIPES = ("bert_int8", "bert_onnx_int8", "bert_distill_prune_int8")
CONCURRENCIES = (1, 8, 32)

# tests/conftest.py SHRUNK_SST2 and the per-recipe overrides of the integration tests
# (tests/integration/test_recipes_end_to_end.py); bert_onnx_int8 has no integration test and
# takes bert_int8's (fine-tune 40 steps, calibrate on 64 sentences).
SHRUNK_SST2 = ["data.train.max_samples=800", "data.eval.max_samples=200",
               "data.calibration.max_samples=64", "evaluation.latency.iters=3",
               "evaluation.latency.warmup=1", "evaluation.latency.batch_sizes=[8]"]
_SHORT_FINETUNE = ["stages.0.max_steps=40", "stages.0.learning_rate=2e-4"]
SHRINK_OVERRIDES: dict[str, list[str]] = {
    "bert_finetune": ["data.train.max_samples=1600", "data.eval.max_samples=200",
                      "stages.0.checkpoint_every=10", "stages.0.learning_rate=2e-4",
                      "evaluation.latency.iters=3", "evaluation.latency.warmup=1"],
    "bert_int8": [*SHRUNK_SST2, *_SHORT_FINETUNE, "stages.1.calibration.samples=64"],
    "bert_onnx_int8": [*SHRUNK_SST2, *_SHORT_FINETUNE, "stages.3.calibration.samples=64"],
    "bert_distill_prune_int8": [
        *SHRUNK_SST2, *_SHORT_FINETUNE, "stages.1.max_steps=40",
        "stages.1.learning_rate=2e-4", "stages.2.recovery.max_steps=10",
        "stages.3.qat.max_steps=10", "stages.3.calibration.samples=64"],
    "cnn_digits": [],  # seconds as it is
}



# ---------------------------------------------------------------------------------------------
# Running recipes and the load test


def recipe_path(name: str) -> Path:
    """recipes/<name>.yaml, or `name` itself when it is a path to a YAML file."""
    if name.endswith((".yaml", ".yml")):
        return Path(name).resolve()
    return REPO / "recipes" / f"{name}.yaml"


def recipe_overrides(name: str, shrink: bool) -> list[str]:
    """The overrides appended to `compress run` for this recipe."""
    if not shrink:
        return []
    return list(SHRINK_OVERRIDES.get(Path(name).stem, []))


def run_recipe(recipe: Path, runs_dir: Path, overrides: list[str], log: Path
               ) -> tuple[Path, int]:
    """`python -m compress run RECIPE output_dir=RUNS_DIR OVERRIDES` with its output in
    `log`; (the run folder, the exit code)."""
    name = (yaml.safe_load(recipe.read_text()) or {}).get("name") or recipe.stem
    env = default_data_dir(dict(os.environ))
    command = [sys.executable, "-m", "compress", "run", str(recipe),
               f"output_dir={runs_dir}", *overrides]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                              cwd=REPO).returncode
    if code == 130:
        raise KeyboardInterrupt
    return runs_dir / name, code


def failure_reason(log: Path) -> str:
    """The last `error` line of a `compress run` log (its one-line failure message)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(text):
        low = line.lower()
        if "error" in low or "failed" in low:
            return line.strip()[:300]
    return (text[-1].strip()[:300] if text else "no output")


def serve_and_sweep(run_dir: Path, requests: int,
                    concurrencies: tuple[int, ...] = CONCURRENCIES) -> dict[str, Any]:
    """Serve the run's package with TorchServe on a free port (auth on), sweep it, write
    loadtest.json into the run folder and return the recorded sweep. The server is always
    stopped."""
    from compress.serving import server
    from compress.serving.loadtest.predictions import load_payloads, sweep
    from compress.serving.loadtest.report import record_result

    target = server.resolve_target(run_dir)

    def echo(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    # start() refuses a run someone already serves, and stops its own server if it fails
    info = server.start(target, port=server.free_ports(1)[0], auth=True, timeout_s=600,
                        echo=echo)
    try:
        headers = {"Authorization": f"Bearer {info['token']}"}
        result = sweep(info["url"], list(concurrencies), requests, load_payloads(None),
                       headers=headers, warmup=max(concurrencies))
        path = record_result(str(run_dir), result)  # reads serve/server.json
    finally:
        server.stop(target.serve_dir)
    return json.loads(Path(path).read_text())


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # run the finally blocks (stop the server) on SIGTERM


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run the shipped recipes and print their headline ratios side by side.")
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        help="recipe names under recipes/ (or YAML paths); default: "
                             + " ".join(DEFAULT_RECIPES))
    parser.add_argument("--runs-dir", default="runs/bench", type=Path,
                        help="output_dir of the runs (one folder per recipe); default "
                             "runs/bench")
    parser.add_argument("--shrink", action="store_true",
                        help="the integration tests' overrides: a few minutes per recipe")
    parser.add_argument("--skip-serve", action="store_true",
                        help=f"no TorchServe load test of {SERVED_RECIPE}")
    parser.add_argument("--requests", type=int, default=200,
                        help="load test requests per concurrency level (default 200)")
    parser.add_argument("--json", type=Path, metavar="FILE",
                        help="also write every figure as JSON to FILE")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the recipes, the load test and print the report; 0, or 1 when anything failed."""
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    runs_dir = args.runs_dir.resolve()
    run_dirs: dict[str, Path] = {}
    recipes: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for name in args.recipes:
        label = Path(name).stem
        recipe = recipe_path(name)
        log = runs_dir / f"{label}.log"
        if not recipe.is_file():
            failures.append(f"{label}: FAILED: no recipe at {recipe}")
            recipes[label] = {"status": "failed", "error": f"no recipe at {recipe}"}
            print(failures[-1], file=sys.stderr, flush=True)
            continue
        overrides = recipe_overrides(name, args.shrink)
        if args.shrink and label not in SHRINK_OVERRIDES:
            print(f"{label}: no --shrink overrides known; running it as it is",
                  file=sys.stderr)
        print(f"{label}: running (log {log})", file=sys.stderr, flush=True)
        began = time.perf_counter()
        run_dir, code = run_recipe(recipe, runs_dir, overrides, log)
        wall = time.perf_counter() - began
        recipes[label] = {"run_dir": str(run_dir), "returncode": code, "log": str(log),
                          "overrides": overrides, "wall_s": round(wall, 1)}
        if code != 0:
            reason = failure_reason(log)
            failures.append(f"{label}: FAILED (exit {code}): {reason} (log {log})")
            recipes[label].update(status="failed", error=reason)
            print(failures[-1], file=sys.stderr, flush=True)
            continue
        manifest = read_manifest(run_dir)
        cached = sum(s.status == "cached" for s in manifest.stages) if manifest else 0
        print(f"{label}: done in {wall:.0f} s ({cached} cached stages)", file=sys.stderr,
              flush=True)
        recipes[label]["status"] = "ok"
        run_dirs[label] = run_dir

    served = served_error = None
    if not args.skip_serve and SERVED_RECIPE in run_dirs:
        print(f"{SERVED_RECIPE}: serving and load-testing ({args.requests} requests per "
              f"level at concurrency {', '.join(map(str, CONCURRENCIES))})", file=sys.stderr,
              flush=True)
        try:
            served = served_figures(serve_and_sweep(run_dirs[SERVED_RECIPE], args.requests))
        except Exception as exc:  # one line, then the rest of the report
            served_error = f"{type(exc).__name__}: {exc}"

    rows = headline_rows(run_dirs)
    hw = hardware(run_dirs)
    header = results_header("benchmarks.headline.run", args.argv)
    print("\n".join(header_lines(header)))  # then the runs' own machines (their manifests)
    print(render(rows, hw, served, served_error, failures), end="")
    if args.json:
        args.json.write_text(json.dumps(scrubbed({
            "header": header, "hardware": hw, "recipes": recipes, "rows": rows,
            "served": served, "served_error": served_error, "failures": failures}),
            indent=2) + "\n")
    return 1 if failures or served_error else 0


if __name__ == "__main__":
    sys.exit(main())
