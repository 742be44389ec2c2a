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
MAX_CHARS, MAX_ITEMS = 200, 64


@pytest.fixture(scope="module")
def embedding_run(cls_bert_folder: Path, tmp_path_factory) -> Path:
    """recipes/embed_int8.yaml on cls_bert_folder and a small sentiment table: its fp32 ONNX
    export, packaged (batch size 8, 50 ms delay, 200 characters a text); the run folder."""
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
