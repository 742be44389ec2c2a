"""Serving under load and faults (issues 31, 39): a classifier run and, with --llm, a causal-LM
run, each served by `compress serve` on this machine (TorchServe, or --engine litserve).

- soak: `--requests` classifier requests (10,000) at concurrency `--concurrency` (32): errors,
  p50 / p99 / max latency, requests/s, and the server's resident memory (every process of its
  process group: the frontend and its workers) after a warm-up and after the run;
- kill: the worker process SIGKILLed in the middle of a load at concurrency 8, every request
  with a timeout: how many failed, whether any hung (none may), how long until requests
  succeeded again, whether a new worker came by itself;
- disconnect (--llm): 50 streaming clients, 40 of them leaving at random points: the others'
  text against one process's greedy text, then a full batch of 8;
- leavers and flood (--llm, benchmarks/soak/generation.py): 50 clients all leaving mid-stream, then
  the rows still decoding (0 within one step); more requests at once than rows plus the
  waiting queue: only 200s and 503s, memory within 1.2x warm, the server answers after;
  then 500 chat requests of 6 MB bodies (JSON whitespace): only 200s and 503s, the
  model's workers within 1.3x their warmed-up memory;
- property (--property-examples N): the property tests (tests/serving/test_*_property.py,
  any body among good ones) with N generated examples each (COMPRESS_PROPERTY_EXAMPLES).

    python -m benchmarks.soak.run runs/bert_int8 --llm runs/llm_int8 --property-examples 2000
    python -m benchmarks.soak.run --llm runs/llm_int8      # the causal-LM faults alone

writes benchmarks/results/soak.md (--out); `--requests 2000` for a short run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.harness.paths import REPO, RESULTS
from benchmarks.harness.provenance import header_lines, results_header, scrubbed
from benchmarks.soak import generation
from benchmarks.soak.generation import headers
from compress.serving import server
from compress.serving.loadtest.predictions import SAMPLE_TEXTS, run_load

# issue 70's property test of each served family (the embedding's and the reranker's share
# their module's server)
PROPERTY_TESTS = {
    "classifier": "tests/serving/test_classifier_property.py",
    "embedding": "tests/serving/test_embedding_served.py::"
                 "test_any_body_fails_alone_and_odd_valid_ones_answer_as_alone",
    "causal_lm": "tests/serving/test_causal_lm_property.py",
    "reranker": "tests/serving/test_reranker_served.py::"
                "test_any_body_fails_alone_and_odd_valid_ones_answer_as_alone"}
TALLY = "property cases ("  # how each property run's tally line begins
# in the command line of a TorchServe worker, or of a LitServe inference worker (spawned)
WORKER_MARKS = ("model_service_worker", "multiprocessing.spawn import spawn_main")


def group_pids(pid: int) -> list[int]:
    """The processes of `pid`'s process group (the server and its workers)."""
    group, found = os.getpgid(pid), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == group:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def resident_mb(pids: list[int]) -> float:
    """Resident memory of the processes `pids` together, MB (a gone one counts 0)."""
    total = 0
    for member in pids:
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return round(total / 1024, 1)


def rss_mb(pid: int) -> float:
    """Resident memory of `pid`'s process group, MB."""
    return resident_mb(group_pids(pid))


def workers_rss_mb(pid: int) -> float:
    """Resident memory of the model's workers of the server whose group `pid` leads, MB."""
    return resident_mb(worker_pids(pid))


def worker_pids(pid: int) -> list[int]:
    """The Python workers of the server whose process group `pid` leads."""
    found = []
    for member in group_pids(pid):
        try:
            command = Path(f"/proc/{member}/cmdline").read_text(errors="replace")
            if any(mark in command for mark in WORKER_MARKS):
                found.append(member)
        except OSError:
            continue
    return sorted(found)


