"""Issue 44 item 4: an embedding archive served by a real server (TorchServe, then LitServe:
the `engine` fixture). recipes/embed_int8.yaml shrunk to its fp32 ONNX export and a package of
it, run on a random BERT sentence-transformers folder with CLS pooling and no Normalize:
the served embedding is the float model's CLS embedding (the pooling read from the folder),
on the native route and on OpenAI's `v1/embeddings` through the `openai` client (a string, a
list, token arrays, base64 and float) and LangChain's `OpenAIEmbeddings`; `dimensions` is a
400 for a model without Matryoshka training; bad bodies get a 400 each without touching the
good requests that share their batch; the archive's limits hold. On the handler in this
process: `dimensions` cuts and re-normalizes for a Matryoshka export, and a row the model
fails on (or embeds as NaN) is a 500 (a 422) for its own request alone."""

from __future__ import annotations

import base64
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, http_post, serving, write_recipe, write_sentiment_tables

pytest.importorskip("ts")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.serving

MODEL = "tiny_embed"
TEXTS = ["the film was wonderful", "a dull, lifeless movie", "hi",
         "one of the best performances of the year, and a script to match it"]
MAX_CHARS, MAX_ITEMS = 300, 64  # characters: SST-2's longest sentence has 267 (MTEB)


@pytest.fixture(scope="module")
def embedding_run(cls_bert_folder: Path, tmp_path_factory) -> Path:
    """recipes/embed_int8.yaml on cls_bert_folder and a small sentiment table: its fp32 ONNX
    export, packaged (batch size 8, 50 ms delay, 300 characters a text); the run folder."""
    from builders import run_in_process

    tmp = tmp_path_factory.mktemp("embedding_served")
    raw = yaml.safe_load((REPO / "recipes/embed_int8.yaml").read_text())
    raw["name"] = MODEL
    raw["model"]["source"] = str(cls_bert_folder)
    raw["data"] = {"source": str(write_sentiment_tables(tmp / "data", 16, 24)),
                   "text_column": "sentence", "label_column": "label", "max_length": 64,
                   "eval": {"split": "validation"}}
    export, package = raw["stages"][0], raw["stages"][-1]
    assert export["name"] == "fp32_onnx" and package["kind"] == "package"
    package.update(artifact="fp32_onnx", batch_size=8, max_batch_delay_ms=50,
                   max_text_chars=MAX_CHARS, threads=1)
    raw["stages"] = [export, package]
    raw["evaluation"] = {"batch_size": 16, "latency": {"enabled": False}}
    raw["output_dir"] = str(tmp / "runs")
    manifest = run_in_process(write_recipe(tmp / "embed.yaml", raw))
    assert [s["status"] for s in manifest["stages"]] == ["done", "done"]
    return tmp / "runs" / MODEL


