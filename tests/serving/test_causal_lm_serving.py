"""A real server, TorchServe and then LitServe (the `engine` fixture), serving the tiny
random Llama's .mar (export `format: transformers`, then package): tokens stream as they
are generated, 8 concurrent requests are batched and answer the greedy text that
causal_lm.runtime gives offline, a bad request in a batch gets the only 400, and `compress serve`
/ `compress loadtest` work on the run folder."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import fuzz_routes, packaged_causal_lm_run, run_cli, serving

pytest.importorskip("ts")

from compress.serving import server  # noqa: E402
from serve.causal_lm.runtime import loading  # noqa: E402

pytestmark = pytest.mark.serving

PROMPTS = ["the film was", "a much longer prompt about a movie that goes on and on", "hi",
           "what is the capital of france ?", "tell me a story", "one two three four five",
           "why is the sky blue", "good morning"]


@pytest.fixture(scope="module")
def causal_lm_run(varied_llama_folder: Path, tmp_path_factory, data_dir: Path) -> Path:
    """The tiny Llama exported and packaged: batches of up to 8, 150 ms to fill one."""
    return packaged_causal_lm_run(tmp_path_factory.mktemp("lm_served"), "tiny_lm",
                                  varied_llama_folder,
                                  {"batch_size": 8, "max_batch_delay_ms": 150,
                                   "max_new_tokens": 160, "threads": 1},
                                  data_dir, 256, PROMPTS[:2])


@pytest.fixture(scope="module")
def served(causal_lm_run: Path, state_dir, engine: str) -> dict:
    yield from serving(causal_lm_run, engine, 300)


@pytest.fixture(scope="module")
def offline(causal_lm_run: Path) -> loading.LoadedCausalLM:
    return loading.load_folder(causal_lm_run / "00-export/transformers")


def generate(info: dict, body: dict) -> tuple[int, dict, list[tuple[float, bytes]]]:
    """(status, headers (names case-insensitive), [(arrival time, line)]) of one POST, read
    line by line."""
    parts = urlsplit(info["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if info.get("token"):
        headers["Authorization"] = f"Bearer {info['token']}"
    conn.request("POST", parts.path, body=json.dumps(body).encode(), headers=headers)
    answer = conn.getresponse()
    lines = []
    while line := answer.readline():
        lines.append((time.perf_counter(), line))
    conn.close()
    return answer.status, answer.headers, lines


def deltas(lines: list[tuple[float, bytes]]) -> str:
    """The concatenated deltas of a native streamed answer (every line but the last)."""
    return "".join(json.loads(line)["delta"] for _, line in lines[:-1])


def split_model_answers_like_one_process(info: dict, want: dict[str, str]) -> list[str]:
    """A model split over ranks (pipeline or expert parallel) answers like one process:
    each prompt of `want` streamed alone, then all in one batch whose last row ends early
    at a stop string (rank 0 sees it and tells the other ranks) while the others go on.
    Returns three sampled texts (seed 7 twice, then seed 8), checked: a seed repeats."""
    prompts = list(want)
    for prompt in prompts:  # streamed one at a time: deltas, then the final answer
        status, _, lines = generate(info, {"prompt": prompt, "max_new_tokens": 8})
        assert status == 200 and len(lines) > 2
        assert json.loads(lines[-1][1])["text"] == deltas(lines) == want[prompt]
    stop = want[prompts[-1]].split()[2]
    bodies = [{"prompt": p, "max_new_tokens": 8, "stream": False} for p in prompts]
    bodies[-1]["stop"] = [stop]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda body: generate(info, body), bodies))
    texts = [json.loads(lines[-1][1]) for _, _, lines in answers]
    assert all(status == 200 for status, _, _ in answers)
    assert [t["text"] for t in texts[:-1]] == [want[p] for p in prompts[:-1]]
    cut = want[prompts[-1]]
    assert texts[-1]["text"] == cut[:cut.find(stop)]
    assert texts[-1]["finish_reason"] == "stop"
    assert max(int(h["X-Batch-Size"]) for _, h, _ in answers) > 1
    body = {"prompt": prompts[1], "max_new_tokens": 8, "stream": False,
            "temperature": 0.9, "seed": 7}
    sampled = [generate(info, body) for _ in range(2)] + [generate(info, body | {"seed": 8})]
    assert [status for status, _, _ in sampled] == [200, 200, 200]
    texts = [json.loads(lines[-1][1])["text"] for _, _, lines in sampled]
    assert texts[0] == texts[1] != texts[2]
    return texts


def offline_text(lm: loading.LoadedCausalLM, prompt: str, tokens: int) -> str:
    """Batch-1 greedy decoding of the exported folder, as the served text is decoded."""
    ids = loading.prompt_ids(lm.tokenizer, prompt)
    out = loading.StaticDecoder(lm.model, 256).generate(
        [ids], tokens, loading.stop_ids(lm.model, lm.tokenizer))
    return lm.tokenizer.decode(out.tokens, skip_special_tokens=True)


def test_tokens_stream_before_the_last_is_generated(served: dict, offline) -> None:
    sent = time.perf_counter()
    status, headers, lines = generate(served, {"prompt": PROMPTS[0], "max_new_tokens": 160})
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    chunks = [json.loads(line) for _, line in lines[:-1]]
    final = json.loads(lines[-1][1])
    assert final["usage"]["completion_tokens"] == 160 and final["finish_reason"] == "length"
    assert len(chunks) > 100 and chunks[-1]["tokens"] == 160
    assert "".join(c["delta"] for c in chunks) == final["text"]
    assert final["text"] == offline_text(offline, PROMPTS[0], 160)
    # the first chunk left the server with 1 of 160 tokens and arrived well before the last;
    # chunks kept arriving while the rest were generated (buffered: all within a few ms). A
    # busy machine may hold the client back for a while, so the chunks' arrival times are
    # counted in ten slices of the stream: a stream fills several, a buffered answer two.
    times = [t for t, _ in lines]
    first, last = times[0], times[-1]
    assert chunks[0]["tokens"] == 1 and last - first > 0.05, (sent, first, last)
    slices = {min(int(10 * (t - first) / (last - first)), 9) for t in times}
    assert len(slices) >= 4, (sorted(slices), [round(t - first, 4) for t in times])


def test_eight_concurrent_requests_are_batched_and_answer_as_offline(
        served: dict, offline) -> None:
    gate = threading.Barrier(len(PROMPTS))

    def ask(prompt: str):
        gate.wait()
        return generate(served, {"prompt": prompt, "max_new_tokens": 24})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert [status for status, _, _ in answers] == [200] * 8
    batches = [int(headers["X-Batch-Size"]) for _, headers, _ in answers]
    assert max(batches) > 1, batches
    for prompt, (_, _, lines) in zip(PROMPTS, answers, strict=True):
        final = json.loads(lines[-1][1])
        assert final["text"] == offline_text(offline, prompt, 24), prompt
        assert deltas(lines) == final["text"]
        assert final["usage"]["prompt_tokens"] == len(loading.prompt_ids(
            offline.tokenizer, prompt))


def test_a_bad_request_in_a_batch_gets_the_only_400(served: dict, offline) -> None:
    bodies = [{"prompt": p, "max_new_tokens": 8, "stream": False} for p in PROMPTS[:7]]
    bodies.insert(3, {"prompt": "", "max_new_tokens": 8})
    gate = threading.Barrier(len(bodies))

    def ask(body: dict):
        gate.wait()
        return generate(served, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(ask, bodies))
    statuses = [status for status, _, _ in answers]
    assert statuses == [200, 200, 200, 400, 200, 200, 200, 200]
    assert json.loads(answers[3][2][-1][1])["error"] == "empty prompt: send a non-empty string"
    assert max(int(headers["X-Batch-Size"]) for _, headers, _ in answers) > 1
    for body, (_, _, lines) in zip(bodies, answers, strict=True):
        if body["prompt"]:
            assert len(lines) == 1  # stream: false answers in one piece
            assert json.loads(lines[0][1])["text"] == offline_text(offline, body["prompt"], 8)


def test_the_openai_client_streams_the_offline_text_and_gets_its_own_errors(
        served: dict, offline) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served['url']}/1.0/v1",
                           api_key=served.get("token") or "unused", max_retries=0)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model="tiny_lm", messages=messages,
                                                max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert len(pieces) > 5 and "".join(pieces) == offline_text(offline, PROMPTS[0], 24)
    assert finish == "length" and usage.completion_tokens == 24
    assert usage.prompt_tokens == len(loading.prompt_ids(offline.tokenizer, PROMPTS[0]))
    whole = client.chat.completions.create(model="tiny_lm", messages=messages, max_tokens=24,
                                           temperature=0)
    assert whole.choices[0].message.content == "".join(pieces)
    # completions: the prompt as it is, no chat template
    ids = loading.prompt_ids(offline.tokenizer, PROMPTS[1], chat_template=False)
    want = loading.StaticDecoder(offline.model, 256).generate(
        [ids], 16, loading.stop_ids(offline.model, offline.tokenizer)).tokens
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny_lm", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True)
        if c.choices)
    assert text == offline.tokenizer.decode(want, skip_special_tokens=True)
    assert [m.id for m in client.models.list()] == ["tiny_lm"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny_lm", messages=[], max_tokens=4)
    assert bad.value.status_code == 400 and "messages" in bad.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny_lm", messages=messages, max_tokens=10 ** 9)


def busy_rows(info: dict) -> int:
    """The rows decoding when a one-token probe got its token (itself included)."""
    status, headers, _ = generate(info, {"prompt": PROMPTS[2], "max_new_tokens": 1,
                                         "stream": False})
    assert status == 200
    return int(headers["X-Batch-Size"])


class RowsOutliveTheirClients(AssertionError):
    """Rows still decoding well after every client that asked for them has left: the one
    failure TorchServe may show in the test below (its xfail names nothing else)."""


def test_clients_that_leave_mid_stream_leak_no_row(served: dict, offline, engine: str,
                                                   request) -> None:
    """40 streaming clients asking for 160 tokens close their connection after a few chunks,
    beside 10 that stay: those get the offline text (their deltas adding up to it); then 8
    leave alone, and once the last is gone the rows drain at once, where rows that decoded
    on to their limit would hold them for most of 160 steps (160 tokens alone: `alone_s`)."""
    import random

    if engine == "torchserve":
        request.applymarker(pytest.mark.xfail(strict=True, raises=RowsOutliveTheirClients,
                                              reason=(
            "TorchServe 0.12 never tells a worker that a client left "
            "(serve/causal_lm/server/replies.py): its rows decode to max_new_tokens")))
    # the offline texts take seconds: computed before anything here is timed
    want = {prompt: offline_text(offline, prompt, 40) for prompt in PROMPTS}
    parts = urlsplit(served["url"])
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {served['token']}"}
    began = time.perf_counter()
    _, _, lines = generate(served, {"prompt": PROMPTS[0], "max_new_tokens": 160})
    alone_s = time.perf_counter() - began
    assert json.loads(lines[-1][1])["usage"]["completion_tokens"] == 160

    def leave_after(chunks: int) -> tuple[int, float]:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        conn.request("POST", parts.path, body=json.dumps(
            {"prompt": PROMPTS[chunks % 8], "max_new_tokens": 160}).encode(), headers=headers)
        answer = conn.getresponse()
        for _ in range(chunks):
            answer.readline()
        answer.close()
        conn.close()
        return answer.status, time.perf_counter()

    def stay(prompt: str) -> tuple[str, float]:
        _, _, lines = generate(served, {"prompt": prompt, "max_new_tokens": 40})
        final = json.loads(lines[-1][1])["text"]
        assert deltas(lines) == final
        return final, time.perf_counter()

    rng = random.Random(0)
    with ThreadPoolExecutor(16) as pool:  # leavers beside stayers: the stayers' texts hold
        left = [pool.submit(leave_after, rng.randint(1, 10)) for _ in range(40)]
        stayed = [(p, pool.submit(stay, p)) for p in PROMPTS + PROMPTS[:2]]
        statuses = [f.result()[0] for f in left]
        texts = [(prompt, f.result()[0]) for prompt, f in stayed]
    with ThreadPoolExecutor(8) as pool:  # leavers alone: their rows must go when they do
        left = list(pool.map(leave_after, [rng.randint(1, 4) for _ in range(8)]))
    gone = max(at for _, at in left)
    # the drain is timed before anything else runs here; rows decoding on to their limit
    # would hold for most of 160 steps
    while (rows := busy_rows(served)) > 1 and time.perf_counter() - gone < 30:
        time.sleep(0.01)
    drained_s = time.perf_counter() - gone
    assert statuses + [status for status, _ in left] == [200] * 48
    # the clients that stayed, beside the leavers and after them, get the offline text on
    # both engines (checked before the drain, the part TorchServe fails)
    for prompt, text in texts:
        assert text == want[prompt], prompt
    with ThreadPoolExecutor(8) as pool:
        after = list(pool.map(stay, PROMPTS))
    assert [text for text, _ in after] == [want[p] for p in PROMPTS]
    # the probe itself is the one row left (0 where its header was set before it joined)
    if not (rows <= 1 and drained_s < 0.3 * alone_s):
        raise RowsOutliveTheirClients(f"{rows} rows still decoding {drained_s:.2f} s after "
                                      f"the last client left (160 tokens alone: "
                                      f"{alone_s:.2f} s)")


@pytest.mark.parametrize("body, status", [
    (b"{" * 10_000 + b"}" * 10_000, 400),  # JSON nested 10,000 deep
    (b'{"prompt": "\xff\xfe"}', 400),  # not UTF-8
    (json.dumps({"prompt": "hi", "max_new_tokens": 10 ** 9}).encode(), 400),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400),
    (json.dumps({"messages": []}).encode(), 400),
    (json.dumps({"prompt": "word " * 400}).encode(), 400),  # longer than the cache
    (b"x" * (10 << 20), 413),  # 10 MB: TorchServe's own limit answers first
    # a non-ASCII field name, echoed in the 400's reason phrase (it broke TorchServe's frame)
    (json.dumps({"prompt": "hi", "\u00e9\u00ff": 1}, ensure_ascii=False).encode(), 400),
])
def test_named_bad_requests_get_one_4xx_and_the_server_stays(served: dict, body: bytes,
                                                             status: int, offline) -> None:
    parts = urlsplit(served["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", parts.path, body=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {served['token']}"})
    answer = conn.getresponse()
    answer.read()
    conn.close()
    assert answer.status == status
    _, _, lines = generate(served, {"prompt": PROMPTS[2], "max_new_tokens": 8})
    assert json.loads(lines[-1][1])["text"] == offline_text(offline, PROMPTS[2], 8)


def test_prometheus_metrics_show_the_models_batches_tokens_and_errors(served: dict,
                                                                      engine: str) -> None:
    import urllib.request

    if engine != "torchserve":
        pytest.skip("Prometheus metrics: TorchServe's metrics port only")

    def read() -> dict[str, str]:
        text = urllib.request.urlopen(served["metrics_url"], timeout=30).read().decode()
        return {key(line): line for line in text.splitlines()
                if line.startswith(("Compress", "ts_queue_latency", "Requests4XX"))}

    def key(line: str) -> str:
        """A line's metric name, and a histogram bucket's bound after it
        ("CompressTimeToFirstToken_bucket le=10.0")."""
        name = line.split("{")[0]
        bound = re.search(r'le="([^"]+)"', line)
        return f"{name} le={bound[1]}" if name.endswith("_bucket") and bound else name

    def value(lines: dict[str, str], name: str) -> float:
        return float(lines[name].split()[-1]) if name in lines else 0.0

    before = read()  # cumulative counters: this test's own requests are the difference
    generate(served, {"prompt": PROMPTS[1], "max_new_tokens": 12})  # long enough to keep
    generate(served, {"prompt": ""})
    lines = read()
    for name in ("CompressTimeToFirstToken_count", "CompressQueueTime_count",
                 "CompressBatchRows", "CompressGeneratedTokens", "CompressBadRequests",
                 "CompressPrefixCacheBytes", "ts_queue_latency_microseconds", "Requests4XX"):
        assert name in lines, (name, sorted(lines))
    # the prompts' keys and values: 2 layers x 2 heads x 8 dims, keys and values, float32 a
    # position; at most the default bound of 4 x cache_len positions
    held, position = value(lines, "CompressPrefixCacheBytes"), 2 * 2 * 2 * 8 * 4
    assert 0 < held <= 4 * 256 * position and held % position == 0, held
    assert 'ModelName="tiny_lm"' in lines["CompressGeneratedTokens"]
    for name, least in (("CompressGeneratedTokens", 12), ("CompressBadRequests", 1),
                        ("CompressTimeToFirstToken_count", 1), ("Requests4XX", 1)):
        assert value(lines, name) - value(before, name) >= least, (name, before, lines)
    # times in seconds, so that the default buckets (5 ms to 10 s) hold them: a first token
    # within 10 s of its request's arrival is in a finite bucket, not only in +Inf
    finite = "CompressTimeToFirstToken_bucket le=10.0"
    assert value(lines, finite) - value(before, finite) >= 1, sorted(lines)


def mixed_request(k: int) -> tuple[str, dict]:
    """Request `k` of a mixed load: native and OpenAI, streamed and whole, one choice or
    two, distinct prompts (the prefix cache fills to its bound) and every 10th a bad one."""
    prompt = f"{PROMPTS[k % len(PROMPTS)]} number {k}"
    if k % 10 == 9:
        return "", {"prompt": "", "max_new_tokens": 2}  # a 400
    if k % 3 == 0:
        return "/1.0/v1/chat/completions", {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 1 + k % 4,
            "temperature": 0, "stream": k % 2 == 0, "n": 1 + k % 2}
    return "", {"prompt": prompt, "max_new_tokens": 1 + k % 5, "stream": k % 2 == 0}


def test_memory_after_a_thousand_mixed_requests_is_within_a_tenth_of_after_ten(
        served: dict, engine: str) -> None:
    """The server's whole process tree (PSS: shared pages once), after 10 requests and
    after 1,000, 8 at a time: no request leaves memory behind (a row, a cache, a stream)."""
    from compress.system.processes import tree_pss_bytes

    def ask(k: int) -> int:
        path, body = mixed_request(k)
        status, _, _ = generate({**served, "url": served["url"] + path}, body)
        return status

    def memory() -> int:
        return sum(tree_pss_bytes(served["pid"]).values())

    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(ask, range(10)))
        after_ten = memory()
        rest = list(pool.map(ask, range(10, 1000)))
    after_thousand = memory()
    statuses = first + rest
    assert statuses.count(400) == 100 and statuses.count(200) == 900, set(statuses)
    assert after_thousand <= 1.1 * after_ten, (engine, after_ten / 2**20,
                                               after_thousand / 2**20)


def test_fuzzing_the_openapi_description_gets_no_server_error(served: dict) -> None:
    """schemathesis cases (valid and invalid bodies) for every route of the OpenAPI
    description of the archive's routes: each answered 2xx or 4xx, none within 60 s hangs
    (`fuzz_routes`)."""
    from compress.serving.openapi import causal_lm_openapi

    written = json.loads((Path(served["serve_dir"]) / "openapi.json").read_text())
    assert written == causal_lm_openapi("tiny_lm", "1.0", 160)  # what compress serve wrote
    fuzz_routes(served, "tiny_lm")
    _, _, lines = generate(served, {"prompt": PROMPTS[2], "max_new_tokens": 8})
    assert json.loads(lines[-1][1])["finish_reason"] == "length"


def test_compress_serve_and_loadtest_on_the_run_folder(causal_lm_run: Path, state_dir,
                                                       served: dict, engine: str) -> None:
    server.stop(Path(served["serve_dir"]))  # the module's server: one at a time here
    (port,) = server.free_ports(1)
    env = {"COMPRESS_STATE_DIR": str(state_dir)}
    started = run_cli("serve", str(causal_lm_run), "--port", str(port), "--engine", engine,
                      "--batch-size", "4", env=env)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        # a continuous archive takes each request alone on every engine (grouped, every
        # answer of a group would wait for its slowest and fail with it)
        assert "--batch-size 4 ignored: tiny_lm batches continuously" in started.stderr
        assert server.read_info(causal_lm_run / "serve")["settings"]["batchSize"] == 1
        url = f"http://127.0.0.1:{port}/predictions/tiny_lm"
        assert f"serving tiny_lm at {url}" in started.stdout and "curl -sN" in started.stdout
        assert "continuous batching over 8 decode rows" in started.stdout  # not "batch size 1"
        assert "batch size 1" not in started.stdout
        tested = run_cli("loadtest", url, "--run", str(causal_lm_run), "--concurrency", "1,4",
                         "--requests", "8", "--warmup", "1", "--max-new-tokens", "16", env=env)
        assert tested.returncode == 0, tested.stderr[-2000:]
        assert "tok/s" in tested.stdout and "ttft p50 ms" in tested.stdout
    finally:
        stopped = run_cli("serve", "--stop", str(causal_lm_run), env=env)
    assert stopped.returncode == 0
    record = json.loads((causal_lm_run / "loadtest.json").read_text())
    assert record["task"] == "causal-lm" and [r["ok"] for r in record["runs"]] == [8, 8]
    assert all(r["completion_tokens"] == 8 * 16 and r["tokens_per_s"] > 0
               and r["ttft_ms_p50"] > 0 for r in record["runs"])
    assert record["runs"][1]["batch_size_max"] > 1


@pytest.fixture(scope="module")
def qwen2_run(tmp_path_factory, data_dir: Path) -> Path:
    """A random Qwen2 with 2 key-value heads (q/k/v biases, untied head) exported and
    packaged with its decode step compiled for buckets of 1, 2 and 4 rows: the shape whose
    worker crashed while compiling the size-4 bucket."""
    import torch
    from conftest import minilm_folder
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tmp = tmp_path_factory.mktemp("qwen2_served")
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
    )).save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    return packaged_causal_lm_run(tmp, "tiny_qwen2", tmp / "model",
                                  {"batch_size": 4, "max_batch_delay_ms": 150,
                                   "max_new_tokens": 64, "threads": 1,
                                   "decode_compile": "default"}, data_dir, 256, PROMPTS[:2])


def test_a_compiled_two_kv_head_qwen2_starts_and_streams_the_offline_text(
        qwen2_run: Path, state_dir) -> None:
    (port,) = server.free_ports(1)
    env = {"COMPRESS_STATE_DIR": str(state_dir)}
    started = run_cli("serve", str(qwen2_run), "--port", str(port), env=env)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        # from the decode steps and prefill the package stage compiled ahead of time for
        # this CPU, shipped in the archive: loaded, warmed up, nothing compiled as it started
        assert ": shipped decode steps and prefill loaded (at " in started.stderr  # `W-9000:`
        assert ": prefill (ahead of time) warmed up (at " in started.stderr
        for n, rows in enumerate((4, 2, 1), 1):  # what the worker said while it started
            assert f"warming up bucket {n} of 3 ({rows} rows)" in started.stderr
        assert "compiling bucket" not in started.stderr
        with zipfile.ZipFile(next((qwen2_run / "01-package").glob("*.mar"))) as archive:
            target = json.loads(archive.read("compiled_graphs/target.json"))
            assert target["torch"] == __import__("torch").__version__ and target["cpu_flags"]
            names = set(archive.namelist())
            assert {"compiled_graphs/decode_1.pt2", "compiled_graphs/decode_rows.pt2",
                    # a float model's graph tells one row from more: two prefill packages
                    "compiled_graphs/prefill.pt2", "compiled_graphs/prefill_1.pt2"} <= names
        info = server.read_info(qwen2_run / "serve")
        offline = loading.load_folder(qwen2_run / "00-export/transformers")
        status, _, lines = generate(info, {"prompt": PROMPTS[0], "max_new_tokens": 40})
        chunks = [json.loads(line) for _, line in lines[:-1]]
        final = json.loads(lines[-1][1])
        assert status == 200 and len(chunks) > 10
        assert "".join(c["delta"] for c in chunks) == final["text"]
        assert final["text"] == offline_text(offline, PROMPTS[0], 40)
        with ThreadPoolExecutor(4) as pool:  # a full bucket of 4 rows
            answers = list(pool.map(lambda p: generate(info, {"prompt": p, "stream": False,
                                                              "max_new_tokens": 12}),
                                    PROMPTS[:4]))
        for prompt, (status, _, lines) in zip(PROMPTS[:4], answers, strict=True):
            assert status == 200
            assert json.loads(lines[0][1])["text"] == offline_text(offline, prompt, 12)
    finally:
        stopped = run_cli("serve", "--stop", str(qwen2_run), env=env)
    assert stopped.returncode == 0