def soak(info: dict, requests: int, concurrency: int, warmup: int) -> dict:
    """The long load: errors, latency percentiles, memory after warm-up and after."""
    payloads = [json.dumps({"text": t}).encode() for t in SAMPLE_TEXTS]
    if warmup:
        run_load(info["url"], concurrency, warmup, payloads, headers(info), timeout=60)
    warm = rss_mb(info["pid"])
    run = run_load(info["url"], concurrency, requests, payloads, headers(info), timeout=60)
    after = rss_mb(info["pid"])
    return {"requests": requests, "concurrency": concurrency, "errors": run["errors"],
            "rps": run["throughput_rps"], "p50_ms": run["latency_ms_p50"],
            "p99_ms": run["latency_ms_p99"], "max_ms": run["latency_ms_max"],
            "rss_warm_mb": warm, "rss_after_mb": after,
            "rss_ratio": round(after / warm, 3) if warm else None}


def kill_worker(info: dict, seconds: float = 30.0, kill_at: float = 3.0,
                concurrency: int = 8, timeout: float = 10.0) -> dict:
    """SIGKILL the worker `kill_at` seconds into a `seconds`-long load; every request's end
    (`hung`: those that got no answer within the client's `timeout`; `hung_started_s`: when
    each of them was sent, in seconds from the kill).

    TorchServe 0.12 drops the requests its frontend was collecting into a batch (within
    maxBatchDelay) when the worker dies at that moment: they never get an answer (the worker
    thread's `pollBatch` is interrupted and the jobs it held are lost; seen in about 1 of 5
    kills here). Other requests in flight get HTTP 507 at once."""
    parts = urlsplit(info["url"])
    body = json.dumps({"text": SAMPLE_TEXTS[0]}).encode()
    outcomes: list[tuple[float, float, str]] = []  # (start, end, "ok" | why not)
    lock, began = threading.Lock(), time.perf_counter()
    stop_at = began + seconds

    def client() -> None:
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            try:
                conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
                conn.request("POST", parts.path, body=body, headers=headers(info))
                answer = conn.getresponse()
                answer.read()
                conn.close()
                what = "ok" if answer.status == 200 else f"HTTP {answer.status}"
            except OSError as exc:  # refused, reset, timed out
                what = type(exc).__name__
            with lock:
                outcomes.append((start - began, time.perf_counter() - began, what))

    before = worker_pids(info["pid"])
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(kill_at)
    killed_at = time.perf_counter() - began
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    back_at = None
    while back_at is None and time.perf_counter() < stop_at + timeout:
        if set(worker_pids(info["pid"])) - set(before):
            back_at = time.perf_counter() - began
        time.sleep(0.05)
    for t in threads:
        t.join()
    failed = [o for o in outcomes if o[2] != "ok"]
    after = [o for o in outcomes if o[0] > killed_at]
    last_failure = max((o[1] for o in failed), default=killed_at)
    recovered = min((o[1] for o in after if o[2] == "ok" and o[0] >= last_failure),
                    default=None)
    return {"requests": len(outcomes), "failed": len(failed),
            "failures": sorted({o[2] for o in failed}),
            "hung": sum(o[1] - o[0] >= timeout for o in outcomes),
            "hung_started_s": sorted(round(o[0] - killed_at, 2) for o in outcomes
                                     if o[1] - o[0] >= timeout),  # from the kill
            "longest_s": round(max(o[1] - o[0] for o in outcomes), 2),
            "worker_back_s": None if back_at is None else round(back_at - killed_at, 2),
            "success_again_s": None if recovered is None else round(recovered - killed_at, 2)}


def served(run: Path, engine: str = "torchserve"):
    """Start `compress serve`'s `engine` on `run`; (target, info)."""
    target = server.resolve_target(run)
    (port,) = server.free_ports(1)
    return target, server.start(target, port=port, timeout_s=900, echo=lambda _: None,
                                engine=engine)