@pytest.fixture(scope="module")
def offline(cls_bert_folder: Path):
    """(the float model's CLS embeddings of texts: the transformer's first hidden state,
    unnormalized, as the folder's Pooling config says; its tokenizer)."""
    from transformers import AutoModel, AutoTokenizer

    pooling = json.loads((cls_bert_folder / "1_Pooling/config.json").read_text())
    assert pooling["pooling_mode_cls_token"] and not pooling["pooling_mode_mean_tokens"]
    model = AutoModel.from_pretrained(cls_bert_folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(cls_bert_folder)

    def embed(texts: list[str]) -> torch.Tensor:
        inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.no_grad():
            return model(**inputs).last_hidden_state[:, 0]

    return embed, tokenizer


@pytest.fixture(scope="module")
def served(embedding_run: Path, state_dir, engine: str) -> dict:
    yield from serving(embedding_run, engine, 180)


@pytest.fixture(scope="module")
def client(served: dict):
    return openai.OpenAI(base_url=f"{served['url']}/1.0/v1",
                         api_key=served.get("token") or "unused", max_retries=0)


def close(got, want: torch.Tensor, atol: float = 1e-4) -> bool:
    """Whether served embeddings equal the offline ones (the fp32 ONNX file's rounding)."""
    got = torch.tensor(got, dtype=torch.float32).reshape(want.shape)
    return bool((got - want).abs().max() <= atol)


def post(served: dict, body: bytes | dict, path: str = "",
         content_type: str = "application/json") -> tuple[int, dict, object]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http_post(served["url"] + path, raw, served.get("token"), content_type)


def test_the_native_route_serves_the_float_models_cls_embedding(served, offline) -> None:
    embed, _ = offline
    want = embed(TEXTS)
    assert not torch.allclose(want.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-3)
    status, headers, answer = post(served, {"texts": TEXTS})
    assert status == 200 and int(headers["X-Batch-Size"]) >= 1
    assert close(answer["embeddings"], want)
    status, _, answer = post(served, {"text": TEXTS[0]})
    assert status == 200 and close(answer["embedding"], want[:1])
    status, _, answer = post(served, TEXTS[3].encode(), content_type="text/plain")
    assert status == 200 and close(answer["embedding"], want[3:])


def test_the_openai_client_strings_token_arrays_base64_and_float(client, offline) -> None:
    embed, tokenizer = offline
    want = embed(TEXTS)
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])  # base64 by default
    assert one.object == "list" and one.model == MODEL and len(one.data) == 1
    assert one.data[0].object == "embedding" and one.data[0].index == 0
    assert close(one.data[0].embedding, want[:1])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tokenizer(TEXTS[0])[
        "input_ids"])
    many = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float",
                                    user="someone")
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    assert close([d.embedding for d in many.data], want)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    tokens = client.embeddings.create(model=MODEL, input=ids)
    assert close([d.embedding for d in tokens.data], want)
    assert tokens.usage.prompt_tokens == many.usage.prompt_tokens
    single = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="base64")
    assert isinstance(single.data[0].embedding, str)  # asked for: the client leaves it
    raw = torch.frombuffer(bytearray(base64.b64decode(single.data[0].embedding)),
                           dtype=torch.float32)
    assert close(raw.tolist(), want[1:2])
    assert client.models.list().data[0].id == MODEL


def test_langchain_openai_embeddings(served, offline) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    embed, _ = offline
    embeddings = langchain_openai.OpenAIEmbeddings(
        model=MODEL, base_url=f"{served['url']}/1.0/v1", api_key=served.get("token") or "x",
        check_embedding_ctx_length=False, tiktoken_enabled=False, chunk_size=3,
        max_retries=0)
    want = embed(TEXTS)
    assert close(embeddings.embed_documents(TEXTS), want)  # two requests: 3 and 1 texts
    assert close(embeddings.embed_query(TEXTS[2]), want[2:3])


def test_dimensions_is_refused_without_matryoshka_training(served, client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="a film", dimensions=8)
    assert refused.value.status_code == 400 and "Matryoshka" in refused.value.message
    full = client.embeddings.create(model=MODEL, input="a film", dimensions=32)
    assert len(full.data[0].embedding) == 32  # the model's own width asks for nothing
    status, _, answer = post(served, {"input": "x", "model": MODEL}, "/1.0/v1/nope")
    assert status == 404 and answer["error"]["type"] == "not_found_error"


BAD = {
    "lone surrogate": b'{"text": "\\ud800"}',
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "invalid UTF-8": b'{"text": "\xff\xfe great"}',
    "empty body": b"",
    "NaN text": b'{"texts": ["fine", NaN]}',
}
BAD_OPENAI = {
    "empty input": {"input": [], "model": MODEL},
    "empty string": {"input": "", "model": MODEL},
    "mixed input": {"input": ["a film", [101]], "model": MODEL},
    "token past the vocabulary": {"input": [[5, 10**9]], "model": MODEL},
    "boolean token": {"input": [True, 5]},
    "unknown field": {"input": "a film", "temperature": 0},
    "encoding format": {"input": "a film", "encoding_format": "int8"},
    "lone surrogate": {"input": ["good", "\ud800"]},
}


