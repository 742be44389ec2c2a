"""The arithmetic and the table of benchmarks/causal_lm/peers.py: weight bytes read per decoded
token, the share of the memory-bandwidth bound, medians over rounds, greedy agreement with
compress's float model, each compress row's ratio to llama.cpp on the comparable file (an
int4 row's to Q4_1, the same weights, and to Q4_0, llama.cpp's fastest 4-bit file, both),
and the text and Markdown tables. compress's TTFT is the prefill a served archive runs by
default; a compiled prefill, where it was timed too, has a column of its own that says it
is not the served default.

Pure functions over plain numbers and dicts, so unit tests check them without timing
anything (agreement is compress's `greedy_agreement`, whose module imports torch).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.provenance import header_lines
from benchmarks.harness.spread import cell, markdown_rows, ratio
from compress.families.causal_lm.model import greedy_agreement

FLOAT = "compress float"  # the greedy-agreement reference
REFERENCES = (FLOAT, "zentorch fp32")  # the first that ran: the same float weights
Q4_1, Q4_0 = "llama.cpp Q4_1", "llama.cpp Q4_0"
# each compress row against its peer: llama.cpp on the file with comparable weights, the
# first of them that ran (an int4 row: Q4_1, the shipped file and the same weights, like for
# like, else Q4_0, a second rounding of them); a 2:4 row against the dense grouped row of the
# same pruned model; a MoE row against the dense model's row of its scheme
PAIRS = {"compress int8_grouped": ("llama.cpp Q8_0",),
         "compress int4_grouped": (Q4_1, Q4_0),
         "compress int4": (Q4_1, Q4_0),
         "compress int8_grouped_a8": ("llama.cpp Q8_0",),
         "compress int4_grouped_a8": (Q4_1, Q4_0),
         "compress int8_grouped_bf16": ("llama.cpp Q8_0",),
         "compress int4_grouped_bf16": (Q4_1, Q4_0),
         # a 2:4 kernel against the dense grouped kernel on the same pruned weights
         "compress 2:4 int8_sparse24": ("compress 2:4 int8_grouped",),
         "compress 2:4 int4_sparse24": ("compress 2:4 int4_grouped",),
         # a mixture of experts made from the model against the dense model, same scheme
         "compress MoE int8_grouped": ("compress int8_grouped",),
         "compress MoE int4_grouped": ("compress int4_grouped",)}
# the int4 rows: each also against both of llama.cpp's 4-bit files (`int4_rows`)
INT4 = tuple(name for name, peers in PAIRS.items() if peers[0] == Q4_1)
INT4_PEERS = {"q4_1": Q4_1, "q4_0": Q4_0}  # key part -> row
MEASURED = ("tok_s_", "ttft_", "load_s")  # figures that vary by round: medians
COMPILED_TTFT = ("TTFT ms, compiled prefill (not the served default)", "ttft_compiled_ms", 1)
SERVED_TTFT = ("TTFT: the prompt in, the first token out; compress's through the prefill a "
               "served archive runs by default (the handler's prefill_compile)")

# (heading, key of a row, decimals)
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("b1 tok/s", "tok_s_b1", 1),
    ("b8 tok/s", "tok_s_b8", 1),
    ("TTFT ms", "ttft_ms", 1),
    ("ppl", "perplexity", 3),
    ("agree", "agreement", 3),
    # batch invariance: the share of positions where the b8 rows' greedy tokens are their
    # own b1 tokens (1.000: a row's answer does not depend on the batch)
    ("b8 = b1 tokens", "b8_agreement", 3),
    ("MB/token", "mb_per_token", 1),
    ("% bw b1", "pct_bandwidth_b1", 1),
    ("x peer b1", "x_peer_b1", 2),
    ("x peer b8", "x_peer_b8", 2),
    ("x peer TTFT", "x_peer_ttft", 2),
    ("b8 / b1", "b8_over_b1", 2),
)
ZENTORCH = ("- zentorch (its own environment, torch 2.13 CPU): the Hugging Face model from "
            "the same GGUF (float32, or cast to bf16), forward compiled by torch.compile("
            "backend=\"zentorch\"), generate on a static KV cache; zentorch.llm.optimize is "
            "deprecated in these releases (AMD points LLMs at its vLLM plugin)")


def bandwidth_share(bytes_per_token: float | None, tokens_per_s: float | None,
                    bandwidth_gbs: float | None) -> float | None:
    """bytes read per token x tokens per second / measured bandwidth: the share of the
    memory-bandwidth bound a decode reaches (None when a figure is missing)."""
    if not bytes_per_token or not tokens_per_s or not bandwidth_gbs:
        return None
    return bytes_per_token * tokens_per_s / (bandwidth_gbs * 1e9)


def best_bandwidth(runs: list[dict[str, Any]]) -> float | None:
    """The best triad bandwidth (GB/s) of the runs that succeeded."""
    return max((r["triad_gbs"] for r in runs if "error" not in r and r.get("triad_gbs")),
               default=None)


def median_over_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per measured key (`MEASURED` prefixes), the median of the rounds' numbers; other
    values (perplexity, greedy tokens, bytes per token...) are the first round's that has
    them (quality is measured in the first round only)."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        values = [r[key] for r in rounds if key in r]
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        merged[key] = (round(statistics.median(values), 3)
                       if key.startswith(MEASURED) and numbers else values[0])
    return merged


def table_rows(items: list[dict[str, Any]], bandwidth_gbs: float | None
               ) -> list[dict[str, Any]]:
    """One row per item ({"name", "runtime", "weights", "rounds": [child figures],
    "bytes_per_token"?, "error"?}), with medians, agreement with `FLOAT`, MB per token,
    the share of the bandwidth bound at batch 1 and the ratios of `PAIRS`."""
    rows = []
    for item in items:
        medians = median_over_rounds(item.get("rounds") or [])
        row = {"name": item["name"], "runtime": item.get("runtime", ""),
               "weights": item.get("weights", ""), "error": item.get("error"),
               "rounds": len(item.get("rounds") or []), **medians}
        row["bytes_per_token"] = row.get("bytes_per_token") or item.get("bytes_per_token")
        if row["bytes_per_token"]:
            row["mb_per_token"] = row["bytes_per_token"] / 1e6
        share = bandwidth_share(row["bytes_per_token"], row.get("tok_s_b1"), bandwidth_gbs)
        row["pct_bandwidth_b1"] = None if share is None else 100 * share
        rows.append(row)
    by_name = {row["name"]: row for row in rows}
    reference = next((by_name[n]["greedy"] for n in REFERENCES
                      if by_name.get(n, {}).get("greedy") is not None), None)
    for row in rows:
        greedy, rows_b8 = row.pop("greedy", None), row.pop("b8_rows", None)
        row["b8_agreement"] = (greedy_agreement(greedy[:len(rows_b8)], rows_b8)
                               if greedy is not None and rows_b8 is not None else None)
        row["agreement"] = (greedy_agreement(reference, greedy)
                            if reference is not None and greedy is not None else None)
        row["peer"] = next((n for n in PAIRS.get(row["name"], ()) if n in by_name), None)
        peer = by_name.get(row["peer"] or "", {})
        for batch in ("b1", "b8"):
            row[f"x_peer_{batch}"] = ratio(row.get(f"tok_s_{batch}"), peer.get(f"tok_s_{batch}"))
        row["x_peer_ttft"] = ratio(row.get("ttft_ms"), peer.get("ttft_ms"))
        row["b8_over_b1"] = ratio(row.get("tok_s_b8"), row.get("tok_s_b1"))
        if row["name"] in INT4:  # against both 4-bit files
            for key, name in INT4_PEERS.items():
                other = by_name.get(name, {})
                for batch in ("b1", "b8"):
                    row[f"x_{key}_{batch}"] = ratio(row.get(f"tok_s_{batch}"),
                                                    other.get(f"tok_s_{batch}"))
                row[f"x_{key}_ttft"] = ratio(row.get("ttft_ms"), other.get("ttft_ms"))
    return rows


# the int4 rows' table: (heading, key of a row, decimals)
INT4_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("ppl", "perplexity", 3), ("agree", "agreement", 3),
    ("x Q4_1 b1", "x_q4_1_b1", 2), ("x Q4_1 b8", "x_q4_1_b8", 2),
    ("x Q4_1 TTFT", "x_q4_1_ttft", 2),
    ("x Q4_0 b1", "x_q4_0_b1", 2), ("x Q4_0 b8", "x_q4_0_b8", 2),
    ("x Q4_0 TTFT", "x_q4_0_ttft", 2),
)


def int4_rows(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The int4 rows against both of llama.cpp's 4-bit files, each ratio beside the row's
    quality (perplexity, agreement): a heading and the body (none when no int4 row ran)."""
    head = ["row", *(c[0] for c in INT4_COLUMNS)]
    body = [[row["name"], *(cell(row.get(key), decimals) for _, key, decimals in INT4_COLUMNS)]
            for row in rows if row["name"] in INT4 and row.get("rounds")]
    return head, body


