"""benchmarks/soak/run.py's causal-LM faults (issues 31, 39):

- `disconnects`: 50 streaming clients, 40 of them leaving at random points: the others'
  text against one process's greedy text (`offline_texts`), then a full batch of 8;

- `leavers`: fifty streaming clients that each leave after a random number of chunks; then
  the rows still decoding, read from a probe's `X-Batch-Size` (the rows decoding when its
  first token came, itself included): 1 means every leaver's row was freed before the
  probe's first step, i.e. within one step of the last client leaving;
- `flood`: more requests at once than the handler's rows plus its waiting queue
  (`handler.max_waiting`, 64 by default): every answer is a 200 or a 503, the server's
  resident memory (its whole process group) stays within 1.2x its warmed-up value, and it
  still answers afterwards. With `body_bytes` (issue 70: 500 chat requests of 6 MB, a short
  prompt padded with JSON whitespace, near the request limit) the bound is on the model's
  workers: within 1.3x their warmed-up memory (the frontend holds the bodies it queues).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MEMORY_BOUND = 1.2
LARGE_BODY_BYTES = 6_000_000  # near TorchServe's default max_request_size (6,553,500)
LARGE_MEMORY_BOUND = 1.3  # the workers' memory under a flood of LARGE_BODY_BYTES bodies


def headers(info: dict) -> dict[str, str]:
    """The request headers of a served run's `info` (its bearer token, where it has one)."""
    token = info.get("token")
    return {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {token}"} if token else {})


def stream(info: dict, body: dict, leave_after: int | None = None) -> str | None:
    """The streamed text of one request, or None when the client left after some chunks."""
    parts = urlsplit(info["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    conn.request("POST", parts.path, body=json.dumps(body).encode(), headers=headers(info))
    answer = conn.getresponse()
    lines = []
    while line := answer.readline():
        lines.append(line)
        if leave_after is not None and len(lines) >= leave_after:
            conn.close()
            return None
    conn.close()
    return json.loads(lines[-1])["text"] if answer.status == 200 else None


def disconnects(info: dict, prompts: list[str], expected: dict[str, str], new: int,
                clients: int = 50, staying: int = 10) -> dict:
    """`clients` streams, all but `staying` leaving at random points; the others' texts."""
    rng = random.Random(0)
    with ThreadPoolExecutor(16) as pool:
        left = [pool.submit(stream, info, {"prompt": prompts[i % len(prompts)],
                                           "max_new_tokens": new}, rng.randint(1, new // 2))
                for i in range(clients - staying)]
        kept = [(p, pool.submit(stream, info, {"prompt": p, "max_new_tokens": new}))
                for p in (prompts * staying)[:staying]]
        for future in left:
            future.result()
        same = sum(f.result() == expected[p] for p, f in kept)
    with ThreadPoolExecutor(8) as pool:
        after = list(pool.map(lambda p: stream(info, {"prompt": p, "max_new_tokens": new}),
                              (prompts * 8)[:8]))
    return {"clients": clients, "left": clients - staying, "stayed": staying,
            "stayed_equal_offline": same,
            "batch_after_equal_offline": sum(a == expected[p] for p, a in
                                             zip((prompts * 8)[:8], after, strict=True))}


def offline_texts(run: Path, prompts: list[str], new: int) -> dict[str, str]:
    """One process's greedy text of each prompt, from the run's exported folder."""
    from serve.causal_lm.runtime import loading

    folder = next(p.parent for p in sorted(run.glob("*/*/causal_lm.json")))
    lm = loading.load_folder(folder)
    stop = loading.stop_ids(lm.model, lm.tokenizer)
    decoder = loading.StaticDecoder(lm.model, 512)
    return {p: lm.tokenizer.decode(decoder.generate(
        [loading.prompt_ids(lm.tokenizer, p)], new, stop).tokens, skip_special_tokens=True)
        for p in prompts}


def _post(info: dict, body: dict | bytes, leave_after: int | None = None,
          timeout: float = 300) -> tuple[int, dict[str, str], int]:
    """(status, headers, lines read) of one request (a JSON object, or its bytes); the
    client leaves after `leave_after` lines of a stream."""
    parts = urlsplit(info["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", parts.path, body=body if isinstance(body, bytes)
                     else json.dumps(body).encode(), headers=headers(info))
        answer = conn.getresponse()
        lines = 0
        while answer.readline():
            lines += 1
            if leave_after is not None and lines >= leave_after:
                break
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, lines
    finally:
        conn.close()


def probe(info: dict, prompt: str) -> int:
    """The rows decoding beside a one-token request when its first token came."""
    status, answer_headers, _ = _post(info, {"prompt": prompt, "max_new_tokens": 1})
    assert status == 200, status
    return int(answer_headers["x-batch-size"]) - 1


def leavers(info: dict, prompts: list[str], new: int,
            clients: int = 50, seed: int = 0) -> dict[str, Any]:
    """`clients` streams leaving at random chunks; the rows left decoding afterwards."""
    rng = random.Random(seed)
    began = time.perf_counter()
    _post(info, {"prompt": prompts[0], "max_new_tokens": new, "stream": True})
    step_ms = 1000 * (time.perf_counter() - began) / new  # one row's step, prefill included
    with ThreadPoolExecutor(min(clients, 25)) as pool:
        statuses = list(pool.map(lambda i: _post(
            info, {"prompt": prompts[i % len(prompts)], "max_new_tokens": new, "stream": True},
            leave_after=rng.randint(1, new // 2))[0], range(clients)))
    left_at = time.perf_counter()
    rows = [probe(info, prompts[0])]
    first_probe_ms = 1000 * (time.perf_counter() - left_at)
    while len(rows) < 5:
        rows.append(probe(info, prompts[0]))
    return {"clients": clients, "statuses": sorted(set(statuses)),
            "rows_at_first_probe": rows[0], "rows_at_probes": rows,
            "first_probe_ms": round(first_probe_ms, 1), "step_ms": round(step_ms, 2),
            "ok": rows[0] <= 0 and set(statuses) == {200}}  # a probe may say 0 rows


def flood(info: dict, prompts: list[str], new: int, requests: int = 300, rss: Any = None,
          body_bytes: int = 0, workers_rss: Any = None) -> dict[str, Any]:
    """`requests` requests at once; their statuses and the server's memory against its
    warmed-up value (`rss(pid)` in MB: soak.rss_mb). With `body_bytes`, chat requests whose
    bodies are that large (`padded_chat`), and the bound is on the workers' memory
    (`workers_rss(pid)` in MB: soak.workers_rss_mb), sampled too."""
    for prompt in prompts:  # warm-up
        _post(info, {"prompt": prompt, "max_new_tokens": new})
    bodies = [padded_chat(p, new, body_bytes) if body_bytes else
              {"prompt": p, "max_new_tokens": new} for p in prompts]
    meters = {"group": rss} | ({"workers": workers_rss} if workers_rss else {})
    warm = {name: meter(info["pid"]) for name, meter in meters.items()}
    peaks = {name: [value] for name, value in warm.items()}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for name, meter in meters.items():
                peaks[name].append(meter(info["pid"]))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    gate = threading.Barrier(requests)

    def one(i: int) -> int:
        gate.wait()
        try:
            return _post(info, bodies[i % len(bodies)], timeout=600)[0]
        except OSError as exc:
            return -1 if "timed out" not in str(exc) else -2

    with ThreadPoolExecutor(requests) as pool:
        statuses = list(pool.map(one, range(requests)))
    done.set()
    sampler.join()
    after = _post(info, {"prompt": prompts[0], "max_new_tokens": new})[0]
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    ratios = {name: round(max(peaks[name]) / warm[name], 3) if warm[name] else None
              for name in meters}
    bounded, bound = (("workers", LARGE_MEMORY_BOUND) if body_bytes and workers_rss
                      else ("group", MEMORY_BOUND))
    return {"requests": requests, "body_bytes": body_bytes or None, "statuses": counts,
            "rss_warm_mb": warm["group"], "rss_peak_mb": max(peaks["group"]),
            "rss_ratio": ratios["group"],
            **({"workers_rss_warm_mb": warm["workers"],
                "workers_rss_peak_mb": max(peaks["workers"]),
                "workers_rss_ratio": ratios["workers"]} if "workers" in meters else {}),
            "after": after, "bound": f"{bounded} <= {bound}",
            "ok": set(statuses) <= {200, 503} and after == 200
            and ratios[bounded] is not None and ratios[bounded] <= bound}


def padded_chat(prompt: str, new: int, size: int) -> bytes:
    """A chat request's body of `size` bytes: a short prompt padded with JSON whitespace."""
    head = json.dumps({"messages": [{"role": "user", "content": prompt}],
                       "max_new_tokens": new})
    return (head[:-1] + " " * max(0, size - len(head)) + "}").encode()