def test_mteb_scores_the_endpoint_as_the_export_folder(served, embedding_run, data_dir,
                                                      monkeypatch) -> None:
    """Issue 75 item 4: MTEB's local tasks through the served `v1/embeddings` give the
    scores of the export folder scored offline (within 1e-3), from the same embeddings."""
    harness = pytest.importorskip("compress.families.embedding.evaluation_harness")
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    endpoint = harness.EndpointEmbedder(f"{served['url']}/1.0/v1", served.get("token"))
    export = harness.ExportEmbedder(embedding_run / "00-export/onnx", threads=1)
    for kind in (None, "query", "document"):
        assert close(endpoint.embed(TEXTS, kind), export.embed(TEXTS, kind), 1e-5)
    tasks = ["SST2LocalClassification", "SST2KnownItemRetrieval"]
    online = harness.task_scores(endpoint, tasks, limit=120, progress=False)
    offline = harness.task_scores(export, tasks, limit=120, progress=False)
    assert set(online) == set(offline) == {"mteb_SST2LocalClassification_accuracy",
                                           "mteb_SST2KnownItemRetrieval_ndcg_at_10"}
    assert all(abs(online[k] - offline[k]) <= 1e-3 for k in online), (online, offline)
    assert 0.0 < offline["mteb_SST2KnownItemRetrieval_ndcg_at_10"] <= 1.0


def post_together(served: dict, calls: list[tuple]) -> list[tuple[int, dict, object]]:
    """`post(served, *call)` of every call at once (threads released by one barrier)."""
    gate = threading.Barrier(len(calls))

    def ask(call: tuple) -> tuple[int, dict, object]:
        gate.wait()
        return post(served, *call)

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(ask, calls))


def test_bad_bodies_do_not_harm_the_good_requests_of_their_batch(served, offline) -> None:
    embed, _ = offline
    want = embed(TEXTS)
    goods = [({"text": t}, "", want[k]) for k, t in enumerate(TEXTS)] + [
        ({"input": t, "encoding_format": "float"}, "/1.0/v1/embeddings", want[k])
        for k, t in enumerate(TEXTS)]
    bads = [(body, "") for body in BAD.values()] + [
        (json.dumps(body).encode(), "/1.0/v1/embeddings") for body in BAD_OPENAI.values()]
    calls = [(body, path) for body, path, _ in goods] + bads
    batches = []
    for _ in range(2):
        answers = post_together(served, calls)
        for (_, path, expected), (status, _, answer) in zip(goods, answers, strict=False):
            assert status == 200, answer
            got = answer["data"][0]["embedding"] if path else answer["embedding"]
            assert close(got, expected[None])
        for (body, path), (status, _, answer) in zip(bads, answers[len(goods):], strict=True):
            assert status == 400, (body[:80], status, answer)
            assert (answer["error"]["type"] == "invalid_request_error" if path
                    else answer["status"] == 400)
        batches += [int(headers["X-Batch-Size"]) for _, headers, _ in answers]
    assert max(batches) > 1  # the bad ones shared batches with the good ones


def test_the_archives_limits_hold(served) -> None:
    status, _, answer = post(served, {"texts": ["a film"] * (MAX_ITEMS + 1)})
    assert status == 400 and "too many texts" in answer["error"]
    status, _, answer = post(served, {"text": "a" * (MAX_CHARS + 1)})
    assert status == 400 and "too long" in answer["error"]
    path = "/1.0/v1/embeddings"
    status, _, answer = post(served, {"input": ["a film"] * (MAX_ITEMS + 1)}, path)
    assert status == 400 and "too many inputs" in answer["error"]["message"]
    status, _, answer = post(served, {"input": [[2000] * (MAX_CHARS + 1)]}, path)
    assert status == 400 and "too long" in answer["error"]["message"]
    status, _, answer = post(served, {"texts": ["a film"] * MAX_ITEMS})  # at the limits
    assert status == 200 and len(answer["embeddings"]) == MAX_ITEMS
    status, _, answer = post(served, {"input": [[2143] * MAX_CHARS]}, path)
    assert status == 200 and answer["usage"]["prompt_tokens"] == MAX_CHARS + 2  # [CLS] [SEP]