def _columns(rows: list[dict[str, Any]]) -> tuple[tuple[str, str, int], ...]:
    """`COLUMNS`, with the compiled prefill's TTFT after TTFT where a row has it."""
    if not any(row.get(COMPILED_TTFT[1]) is not None for row in rows):
        return COLUMNS
    at = next(i for i, c in enumerate(COLUMNS) if c[1] == "ttft_ms") + 1
    return (*COLUMNS[:at], COMPILED_TTFT, *COLUMNS[at:])


def _grid(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    columns = _columns(rows)
    head = ["row", "weights", *(c[0] for c in columns)]
    body = []
    for row in rows:
        if row.get("error") and not row.get("rounds"):
            figures = ["failed"] + ["-"] * (len(columns) - 1)
        else:
            figures = [cell(row.get(key), decimals) for _, key, decimals in columns]
        body.append([row["name"], row.get("weights") or "", *figures])
    return head, body


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per failed row and per figure a row says it could not measure."""
    lines = [f"{r['name']}: failed: {r['error']}" for r in rows if r.get("error")]
    lines += [f"{r['name']}: b8 {r['b8_note']}" for r in rows if r.get("b8_note")]
    lines += [f"{r['name']}: b8 rows agree with its batch-1 greedy tokens at "
              f"{r['b8_agreement']:.3f} of positions" for r in rows
              if r.get("b8_agreement") is not None and r["b8_agreement"] < 1]
    names = {r["name"] for r in rows}
    if any(r["name"] in INT4 for r in rows):
        lines += [f"no {name} row (not in --quants): the int4 rows have no ratio to it"
                  + (" (the same weights: the like-for-like ratio)" if name == Q4_1 else "")
                  for name in INT4_PEERS.values() if name not in names]
    return lines


def _aligned(head: list[str], body: list[list[str]], left: int) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()
            for line in [head, *body]]


def render_text(rows: list[dict[str, Any]]) -> str:
    """The table as aligned plain text, the int4 rows against both 4-bit files, then the
    notes."""
    lines = _aligned(*_grid(rows), left=2)
    head, body = int4_rows(rows)
    if body:
        lines += ["", "int4 rows against llama.cpp's two 4-bit files:", *_aligned(head, body, 1)]
    return "\n".join(lines + notes(rows)) + "\n"


def render_markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The table as Markdown under the results header (command, date, CPU, flags,
    versions: benchmarks/harness/provenance.py), the threads, rounds, token counts and the
    triad bandwidth; then what each column means."""
    head, body = _grid(rows)
    lines = [
        "# SmolLM2-135M-Instruct: compress against llama.cpp on the same GGUF, one invocation",
        "", *header_lines(header), f"- threads used: {header.get('threads', '?')}",
        f"- rounds: {header.get('rounds', '?')} (each row in a fresh process per round, "
        f"alternating order; medians over rounds); {header.get('tokens', '?')} new tokens "
        f"(EOS ignored), b8 on the first 8 prompts; TTFT on a {header.get('ttft_tokens', '?')}"
        f"-token prompt; perplexity on {header.get('ppl_texts', '?')} SST-2 validation "
        f"sentences; agreement on {header.get('prompts', '?')} chat prompts x "
        f"{header.get('greedy_tokens', '?')} greedy tokens",
        *([f"- compress's decode step: torch.compile {header['compress_step']} (cpp: "
           "Inductor's C++ wrapper, Dynamo's guards checked on each generation's first step; "
           "aoti: AOTInductor packages, no Dynamo, as a packaged archive serves)"]
          if header.get("compress_step") else []),
        *([f"- compress's TTFT: the prefill a served archive runs by default, "
           f"{header['served_prefill']}"
           + ("; the compiled prefill (not the served default) in a column of its own"
              if any(r.get(COMPILED_TTFT[1]) is not None for r in rows) else "")]
          if header.get("served_prefill") else []),
        *([f"- llama.cpp ({header['llama_build']})"] if header.get("llama_build") else []),
        *([ZENTORCH] if any(r.get("runtime") == "zentorch" for r in rows) else []),
        f"- memory bandwidth (triad a = b + s*c, best of before and after the rounds): "
        f"{cell(header.get('bandwidth_gbs'), 1)} GB/s",
        "", *markdown_rows(head, body),
    ]
    head, body = int4_rows(rows)
    if body:
        lines += ["", "int4 rows against both of llama.cpp's 4-bit files, each ratio beside "
                  "the row's quality: Q4_1 is the shipped file and holds the same weights "
                  "(like for like); Q4_0 is llama.cpp's fastest 4-bit file, a second rounding "
                  "of them (its own ppl and agree are in its row above). x: the row's tok/s / "
                  "the file's; x TTFT: the row's TTFT / the file's (below 1: sooner).", "",
                  *markdown_rows(head, body)]
    lines += ["", "b1 / b8 tok/s: greedy decode tokens per second after the first, batch 1 "
              f"and 8 (every row counted). {SERVED_TTFT}"
              + ("; TTFT ms, compiled prefill: compress's prompt through the compiled prefill, "
                 "which a served archive does not run by default"
                 if any(r.get(COMPILED_TTFT[1]) is not None for r in rows) else "")
              + ". agree: "
              "greedy tokens equal to compress float's (zentorch fp32's when compress float "
              "did not run), position by position. MB/token: "
              "weight bytes one decode step reads (the embedding one row unless it is the "
              "output projection too). % bw b1: MB/token x b1 tok/s / triad bandwidth. "
              "x peer: the row's tok/s / its peer's: llama.cpp's on the comparable file, or "
              "the dense grouped row of the same 2:4-pruned model, or the dense model's row "
              "of a MoE row's scheme ("
              + ", ".join(f"{a} against {' or '.join(b)}" for a, b in PAIRS.items())
              + "); x peer TTFT: the row's TTFT / the peer's (below 1: sooner)."]
    lines += [f"- {line}" for line in notes(rows)]
    return "\n".join(lines) + "\n"
