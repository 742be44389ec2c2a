"""The servers benchmarks/causal_lm/served.py measures, and the rounds that measure them:
each round visits every server in turn (in reverse every other round), starts it, sends
the chat load at every concurrency through compress.serving.loadtest.chat, and stops it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.causal_lm import served_archives as archives
from benchmarks.causal_lm.served_servers import Server
from benchmarks.harness import servers
from benchmarks.harness.rounds import alternating
from compress.serving.loadtest.chat import CHAT_PATH, run_chat_load
from compress.serving.loadtest.chat_workload import chat_payloads, read_prompts

REQUEST_TIMEOUT_S = 600.0
IGNORE_EOS = {"ignore_eos": True}  # llama-server's field, and compress's since issue 41


def our_items(args: argparse.Namespace, archives_of: dict[str, tuple], work: Path,
              echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """compress's servers: each engine on each scheme's archive; with a shared prefix, on
    copies of the archive with `handler.prefix_cache` false and true (and room for the
    prefix in `cache_len` when the archive's is too small)."""
    items = []
    for scheme, (target, mar, facts) in archives_of.items():
        recipe = archives.SCHEMES[scheme]["recipe"]
        base = {"scheme": recipe, "model_name": facts["model_name"],
                "version": facts["version"], "cache_len": facts["cache_len"],
                "pairs": archives.SCHEMES[scheme]["quants"]}
        if not args.shared_prefix:
            targets = [(None, str(target))]
        else:
            cache_len = archives.prefix_cache_len(facts, args.shared_prefix, args.max_tokens)
            if cache_len != facts["cache_len"]:
                echo(f"serve_peers_llm: {recipe}'s cache_len {facts['cache_len']} cannot "
                     f"hold a {args.shared_prefix}-token prefix, its question and "
                     f"{args.max_tokens} new tokens: served with cache_len {cache_len}")
            targets = [(cache, str(archives.with_handler_settings(
                mar, work / f"prefix-cache-{'on' if cache else 'off'}" / scheme,
                {"prefix_cache": cache, "cache_len": cache_len})))
                for cache in (False, True)]
            base["cache_len"] = cache_len
        for engine in args.engines:
            for cache, served in targets:
                suffix = "" if cache is None else f" cache-{'on' if cache else 'off'}"
                items.append({**base, "key": f"{engine}-{scheme}{suffix.replace(' ', '-')}",
                              "name": f"compress {engine}{suffix}", "engine": engine,
                              "target": served, "prefix_cache": cache, "rounds": []})
    return items


def peer_items(args: argparse.Namespace, archives_of: dict[str, tuple],
               ggufs: dict[str, Path], server: Path) -> list[dict[str, Any]]:
    """llama-server on each GGUF paired with a measured scheme, with that archive's
    per-row cache positions as its per-slot context."""
    items = []
    for scheme, (_, _, facts) in archives_of.items():
        for quant in archives.SCHEMES[scheme]["quants"]:
            if quant in args.quants:
                items.append({"key": f"llama-server-{quant}", "name": "llama-server",
                              "engine": "llama-server", "scheme": quant, "pairs": (),
                              "gguf": str(ggufs[quant]), "cache_len": facts["cache_len"],
                              "binary": str(server),
                              "url_path": CHAT_PATH, "rounds": []})
    return items


def payloads_of(args: argparse.Namespace, ignore_eos: bool) -> list[bytes]:
    """The request bodies of every level, with `"ignore_eos": true` when the server takes
    it (every answer then runs to max_tokens)."""
    return chat_payloads(read_prompts(args.prompts, ()), args.max_tokens,
                         max(args.levels) + args.requests, args.shared_prefix,
                         IGNORE_EOS if ignore_eos else None)


def visit(item: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One round's figures of one server: started, loaded at every level, stopped."""
    def load(server: Server, figures: dict[str, Any]) -> None:
        figures["ignore_eos"] = server.accepts(IGNORE_EOS)
        payloads = payloads_of(args, figures["ignore_eos"])
        figures["runs"] = [run_chat_load(server.url, level, args.requests, payloads,
                                         timeout=REQUEST_TIMEOUT_S, warmup=level)
                           for level in args.levels]

    return servers.visit(Server(item, work), args.start_timeout, load)


def measure(items: list[dict[str, Any]], args: argparse.Namespace, work: Path,
            echo: Callable[[str], None]) -> None:
    """The rounds, alternating the order; each round's figures appended to its item."""
    for r, item in alternating(items, args.rounds):
        echo(f"serve_peers_llm: round {r + 1}/{args.rounds}: {item['name']} "
             f"{item['scheme']}: starting")
        figures = visit(item, args, work)
        item["rounds"].append(figures)
        if "error" in figures:
            echo(f"serve_peers_llm: round {r + 1}/{args.rounds}: {item['name']} "
                 f"{item['scheme']}: failed: {figures['error']}")
            continue
        echo(f"serve_peers_llm: round {r + 1}/{args.rounds}: {item['name']} "
             f"{item['scheme']}: cold start {figures['cold_start_s']:.1f} s, "
             f"{'' if figures['ignore_eos'] else 'ignore_eos refused, '}" + ", ".join(
                 f"c{run['concurrency']} {run['tokens_per_s']:.1f} tok/s"
                 f"{' (' + str(run['errors']) + ' errors)' if run['errors'] else ''}"
                 for run in figures["runs"]))