@pytest.fixture(scope="module")
def local_handler(embedding_run: Path, tmp_path_factory):
    """The handler in this process on a copy of the export that says it was trained with
    MatryoshkaLoss and normalizes (the file itself does not: its rows are CLS vectors)."""
    from ts.context import Context

    from serve.embedding.handler import EmbeddingHandler

    folder = shutil.copytree(embedding_run / "00-export/onnx",
                             tmp_path_factory.mktemp("matryoshka") / "export")
    meta = json.loads((folder / "export.json").read_text())
    meta["embedding"].update(matryoshka=True, normalize=True)
    (folder / "export.json").write_text(json.dumps(meta))
    handler = EmbeddingHandler()
    handler.initialize(Context(MODEL, str(folder), None, 4, None, "0.12.0",
                               model_yaml_config={"handler": {"threads": 1}}))
    return handler


def handle_here(handler, bodies: list[dict], path: str = "v1/embeddings") -> list:
    """(status, answer) of each body served by `handler` in one batch, on `path`."""
    from ts.context import Context, RequestProcessor

    context = Context(MODEL, "", None, len(bodies), None, "0.12.0")
    context.request_processor = [RequestProcessor({"url_path": path}) for _ in bodies]
    answers = handler.handle([{"body": json.dumps(b).encode()} for b in bodies], context)
    return [(context.get_response_status(i)[0], json.loads(a)) for i, a in enumerate(answers)]


def test_dimensions_cut_and_renormalize_a_matryoshka_export(local_handler) -> None:
    (_, whole), (_, cut), (status, refused) = handle_here(local_handler, [
        {"input": TEXTS[:2], "encoding_format": "float"},
        {"input": TEXTS[:2], "dimensions": 8, "encoding_format": "float"},
        {"input": "a film", "dimensions": 33}])
    whole = torch.tensor([d["embedding"] for d in whole["data"]])
    cut = torch.tensor([d["embedding"] for d in cut["data"]])
    assert whole.shape == (2, 32) and cut.shape == (2, 8)
    assert torch.allclose(cut, torch.nn.functional.normalize(whole[:, :8], dim=-1), atol=1e-6)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(2), atol=1e-6)
    assert status == 400 and "from 1 to 32" in refused["error"]["message"]