def property_tests(examples: int, families: list[str] | None = None,
                   engine: str | None = None, log: Path | None = None) -> dict:
    """pytest on the property tests of `families` (every one by default) on `engine` (both
    by default) with `examples` generated cases each: its counts, each run's tally line
    ("property cases (FAMILY, ENGINE): ..."), the tests that failed, and how long it took.
    pytest's whole output goes to `log` (where given), so that a failure can be read. One
    process (`-n 0`, over the project's default of a worker a core): the tallies are read from
    the tests' printed output, which xdist's workers do not pass on."""
    env = {**os.environ, "COMPRESS_PROPERTY_EXAMPLES": str(examples)}
    present = [PROPERTY_TESTS[f] for f in families or PROPERTY_TESTS
               if (REPO / PROPERTY_TESTS[f].split("::")[0]).is_file()]
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p",
                             "no:cacheprovider", *(["-k", engine] if engine else []),
                             *present], cwd=REPO, env=env, capture_output=True, text=True)
    if log is not None:
        log.write_text(result.stdout + result.stderr)
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in result.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|skipped)",
                                               summary)}
    # a tally line may follow pytest's progress marks on the same line (".", "F")
    tallies = [line[line.index(TALLY):].strip() for line in result.stdout.splitlines()
               if TALLY in line]
    return {"examples": examples, "files": present, "engine": engine or "both",
            "summary": summary, "returncode": result.returncode, "tallies": tallies,
            "failed_tests": failed, "log": str(log) if log else None,
            "seconds": round(time.perf_counter() - began), **counts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?",
                        help="a classifier run folder with a package stage (none: --llm only)")
    parser.add_argument("--llm", type=Path, help="a causal-LM run folder with a package stage")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--engine", choices=("torchserve", "litserve"), default="torchserve")
    parser.add_argument("--property-examples", type=int, default=0,
                        help="run the property tests with this many examples each (0: not)")
    parser.add_argument("--property-family", action="append", choices=sorted(PROPERTY_TESTS),
                        help="the property tests of this family only (again for more; "
                             "default: every one)")
    parser.add_argument("--property-engine", choices=("torchserve", "litserve"),
                        help="the property tests on this engine only (default: both)")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.md")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    figures: dict = {}
    if args.run is None and args.llm is None and not args.property_examples:
        parser.error("give a classifier run, --llm, --property-examples, or more of them")
    if args.run is not None:
        target, info = served(args.run, args.engine)
        try:
            figures["soak"] = soak(info, args.requests, args.concurrency, warmup=500)
            print("soak", figures["soak"], flush=True)
            figures["kill"] = kill_worker(info)
            print("kill", figures["kill"], flush=True)
        finally:
            server.stop(target.serve_dir)
    if args.llm:
        prompts = ["What is the capital of France?", "Write a haiku about the sea.",
                   "Name three primary colors.", "Why is the sky blue?"]
        expected = generation.offline_texts(args.llm, prompts, 48)
        target, info = served(args.llm, args.engine)
        try:
            figures["disconnect"] = generation.disconnects(info, prompts, expected, 48)
            print("disconnect", figures["disconnect"], flush=True)
            figures["leavers"] = generation.leavers(info, prompts, 48)
            print("leavers", figures["leavers"], flush=True)
            figures["flood"] = generation.flood(info, prompts, 48, rss=rss_mb)
            print("flood", figures["flood"], flush=True)
            figures["flood_large"] = generation.flood(
                info, prompts, 48, requests=500, rss=rss_mb,
                body_bytes=generation.LARGE_BODY_BYTES, workers_rss=workers_rss_mb)
            print("flood_large", figures["flood_large"], flush=True)
        finally:
            server.stop(target.serve_dir)
    if args.property_examples:
        figures["property"] = property_tests(args.property_examples, args.property_family,
                                             args.property_engine,
                                             args.out.with_suffix(".property.log"))
        print("property", figures["property"], flush=True)
    write_table(args, figures)
    return 0


