"""The project's headline ratios, measured on this machine, side by side.

Runs each shipped recipe with `python -m compress run recipes/<name>.yaml output_dir=<runs
dir> [overrides]` in a subprocess (so a re-run reuses every cached stage), reads the run
folders' manifest.json, serves the bert_int8 archive with TorchServe and load-tests it,
then prints one table. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python benchmarks/headline.py
    COMPRESS_DATA_DIR=../shared/data python benchmarks/headline.py --shrink \
        --runs-dir /tmp/bench_runs --recipes bert_int8
    python benchmarks/headline.py --recipes bert_int8 bert_onnx_int8 --skip-serve \
        --json headline.json

`--shrink` appends, per recipe, the overrides the integration tests use (800 training
sentences, 200 evaluation sentences, 40 fine-tuning steps, batch 8 timing only: a few
minutes per recipe on 2 cores). COMPRESS_DATA_DIR defaults to ../shared/data when that
mirror exists. Each recipe's `compress run` output goes to `<runs dir>/<recipe>.log`.

What every row compares (all figures from one run folder, see `headline_rows`):

- latency × = the model's median latency / the reference's median latency at the largest
  batch size the recipe times (`latency_ms_bN`). When the reference is the model that
  entered the stage, both medians come from that stage's own process: `latency_ms_bN /
  input_latency_ms_bN` ("same process"). Otherwise the two stages' own medians are divided:
  `latency_ms_bN / reference latency_ms_bN` ("separate timings"). Below 1 is faster.
- Δ acc pt = 100 * (accuracy - reference accuracy); size × = size_mb / reference size_mb.
- Each measured stage is compared with the model that entered it, with the recipe's first
  fine-tuned model (the fp32 reference / teacher) when that is not its input, and, for an
  ONNX Runtime int8 export, with the fp32 ONNX export of the same model.
- A row is flagged noisy when a median it uses was marked noisy by the harness
  (`latency_noisy_batches`: p90 more than 25% above p50).

Served: the bert_int8 package behind TorchServe (auth on, a free loopback port), swept at
concurrency 1, 8 and 32 with `serve.loadtest.sweep`; throughput at 32 / throughput at 1 and
the mean observed batch size at 32. The sweep is written to the run folder's loadtest.json.

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

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECIPES = ("bert_int8", "bert_onnx_int8", "bert_distill_prune_int8")
SERVED_RECIPE = "bert_int8"
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

FINISHED = ("done", "cached")
NOISY_SPREAD = 0.25  # compress.bench's threshold, also used to cross-check input timings


# ---------------------------------------------------------------------------------------------
# Ratios from run folders (pure: no model is run)


def read_manifest(run_dir: str | Path) -> dict[str, Any] | None:
    """The run folder's manifest.json, or None when it is missing or unreadable."""
    try:
        return json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def largest_batch(manifest: dict[str, Any]) -> int | None:
    """The largest batch size the recipe times (evaluation.latency.batch_sizes)."""
    latency = ((manifest.get("recipe") or {}).get("evaluation") or {}).get("latency") or {}
    batches = latency.get("batch_sizes") or []
    return max(batches) if batches else None


def runtime_of(entry: dict[str, Any], stages: list[dict[str, Any]] | None = None) -> str:
    """A short label of the runtime a stage's model is measured in (`stages`, the manifest's
    stages, tell whether an AOTInductor package holds a PT2E int8 model)."""
    kind, config = entry.get("kind"), entry.get("config") or {}
    metrics = entry.get("metrics") or {}
    if kind == "quantize":
        return f"PT2E int8 {config.get('mode', 'static')}"
    if kind == "export":
        fmt = config.get("format") or metrics.get("runtime") or "?"
        label = {"onnx": "ONNX Runtime", "aoti": "AOTInductor .pt2",
                 "torchscript": "TorchScript", "tensorrt": "TensorRT"}.get(fmt, fmt)
        quantize = config.get("quantize") or metrics.get("onnx_quantize")
        if fmt == "onnx":
            return label + (f" int8 {quantize}" if quantize else " fp32")
        if fmt == "aoti":
            producer = _producer(entry, stages or [])
            return label + (" int8" if producer and producer.get("kind") == "quantize"
                            else "")
        return label
    if kind == "compile":
        return "torch.compile"
    if kind == "distill":
        return "distilled student, eager"
    if kind == "prune":
        return "pruned, eager"
    return "PyTorch eager"