def test_a_failing_row_fails_its_request_alone(local_handler, monkeypatch) -> None:
    """A row that makes the model raise (any token BROKEN) is a 500 for its request alone,
    and one it embeds as NaN (any token NAN) a 422: the batch is run again a request at a
    time."""
    broken, nan = 30000, 30001  # in no row of TEXTS
    assert not {broken, nan} & {t for ids in local_handler.tokenizer(TEXTS)["input_ids"]
                                for t in ids}
    forward = local_handler.forward

    def fussy(ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if (ids == broken).any():
            raise RuntimeError("the model broke")
        out = forward(ids, *rest)
        return torch.where((ids == nan).any(-1, keepdim=True), float("nan"), out)

    bodies = [{"input": t, "encoding_format": "float"} for t in TEXTS]
    alone = [handle_here(local_handler, [b])[0][1] for b in bodies]
    monkeypatch.setattr(local_handler, "forward", fussy)
    answers = handle_here(local_handler, [*bodies[:2], {"input": [[5, broken]]},
                                          {"input": [nan, 7]}, *bodies[2:]])
    assert [status for status, _ in answers] == [200, 200, 500, 422, 200, 200]
    assert answers[2][1]["error"]["message"] == "embedding failed"
    for (_, got), want in zip(answers[:2] + answers[4:], alone, strict=True):
        assert close(got["data"][0]["embedding"], torch.tensor(want["data"][0]["embedding"]),
                     atol=1e-5)


def test_a_batch_of_mixed_lengths_runs_in_passes_of_similar_length(local_handler,
                                                                   monkeypatch) -> None:
    """Short texts beside a long one are not padded to its length: the batch runs in two
    passes (the short rows together, the long one alone), with fewer padded tokens than one
    pass, and each answer equals the one its text gets alone; `length_buckets: false` keeps
    one pass of the same answers."""
    long_text = " ".join(["a remarkably long and winding review of a film"] * 12)
    bodies = [{"input": t, "encoding_format": "float"} for t in [*TEXTS[:3], long_text]]
    alone = [handle_here(local_handler, [b])[0][1]["data"][0]["embedding"] for b in bodies]
    forward, shapes = local_handler.forward, []

    def counted(ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(ids.shape))
        return forward(ids, *rest)

    monkeypatch.setattr(local_handler, "forward", counted)
    for buckets, passes in ((True, 2), (False, 1)):
        shapes.clear()
        monkeypatch.setattr(local_handler, "length_buckets", buckets)
        answers = handle_here(local_handler, bodies)
        assert len(shapes) == passes, shapes
        for (status, got), want in zip(answers, alone, strict=True):
            assert status == 200 and close(got["data"][0]["embedding"], torch.tensor(want),
                                           atol=1e-5)
        padded_tokens = sum(rows * length for rows, length in shapes)
        longest = max(length for _, length in shapes)
        if buckets:
            assert sorted(rows for rows, _ in shapes) == [1, 3]
            assert padded_tokens < 4 * longest
        else:
            assert padded_tokens == 4 * longest


# ---- issue 70: the property, beside the good requests of a batch ------------------------------

VOCAB, WIDTH = 30522, 32  # cls_bert_folder: MiniLM's tokenizer, 32 wide
EMBEDDINGS = "/1.0/v1/embeddings"
PROPERTY_GOOD = [(b'{"text": "the film was wonderful"}', ""),
                 (b'{"texts": ["a dull, lifeless movie", "hi"]}', ""),
                 (b'{"input": "one of the best performances", "encoding_format": "float"}',
                  EMBEDDINGS)]


def _property_strategies():
    """(valid-but-odd cases, arbitrary cases): each a ((body, content type), route)."""
    from hypothesis import strategies as st
    from test_classifier_property import ARBITRARY, JSON, ODD, ODD_TEXT, VALUES

    ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_CHARS)
    optional = {"encoding_format": st.sampled_from([None, "float", "base64"]),
                "dimensions": st.sampled_from([None, WIDTH]),
                "model": st.none() | st.text(st.characters(exclude_categories=["Cs"]),
                                             max_size=20),
                "user": st.none() | st.text(max_size=20).filter(
                    lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t))}
    odd_input = st.one_of(ODD_TEXT, st.lists(ODD_TEXT, min_size=1, max_size=MAX_ITEMS), ids,
                          st.lists(ids, min_size=1, max_size=8))
    odd_openai = st.builds(lambda body, ascii_only: (json.dumps(body, ensure_ascii=ascii_only)
                                                     .encode(), JSON),
                           st.fixed_dictionaries({"input": odd_input}, optional=optional),
                           st.booleans())
    odd = st.one_of(st.tuples(ODD, st.just("")), st.tuples(odd_openai, st.just(EMBEDDINGS)))
    arbitrary_fields = st.fixed_dictionaries({}, optional={
        "input": VALUES | st.lists(st.integers(-5, VOCAB + 5), max_size=5),
        "encoding_format": VALUES, "dimensions": VALUES | st.integers(-1, 64),
        "model": VALUES, "user": VALUES, "temperature": VALUES, "extra": VALUES})
    arbitrary_openai = st.builds(lambda body, ascii_only: (json.dumps(
        body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"), JSON),
        arbitrary_fields | VALUES, st.booleans())
    arbitrary = st.one_of(st.tuples(ARBITRARY, st.just("")),
                          st.tuples(arbitrary_openai | ARBITRARY.filter(
                              lambda case: case[1] == JSON), st.just(EMBEDDINGS)))
    return odd, arbitrary


def openai_body_valid(body: bytes) -> bool:
    """The oracle of `v1/embeddings` (requests.py's contract): a JSON object of input,
    encoding_format (float, base64), dimensions (the model's own width: no Matryoshka),
    model (a string) and user (ignored), `null` as absent; input a non-blank string, 1-64
    of them, a token array or 1-64 non-empty token arrays (ids in the vocabulary, at most
    200 a row); texts of at most 200 characters of valid Unicode."""
    from served_property import json_value, text_items_valid

    reads, value = json_value(body, "application/json")
    if not reads or not isinstance(value, dict):
        return False
    value = {k: v for k, v in value.items() if v is not None}
    if set(value) - {"input", "model", "encoding_format", "dimensions", "user"}:
        return False
    if any(k in value and not isinstance(value[k], str) for k in ("model", "user")):
        return False
    if value.get("encoding_format", "float") not in ("float", "base64"):
        return False
    dimensions = value.get("dimensions", WIDTH)
    if isinstance(dimensions, bool) or dimensions != WIDTH or not isinstance(dimensions, int):
        return False
    given = value.get("input")
    given = [given] if isinstance(given, str) else given
    if not isinstance(given, list) or not given:
        return False

    def is_id(t: object) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    if all(is_id(t) for t in given):
        arrays = [given]
    elif all(isinstance(t, str) for t in given):
        return text_items_valid({"texts": given}, MAX_CHARS, MAX_ITEMS)
    elif all(isinstance(a, list) and a and all(is_id(t) for t in a) for a in given):
        arrays = given
    else:
        return False
    return len(arrays) <= MAX_ITEMS and all(
        len(a) <= MAX_CHARS and all(0 <= t < VOCAB for t in a) for a in arrays)


def embedding_rows(answer: bytes) -> tuple[list[list[float]], object]:
    """(the embeddings of an answer, native or OpenAI's (base64 decoded), everything else
    in it)."""
    value = json.loads(answer)
    if "data" not in value:
        rows = value.get("embeddings") or [value["embedding"]]
        return rows, sorted(value)
    rows = []
    for entry in value["data"]:
        vector = entry["embedding"]
        if isinstance(vector, str):
            vector = torch.frombuffer(bytearray(base64.b64decode(vector)),
                                      dtype=torch.float32).tolist()
        rows.append(vector)
    rest = {k: v for k, v in value.items() if k != "data"}
    return rows, (rest, [(e["object"], e["index"], type(e["embedding"]).__name__)
                         for e in value["data"]])


def same_embeddings(got: bytes, want: tuple[list[list[float]], object]) -> bool:
    rows, rest = embedding_rows(got)
    return rest == want[1] and [len(r) for r in rows] == [len(r) for r in want[0]] and all(
        abs(g - w) <= 1e-5 for gr, wr in zip(rows, want[0], strict=True)
        for g, w in zip(gr, wr, strict=True))


def test_any_body_fails_alone_and_odd_valid_ones_answer_as_alone(served, engine) -> None:
    """Issue 70's property for the embedding archive (batch size 8, 50 ms delay) on both
    routes: valid-but-odd requests (any valid Unicode text, texts, token arrays, base64,
    `dimensions` at the model's width, any model and user names, nulls) get 200 and exactly
    the answer they get alone (within 1e-5); arbitrary bodies get a 4xx unless the oracle
    (`served_property.text_body_valid`, `openai_body_valid`) finds them valid, then 200 and
    their alone answer. Each shared a batch with three good requests (X-Batch-Size), whose
    answers are their alone answers; a plain request answered 200 within `PLAIN_LIMIT_S`
    throughout. TorchServe's frontend refusing a form body it cannot decode (its own 500,
    before any handler) is the one exception, as in the classifier's property.
    COMPRESS_PROPERTY_EXAMPLES generated cases (default 20), counted apart from the named
    ones."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st
    from served_property import (
        Probe,
        Tally,
        beside_goods,
        examples,
        frontend_form_refusal,
        run_property,
        text_body_valid,
    )
    from served_property import post as send

    wanted = examples(20)
    odd, arbitrary = _property_strategies()
    alone = []
    for body, path in PROPERTY_GOOD:
        answer = send(served, path, body)
        assert answer.status == 200, answer.body
        alone.append(embedding_rows(answer.body))
    tally = Tally()
    plain = Probe(lambda: send(served, "", b'{"text": "a fine film"}'))
    json_type = "application/json"

    @settings(max_examples=wanted, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(st.tuples(odd, st.just("odd")),
                          st.tuples(arbitrary, st.just("arbitrary"))), generated=st.just(True))
    @example(case=(((b'{"input": [[5, 10]], "dimensions": 32, "encoding_format": "base64", '
                     b'"model": null, "user": "\\u00e9"}', json_type), EMBEDDINGS), "odd"),
             generated=False)
    @example(case=(((b'{"input": ["\\u0000x", "\\ud83d\\ude00"]}', json_type), EMBEDDINGS),
                   "odd"), generated=False)
    @example(case=(((b"{}", json_type), EMBEDDINGS), "arbitrary"), generated=False)
    # the soak's 1000 cases: TorchServe's frontend refuses a form body it cannot decode
    # with its own 500, before any handler (see test_classifier_property's docstring)
    @example(case=(((b'{"texts": [{"&&": null}]}', "application/x-www-form-urlencoded"), ""),
                   "arbitrary"), generated=False)
    # a form without fields: no body (LitServe handed its bytes over as a text until
    # 2026-12-02, when a generated case found it)
    @example(case=(((b"&", "application/x-www-form-urlencoded"), ""), "arbitrary"),
             generated=False)
    @example(case=(((b'{"input": "x", "dimensions": 32.0}', json_type), EMBEDDINGS),
                   "arbitrary"), generated=False)
    @example(case=(((b'{"input": [true, 5]}', json_type), EMBEDDINGS), "arbitrary"),
             generated=False)
    @example(case=(((b'"{\\"input\\": \\"x\\"}"', json_type), EMBEDDINGS), "arbitrary"),
             generated=False)
    def check(case: tuple[tuple[tuple[bytes, str], str], str], generated: bool) -> None:
        ((body, content_type), path), kind = case
        valid = (openai_body_valid(body) if path else
                 text_body_valid(body, content_type, MAX_CHARS, MAX_ITEMS))
        assert valid or kind != "odd", ("the odd strategy drew an invalid body", body[:200])
        want = None
        if valid:
            first = send(served, path, body, content_type)
            assert first.status == 200, (path, body[:200], first.status, first.body[:300])
            want = embedding_rows(first.body)
        place = (tally.generated + tally.named) % (len(PROPERTY_GOOD) + 1)

        mine, goods = beside_goods(
            [lambda good=good, at=at: send(served, at, good) for good, at in PROPERTY_GOOD],
            lambda: send(served, path, body, content_type), place, tally,
            lambda answer: frontend_form_refusal(engine, content_type, answer))
        verdict = "valid" if valid else "invalid"
        tally.count(generated, kind if kind == "odd" else f"arbitrary {verdict}", mine.status)
        if valid:
            assert mine.status == 200, (path, body[:200], mine.status, mine.body[:300])
            assert same_embeddings(mine.body, want), (path, body[:200])
            tally.compared += 1
        else:
            assert 400 <= mine.status < 500 or frontend_form_refusal(
                engine, content_type, mine), (path, body[:200], mine.status, mine.body[:300])
        for answer, expected in zip(goods, alone, strict=True):
            assert answer.status == 200, (body[:200], answer.status, answer.body[:300])
            assert same_embeddings(answer.body, expected), body[:200]

    run_property(check, tally, plain, "embedding", engine, wanted)