def write_table(args: argparse.Namespace, figures: dict) -> None:
    lines = ["# Serving under load and faults", "",
             *header_lines(results_header("benchmarks.soak.run", args.argv)),
             # the engine of the soak, kill and LLM faults (the property runs name their own)
             *([f"- engine: {args.engine}"] if args.run or args.llm else [])]
    if "soak" in figures:
        lines += _classifier_lines(args.run, figures["soak"], figures["kill"])
    if "disconnect" in figures:
        d = figures["disconnect"]
        lines += ["", "| LM streaming clients | left mid-stream | stayed | stayed = offline "
                  "text | batch of 8 after = offline |", "|---|---|---|---|---|",
                  f"| {d['clients']} | {d['left']} | {d['stayed']} | "
                  f"{d['stayed_equal_offline']} / {d['stayed']} | "
                  f"{d['batch_after_equal_offline']} / 8 |"]
    lines += _lm_lines(figures)
    args.out.write_text(scrubbed("\n".join(lines) + "\n"))
    print(f"wrote {args.out}")


def _classifier_lines(run: Path, s: dict, k: dict) -> list[str]:
    """The table rows of the classifier's soak (`s`) and its worker killed (`k`)."""
    return ["", "| soak | requests | concurrency | errors | rps | p50 ms | p99 ms | max ms | "
            "RSS warm MB | RSS after MB | after / warm |", "|" + "---|" * 11,
            f"| {run.name} | {s['requests']} | {s['concurrency']} | {s['errors']} | "
            f"{s['rps']} | {s['p50_ms']} | {s['p99_ms']} | {s['max_ms']} | "
            f"{s['rss_warm_mb']} | {s['rss_after_mb']} | {s['rss_ratio']} |", "",
            "| worker SIGKILLed mid-load | requests | failed | failures | hung | longest s | "
            "worker back s | success again s |", "|" + "---|" * 8,
            "| concurrency 8, 30 s, kill at 3 s, client timeout 10 s | "
            f"{k['requests']} | {k['failed']} | "
            f"{', '.join(k['failures']) or '-'} | {k['hung']} | {k['longest_s']} | "
            f"{k['worker_back_s']} | {k['success_again_s']} |", "",
            "A known TorchServe 0.12 defect, not in this run's figures unless `hung` > 0: a "
            "worker killed while the frontend collects a batch (within maxBatchDelay) loses "
            "those requests, which then hang until the client's timeout (2 of 9 kills of the "
            "tiny classifier in development; `kill_worker`'s docstring)."]


def _lm_lines(figures: dict) -> list[str]:
    """The table rows of the leavers, the flood and the property tests."""
    lines = []
    if "leavers" in figures:
        v = figures["leavers"]
        lines += ["", "| LM clients all leaving mid-stream | statuses | rows decoding at the "
                  "first probe | probe's first token after the last left, ms | one step, ms |",
                  "|---|---|---|---|---|", f"| {v['clients']} | {v['statuses']} | "
                  f"{v['rows_at_first_probe']} | {v['first_probe_ms']} | {v['step_ms']} |"]
    floods = [figures[name] for name in ("flood", "flood_large") if name in figures]
    if floods:
        lines += ["", "| LM flood | body bytes | statuses | RSS warm MB | RSS peak MB | "
                  "peak / warm | workers' RSS warm MB | workers' peak MB | workers' peak / "
                  "warm | a request after | bound | ok |", "|" + "---|" * 12]
        lines += [f"| {f['requests']} at once | {f.get('body_bytes') or '-'} | "
                  f"{f['statuses']} | {f['rss_warm_mb']} | {f['rss_peak_mb']} | "
                  f"{f['rss_ratio']} | {f.get('workers_rss_warm_mb', '-')} | "
                  f"{f.get('workers_rss_peak_mb', '-')} | {f.get('workers_rss_ratio', '-')} | "
                  f"{f['after']} | {f['bound']} | {f['ok']} |" for f in floods]
    if "property" in figures:
        p = figures["property"]
        lines += ["", f"Property tests ({', '.join(p['files'])}; engine {p['engine']}) with "
                  f"COMPRESS_PROPERTY_EXAMPLES={p['examples']}: `{p['summary']}` in "
                  f"{p['seconds']} s" + (f" (pytest's output: `{p['log']}`)" if p.get("log")
                                         else "") + ".", ""]
        lines += [f"- {line}" for line in p["tallies"]]
        lines += [f"- failed: `{name}`" for name in p.get("failed_tests", [])]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