def _finished(entry: dict[str, Any]) -> bool:
    return entry.get("status") in FINISHED


def _producer(entry: dict[str, Any], stages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The stage whose output is this stage's input (matched by sha256), if any."""
    inputs = entry.get("inputs") or []
    sha = inputs[0].get("sha256") if inputs else None
    if not sha:
        return None
    found = None
    for other in stages:
        if other is entry:
            break
        if any(out.get("sha256") == sha for out in other.get("outputs") or []):
            found = other
    return found


def _reference_stage(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The recipe's first fine-tuned model (the fp32 reference, the teacher), if finished."""
    for entry in manifest.get("stages") or []:
        if entry.get("kind") == "finetune" and _finished(entry):
            return entry
    return None


def _is_int8_onnx(entry: dict[str, Any]) -> bool:
    config = entry.get("config") or {}
    return (entry.get("kind") == "export" and config.get("format") == "onnx"
            and bool(config.get("quantize")))


def _fp32_onnx_sibling(entry: dict[str, Any], stages: list[dict[str, Any]]
                       ) -> dict[str, Any] | None:
    """The float ONNX export of the same input model as this ONNX int8 export."""
    sha = ((entry.get("inputs") or [{}])[0]).get("sha256")
    for other in stages:
        config = other.get("config") or {}
        if (other is not entry and other.get("kind") == "export"
                and config.get("format") == "onnx" and not config.get("quantize")
                and _finished(other)
                and ((other.get("inputs") or [{}])[0]).get("sha256") == sha):
            return other
    return None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare(recipe: str, entry: dict[str, Any], reference: dict[str, Any], batch: int,
            same_process: bool, stages: list[dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """One headline row: `entry`'s model against `reference`'s at batch `batch`.

    same_process: `reference` entered `entry`'s stage, so the denominator is the input median
    timed in that stage's process (`input_latency_ms_bN`); else the reference stage's own
    median (`latency_ms_bN`)."""
    m, r = entry.get("metrics") or {}, reference.get("metrics") or {}
    key = f"latency_ms_b{batch}"
    latency = m.get(key)
    ref_latency = m.get(f"input_{key}") if same_process else r.get(key)
    notes = []
    if batch in (m.get("latency_noisy_batches") or []):
        notes.append(f"noisy b{batch}")
    if not same_process and batch in (r.get("latency_noisy_batches") or []):
        notes.append(f"noisy b{batch} in {reference['name']}")
    own = r.get(key)  # the input's median in its own stage: a cross-check of the input timing
    if same_process and ref_latency and own and abs(ref_latency - own) / own > NOISY_SPREAD:
        notes.append(f"noisy: input timed {ref_latency:.2f} ms here, {own:.2f} ms in "
                     f"{reference['name']}")
    accuracy, ref_accuracy = m.get("accuracy"), r.get("accuracy")
    delta = (100 * (accuracy - ref_accuracy)
             if accuracy is not None and ref_accuracy is not None else None)
    row = {
        "recipe": recipe, "status": "ok",
        "path": f"{recipe}/{entry['name']}", "stage": entry["name"],
        "runtime": runtime_of(entry, stages),
        "reference": reference["name"], "reference_runtime": runtime_of(reference, stages),
        "batch": batch, "latency_ms": latency, "reference_latency_ms": ref_latency,
        "latency_ratio": _ratio(latency, ref_latency),
        "timing": "same process" if same_process else "separate timings",
        "accuracy": accuracy, "reference_accuracy": ref_accuracy, "accuracy_delta_pt": delta,
        "size_mb": m.get("size_mb"), "reference_size_mb": r.get("size_mb"),
        "size_ratio": _ratio(m.get("size_mb"), r.get("size_mb")),
        "noisy": bool(notes), "notes": notes,
    }
    if latency is None or ref_latency is None:
        row["notes"].append(f"no b{batch} latency")
    row["notes"].append(row["timing"])
    return row


def recipe_rows(recipe: str, run_dir: str | Path) -> list[dict[str, Any]]:
    """The headline rows of one run folder (see the module docstring for what is compared);
    one row with status "missing" when the folder has no readable manifest."""
    manifest = read_manifest(run_dir)
    if manifest is None:
        return [{"recipe": recipe, "status": "missing", "path": f"{recipe}/-",
                 "run_dir": str(run_dir),
                 "notes": [f"no readable manifest.json in {run_dir}"]}]
    batch = largest_batch(manifest)
    stages = manifest.get("stages") or []
    reference = _reference_stage(manifest)
    rows: list[dict[str, Any]] = []
    for entry in stages:
        if entry is reference or entry.get("kind") == "package":
            continue
        if not _finished(entry):
            rows.append({"recipe": recipe, "status": entry.get("status", "unknown"),
                         "path": f"{recipe}/{entry.get('name')}", "stage": entry.get("name"),
                         "run_dir": str(run_dir),
                         "notes": [entry.get("error") or f"stage {entry.get('status')}"]})
            continue
        if batch is None or f"latency_ms_b{batch}" not in (entry.get("metrics") or {}):
            continue  # not a measured model
        producer = _producer(entry, stages)
        pairs: list[tuple[dict[str, Any], bool]] = []
        if producer is not None and _finished(producer):
            pairs.append((producer, True))
        if reference is not None and reference is not producer:
            pairs.append((reference, False))
        sibling = _fp32_onnx_sibling(entry, stages) if _is_int8_onnx(entry) else None
        if sibling is not None and sibling is not producer:
            pairs.append((sibling, False))
        for other, same in pairs:
            row = compare(recipe, entry, other, batch, same, stages)
            row["run_dir"] = str(run_dir)
            rows.append(row)
    return rows


def headline_rows(run_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    """Every headline row of every run folder ({recipe name: run folder}), in that order."""
    rows: list[dict[str, Any]] = []
    for recipe, run_dir in run_dirs.items():
        rows += recipe_rows(recipe, run_dir)
    return rows


def hardware(run_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    """The distinct environments (CPU model, cores, threads, libraries) of the manifests."""
    seen: list[dict[str, Any]] = []
    for recipe, run_dir in run_dirs.items():
        manifest = read_manifest(run_dir)
        if manifest is None:
            continue
        env = manifest.get("environment") or {}
        cpu = env.get("cpu") or {}
        libs = env.get("libraries") or {}
        item = {"cpu": cpu.get("model"), "cores": cpu.get("cores"),
                "threads": env.get("threads"),
                "isa": [flag for flag, on in (cpu.get("isa") or {}).items() if on],
                "libraries": {k: libs[k] for k in ("torch", "torchao", "onnxruntime")
                              if k in libs}}
        machine = ("cpu", "cores", "threads", "isa")
        same = next((s for s in seen if all(s[k] == item[k] for k in machine)), None)
        if same:
            same["recipes"].append(recipe)
            same["libraries"].update(item["libraries"])
        else:
            seen.append({**item, "recipes": [recipe]})
    return seen


def served_figures(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """Throughput at the highest / the lowest concurrency and the mean batch size at the
    highest, from a `serve.loadtest.sweep` result (or loadtest.json); None without runs."""
    runs = (result or {}).get("runs") or []
    if not runs:
        return None
    high = max(runs, key=lambda r: r["concurrency"])
    low = min(runs, key=lambda r: r["concurrency"])
    return {"high_concurrency": high["concurrency"], "low_concurrency": low["concurrency"],
            "throughput_rps_high": high.get("throughput_rps"),
            "throughput_rps_low": low.get("throughput_rps"),
            "throughput_ratio": _ratio(high.get("throughput_rps"), low.get("throughput_rps")),
            "batch_size_mean_high": high.get("batch_size_mean"),
            "batch_size_max_high": high.get("batch_size_max"),
            "latency_ms_p50_low": low.get("latency_ms_p50"),
            "latency_ms_p50_high": high.get("latency_ms_p50"),
            "errors": sum(r.get("errors") or 0 for r in runs),
            "requests_per_level": high.get("requests"),
            "server_settings": (result or {}).get("server_settings"),
            "measured": (result or {}).get("measured")}


# ---------------------------------------------------------------------------------------------
# Presentation


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(rows: list[dict[str, Any]], hw: list[dict[str, Any]],
           served: dict[str, Any] | None = None, served_error: str | None = None,
           failures: list[str] | None = None) -> str:
    """The plain fixed-width report: hardware, the table, the served line, failures."""
    lines = []
    for item in hw:
        libs = ", ".join(f"{k} {v}" for k, v in item["libraries"].items())
        lines.append(f"hardware: CPU {item['cpu']}, {item['cores']} cores, {item['threads']} "
                     f"threads, ISA {' '.join(item['isa']) or '-'}; {libs} "
                     f"({', '.join(item['recipes'])})")
    batches = sorted({r["batch"] for r in rows if r.get("batch") is not None})
    if batches:
        shown = ", ".join(f"b{b}" for b in batches)
        lines.append(f"latency × = model median / reference median at the largest timed "
                     f"batch ({shown}); below 1 is faster. Δ acc in points, size × = MB / "
                     f"reference MB.")
    head = ["path", "compared", "latency ×", "ms model / ref", "Δ acc pt", "size ×", "notes"]
    table = []
    for r in rows:
        if r.get("status") != "ok":
            table.append([r["path"], r["status"].upper(), "-", "-", "-", "-",
                          "; ".join(r.get("notes") or [])])
            continue
        ms = f"{_num(r['latency_ms'], 2)} / {_num(r['reference_latency_ms'], 2)}"
        table.append([r["path"],
                      f"{r['runtime']} vs {r['reference']} ({r['reference_runtime']})",
                      _num(r["latency_ratio"], 3), ms, _num(r["accuracy_delta_pt"], 2),
                      _num(r["size_ratio"], 3), "; ".join(r["notes"])])
    if table:
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
        right = {2, 3, 4, 5}

        def fmt(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                             ).rstrip()

        lines += ["", fmt(head), fmt(["-" * w for w in widths])]
        lines += [fmt(row) for row in table]
    lines.append("")
    if served:
        settings = served.get("server_settings") or {}
        setup = (f"batch {settings.get('batchSize')}, delay {settings.get('maxBatchDelay')} ms, "
                 f"{settings.get('maxWorkers')} worker x {settings.get('threads_per_worker')} "
                 f"threads" if settings else "")
        lines.append(
            f"served {SERVED_RECIPE} (TorchServe{', ' + setup if setup else ''}): throughput "
            f"c{served['high_concurrency']} / c{served['low_concurrency']} = "
            f"{_num(served['throughput_ratio'], 2)}x ({_num(served['throughput_rps_high'], 1)}"
            f" / {_num(served['throughput_rps_low'], 1)} req/s), mean batch at "
            f"c{served['high_concurrency']} {_num(served['batch_size_mean_high'], 2)} "
            f"(max {served['batch_size_max_high']}), p50 "
            f"{_num(served['latency_ms_p50_low'], 1)} / "
            f"{_num(served['latency_ms_p50_high'], 1)} ms, {served['errors']} errors, "
            f"{served['requests_per_level']} requests per level")
    elif served_error:
        lines.append(f"served {SERVED_RECIPE}: FAILED: {served_error}")
    for failure in failures or []:
        lines.append(failure)
    return "\n".join(lines).rstrip() + "\n"


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
    env = dict(os.environ)
    mirror = REPO.parent / "shared" / "data"
    if not env.get("COMPRESS_DATA_DIR") and mirror.is_dir():
        env["COMPRESS_DATA_DIR"] = str(mirror)
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
    from compress.errors import UserError
    from serve import loadtest, server

    target = server.resolve_target(run_dir)
    running = server.read_info(target.serve_dir)
    if running and server.process_alive(running["pid"]):  # not ours: leave it alone
        raise UserError(f"{run_dir} is already served at {running['url']}; stop it with "
                        f"compress serve --stop {run_dir}")

    def echo(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    try:
        info = server.start(target, port=server.free_ports(1)[0], auth=True, timeout_s=600,
                            echo=echo)
        headers = {"Authorization": f"Bearer {info['token']}"}
        result = loadtest.sweep(info["url"], list(concurrencies), requests,
                                loadtest.load_payloads(None), headers=headers,
                                warmup=max(concurrencies))
        path = loadtest.record_result(str(run_dir), result)  # reads serve/server.json
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
    return parser.parse_args(argv)


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
        manifest = read_manifest(run_dir) or {}
        cached = sum(s.get("status") == "cached" for s in manifest.get("stages") or [])
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
    print(render(rows, hw, served, served_error, failures), end="")
    if args.json:
        args.json.write_text(json.dumps({"hardware": hw, "recipes": recipes, "rows": rows,
                                         "served": served, "served_error": served_error,
                                         "failures": failures}, indent=2) + "\n")
    return 1 if failures or served_error else 0


if __name__ == "__main__":
    sys.exit(main())
