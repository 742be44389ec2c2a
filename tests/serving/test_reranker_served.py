"""Issue 71 item 4's serving tier: a random-init cross-encoder (2 layers, 64 wide, saved by
sentence-transformers' CrossEncoder) through recipes/rerank_int8.yaml shrunk to its fp32 ONNX
export and its ONNX Runtime dynamic int8 export, each packaged, on a small pair table (8
queries x 5 documents, JSONL: query, document, relevance), served at `v1/rerank`: the fp32
archive by TorchServe answers `CrossEncoder.predict`'s scores within 1e-5, the int8 one by
LitServe keeps Kendall's tau >= 0.9 against them per query (near-ties of fp32 within 0.001,
`measures.TIE_MARGIN`, not counted), and the run's report gives nDCG@10, MRR@10 and tau.

Issue 70's property on the route (the fp32 archive, on both engines): valid-but-odd rerank
and native bodies get 200 and exactly the answer they get alone, arbitrary bodies a 4xx
unless the oracle (`rerank_body_valid`) finds them valid, each sharing a batch with three
good requests, whose answers are their alone answers. COMPRESS_PROPERTY_EXAMPLES generated
cases (default 20); `benchmarks/soak/run.py --property-examples` sets it high."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import REPO, http_post, minilm_folder, serving, write_recipe

pytest.importorskip("ts")
pytest.importorskip("litserve")
st = pytest.importorskip("sentence_transformers")

pytestmark = pytest.mark.serving

WORDS = ["film", "cast", "script", "score", "plot", "pace", "ending", "camera", "story",
         "humour", "dialogue", "music"]
ADJECTIVES = ["gripping", "dull", "sharp", "lifeless", "warm", "clumsy", "superb", "flat"]
MAX_CHARS, MAX_DOCUMENTS = 200, 64  # the archives' limits (max_text_chars, max_items)
RERANK = "/1.0/v1/rerank"


def pair_table(path: Path) -> list[dict[str, Any]]:
    """8 queries x 5 documents: the first document of each query is relevant (2), the next
    one shares its adjective (1), the rest not (0)."""
    rows = []
    for q, adjective in enumerate(ADJECTIVES):
        query = f"a {adjective} {WORDS[q]}"
        documents = [f"the {WORDS[q]} is {adjective} from start to finish",
                     f"a {adjective} {WORDS[(q + 3) % len(WORDS)]}, and little else",
                     *(f"the {WORDS[(q + k) % len(WORDS)]} was "
                       f"{ADJECTIVES[(q + k) % len(ADJECTIVES)]}" for k in (5, 6, 7))]
        rows += [{"query": query, "document": d, "relevance": grade}
                 for d, grade in zip(documents, (2, 1, 0, 0, 0), strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def cross_encoder(folder: Path) -> Path:
    """A random 2-layer, 64-wide BERT with a one-label head, saved by CrossEncoder (v6:
    Sigmoid). Its weights start 2.5x wider than BERT's default and its head 75x, so that
    its scores spread out (73 of the 80 document pairs more than 0.001 apart) without
    activations so large that per-tensor int8 activations lose their order (32 wide at 10x:
    tau 0.68 to 0.79 through ONNX Runtime int8; this one: 0.95)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder(), model_max_length=64)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
        num_labels=1, initializer_range=0.05))
    with torch.no_grad():
        model.classifier.weight.mul_(30)
    model.save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    st.CrossEncoder(str(folder / "hf"), device="cpu").save(str(folder / "ce"))
    return folder / "ce"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    """rerank_int8.yaml shrunk: {"run_dir", "mars": {"fp32", "int8"}, "rows", "predict"}."""
    from builders import run_in_process

    tmp = tmp_path_factory.mktemp("rerank")
    folder = cross_encoder(tmp)
    rows = pair_table(tmp / "pairs" / "validation.jsonl")
    raw = yaml.safe_load((REPO / "recipes/rerank_int8.yaml").read_text())
    raw["model"]["source"] = str(folder)
    raw["data"] = {"source": str(tmp / "pairs"), "text_column": "query",
                   "pair_column": "document", "label_column": "relevance", "max_length": 64,
                   "eval": {"split": "validation"}}
    fp32, int8 = raw["stages"][0], raw["stages"][1]
    assert (fp32["name"], int8["name"], int8["quantize"]) == ("fp32_onnx", "int8_onnx",
                                                                "dynamic")
    package = {**raw["stages"][-1], "batch_size": 8, "max_batch_delay_ms": 50, "threads": 1,
               "max_text_chars": MAX_CHARS}
    raw["stages"] = [fp32, int8, {**package, "name": "serve_fp32", "artifact": "fp32_onnx"},
                     {**package, "name": "serve_int8", "artifact": "int8_onnx"}]
    raw["evaluation"] = {"batch_size": 16, "latency": {"enabled": False}}
    raw["output_dir"] = str(tmp / "runs")
    manifest = run_in_process(write_recipe(tmp / "rerank.yaml", raw))
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 4
    assert manifest["model"]["task"] == "reranking"
    model = st.CrossEncoder(str(folder), device="cpu")
    return {"run_dir": tmp / "runs" / raw["name"], "rows": rows, "manifest": manifest,
            "mars": {which: tmp / "runs" / raw["name"] / manifest["stages"][i]["outputs"][0]
                     ["path"] for which, i in (("fp32", 2), ("int8", 3))},
            "predict": lambda pairs: torch.tensor(model.predict(pairs)).float()}


def queries(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for row in rows:
        grouped.setdefault(row["query"], []).append(row["document"])
    return grouped


def served_scores(info: dict, query: str, documents: list[str]) -> torch.Tensor:
    """Each document's score from `v1/rerank`, back in the order sent."""
    body = {"model": "m", "query": query, "documents": documents, "return_documents": True}
    status, headers, answer = http_post(f"{info['url']}/1.0/v1/rerank",
                                        json.dumps(body).encode(), info.get("token"))
    assert status == 200, answer
    results = answer["results"]
    assert [r["relevance_score"] for r in results] == sorted(
        (r["relevance_score"] for r in results), reverse=True)
    assert all(r["document"]["text"] == documents[r["index"]] for r in results)
    scores = torch.zeros(len(documents))
    for r in results:
        scores[r["index"]] = r["relevance_score"]
    return scores


@pytest.fixture(scope="module")
def served(run, state_dir, engine: str) -> dict:
    """The fp32 archive served by `engine`."""
    yield from serving(run["mars"]["fp32"], engine, 180)


def test_fp32_serves_what_predict_gives(run, served) -> None:
    for query, documents in queries(run["rows"]).items():
        got = served_scores(served, query, documents)
        want = run["predict"]([(query, d) for d in documents])
        assert (got - want).abs().max() <= 1e-5, (query, got, want)


def test_int8_keeps_kendall_tau_against_fp32(run, state_dir) -> None:
    from compress.families.reranker.measures import TIE_MARGIN, kendall_tau

    server = serving(run["mars"]["int8"], "litserve", 180)
    info = next(server)
    try:
        taus, spread = [], []
        for query, documents in queries(run["rows"]).items():
            got = served_scores(info, query, documents)
            want = run["predict"]([(query, d) for d in documents])
            taus.append(kendall_tau(got.tolist(), want.tolist(), TIE_MARGIN))
            spread.append(float(want.max() - want.min()))
    finally:
        next(server, None)
    counted = [t for t in taus if t is not None]
    assert len(counted) == len(taus)  # every query has documents fp32 tells apart
    assert min(spread) > 10 * TIE_MARGIN
    assert sum(counted) / len(counted) >= 0.9, taus
    # the run held the int8 file to the same bound, and its report says so
    stages = {s["name"]: s["metrics"] for s in run["manifest"]["stages"]}
    assert stages["int8_onnx"]["parity_kendall_tau"] >= 0.9
    assert stages["int8_onnx"]["parity_min_kendall_tau"] == 0.9
    assert stages["fp32_onnx"]["parity_max_abs_diff"] <= 1e-4
    for name in ("fp32_onnx", "int8_onnx"):
        assert 0 < stages[name]["ndcg_at_10"] <= 1 and 0 < stages[name]["mrr_at_10"] <= 1
    assert stages["fp32_onnx"]["kendall_tau"] == 1.0
    from compress.report.build import build_report, render_markdown

    report = build_report(run["run_dir"])
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["int8_onnx"]["kendall_tau"] == stages["int8_onnx"]["kendall_tau"]
    markdown = render_markdown(report)
    for header in ("nDCG@10", "MRR@10", "Kendall τ", "max Δ score"):
        assert header in markdown


# issue 70's property on the reranker's routes: three good requests each case shares a batch with
PROPERTY_GOOD = [
    (b'{"query": "a gripping film", "documents": ["the film is gripping", "a dull plot"]}', ""),
    (b'{"query": "a warm story", "documents": ["the story was warm", "flat", "a warm cast"], '
     b'"top_n": 2}', RERANK),
    (b'{"query": "sharp dialogue", "documents": [{"text": "the dialogue is sharp"}, "music"], '
     b'"return_documents": true, "model": "m"}', RERANK)]


def rerank_body_valid(body: bytes, content_type: str, route: str) -> bool:
    """The oracle of both routes (requests.py's contract): a JSON object with `query` (a
    non-blank string) and `documents` (1-64 non-blank strings or objects whose `text` is one),
    each text at most 200 characters of valid Unicode; `v1/rerank` also takes `model` (a
    string), `top_n` (an integer >= 1) and `return_documents` (true or false); `null` is
    absent, and no other field."""
    from served_property import json_value

    reads, value = json_value(body, content_type)
    if not reads or not isinstance(value, dict):
        return False
    value = {k: v for k, v in value.items() if v is not None}
    fields = {"query", "documents"} | ({"model", "top_n", "return_documents"} if route else set())
    if set(value) - fields:
        return False
    documents = value.get("documents")
    if not isinstance(documents, list) or not 0 < len(documents) <= MAX_DOCUMENTS:
        return False
    texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
    if not all(isinstance(t, str) and t.strip() and len(t) <= MAX_CHARS
               and not any(0xD800 <= ord(c) <= 0xDFFF for c in t)
               for t in [value.get("query"), *texts]):
        return False
    top_n = value.get("top_n", 1)
    return (isinstance(value.get("model", ""), str) and isinstance(top_n, int)
            and not isinstance(top_n, bool) and top_n >= 1
            and isinstance(value.get("return_documents", False), bool))


def answer_scores(answer: bytes, route: str) -> dict[int, float]:
    """Each document's score by its index; a rerank answer is also checked to be best first,
    each result once."""
    value = json.loads(answer)
    if not route:
        return dict(enumerate(value["scores"]))
    scores = [r["relevance_score"] for r in value["results"]]
    assert scores == sorted(scores, reverse=True), scores
    indices = [r["index"] for r in value["results"]]
    assert len(set(indices)) == len(indices), indices
    return dict(zip(indices, scores, strict=True))


def same_answer(got: bytes, want: bytes, route: str) -> bool:
    """Whether two answers to one body agree: the same documents' scores (within 1e-5),
    and everything else (texts sent back, usage, model) equal."""
    mine, theirs = answer_scores(got, route), answer_scores(want, route)
    if set(mine) != set(theirs) or any(abs(mine[k] - theirs[k]) > 1e-5 for k in mine):
        return False
    if not route:
        return True

    def rest(answer: bytes) -> object:
        value = json.loads(answer)
        return (value["model"], value["usage"],
                sorted((r["index"], r.get("document")) for r in value["results"]))

    return rest(got) == rest(want)


def _property_strategies():
    """(valid-but-odd cases, arbitrary cases): each a ((body, content type), route)."""
    from hypothesis import strategies as st
    from test_classifier_property import ARBITRARY, JSON, ODD_TEXT, VALUES, _as_json

    document = ODD_TEXT | st.fixed_dictionaries({"text": ODD_TEXT})
    documents = st.lists(document, min_size=1, max_size=MAX_DOCUMENTS)
    named = st.none() | st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
    native = st.fixed_dictionaries({"query": ODD_TEXT, "documents": documents})
    rerank = st.fixed_dictionaries({"query": ODD_TEXT, "documents": documents}, optional={
        "top_n": st.none() | st.integers(1, 80), "return_documents": st.none() | st.booleans(),
        "model": named})
    odd = st.one_of(
        st.tuples(st.builds(lambda b, a: (_as_json(b, a), JSON), native, st.booleans()),
                  st.just("")),
        st.tuples(st.builds(lambda b, a: (_as_json(b, a), JSON), rerank, st.booleans()),
                  st.just(RERANK)))
    fields = st.fixed_dictionaries({}, optional={
        "query": VALUES | ODD_TEXT, "documents": VALUES | st.lists(VALUES | document,
                                                                    max_size=70),
        "top_n": VALUES | st.integers(-2, 5), "return_documents": VALUES, "model": VALUES,
        "extra": VALUES})
    shaped = st.builds(lambda b, a: (_as_json(b, a), JSON), fields | VALUES, st.booleans())
    arbitrary = st.tuples(shaped | ARBITRARY, st.sampled_from(["", RERANK]))
    return odd, arbitrary


def test_any_body_fails_alone_and_odd_valid_ones_answer_as_alone(served, engine) -> None:
    """Issue 70's property for the reranker archive (fp32, batch size 8, 50 ms delay) on
    both routes: valid-but-odd bodies (any valid Unicode query and documents, documents as
    strings or `{"text"}` objects, any top_n, model and return_documents, nulls) get 200 and
    the answer they get alone (scores within 1e-5); arbitrary bodies a 4xx unless
    `rerank_body_valid` finds them valid, then 200 and their alone answer. Each shared a
    batch with three good requests (X-Batch-Size), whose answers are their alone answers; a
    plain request answered 200 within `PLAIN_LIMIT_S` throughout. TorchServe's frontend
    refusing a form body it cannot decode (its own 500, before any handler) is the one
    exception, as in the classifier's property."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st
    from served_property import (
        Probe,
        Tally,
        beside_goods,
        examples,
        frontend_form_refusal,
        run_property,
    )
    from served_property import post as send
    from test_classifier_property import DEEP, JSON

    wanted = examples(20)
    odd, arbitrary = _property_strategies()
    alone = []
    for body, path in PROPERTY_GOOD:
        answer = send(served, path, body)
        assert answer.status == 200, answer.body
        alone.append(answer.body)
    tally = Tally()
    plain = Probe(lambda: send(served, "", PROPERTY_GOOD[0][0]))

    @settings(max_examples=wanted, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(st.tuples(odd, st.just("odd")),
                          st.tuples(arbitrary, st.just("arbitrary"))), generated=st.just(True))
    @example(case=(((b'{"query": "\\u0000x", "documents": ["\\ud83d\\ude00", {"text": " y"}],'
                     b' "top_n": 99, "model": null, "return_documents": true}', JSON), RERANK),
                   "odd"), generated=False)
    @example(case=(((b'{"query": "x", "documents": [{"text": "y", "id": 3}]}', JSON), ""),
                   "odd"), generated=False)
    @example(case=(((b'{"query": "x", "documents": ["\\ud800"]}', JSON), RERANK),
                   "arbitrary"), generated=False)
    @example(case=(((b'{"query": "x", "documents": ["y"], "top_n": 0}', JSON), RERANK),
                   "arbitrary"), generated=False)
    @example(case=(((b'{"query": "x", "documents": ["y"], "top_n": true}', JSON), RERANK),
                   "arbitrary"), generated=False)
    @example(case=(((b'{"query": "x", "documents": ["y"], "top_n": 2}', JSON), ""),
                   "arbitrary"), generated=False)
    @example(case=(((b'{"query": "x", "documents": []}', JSON), RERANK), "arbitrary"),
             generated=False)
    @example(case=(((b'{"query": "x", "documents": ' + json.dumps(["d"] * 65).encode() + b"}",
                     JSON), RERANK), "arbitrary"), generated=False)
    @example(case=(((b'{"query": "' + b"q" * (MAX_CHARS + 1) + b'", "documents": ["y"]}',
                     JSON), RERANK), "arbitrary"), generated=False)
    @example(case=(((DEEP, JSON), RERANK), "arbitrary"), generated=False)
    @example(case=(((b'"{\\"query\\": \\"x\\", \\"documents\\": [\\"y\\"]}"', JSON), RERANK),
                   "arbitrary"), generated=False)
    def check(case: tuple[tuple[tuple[bytes, str], str], str], generated: bool) -> None:
        ((body, content_type), path), kind = case
        valid = rerank_body_valid(body, content_type, path)
        assert valid or kind != "odd", ("the odd strategy drew an invalid body", body[:200])
        want = None
        if valid:
            first = send(served, path, body, content_type)
            assert first.status == 200, (path, body[:200], first.status, first.body[:300])
            want = first.body
        place = (tally.generated + tally.named) % (len(PROPERTY_GOOD) + 1)

        mine, goods = beside_goods(
            [lambda good=good, at=at: send(served, at, good) for good, at in PROPERTY_GOOD],
            lambda: send(served, path, body, content_type), place, tally,
            lambda answer: frontend_form_refusal(engine, content_type, answer))
        verdict = "valid" if valid else "invalid"
        tally.count(generated, kind if kind == "odd" else f"arbitrary {verdict}", mine.status)
        if valid:
            assert mine.status == 200, (path, body[:200], mine.status, mine.body[:300])
            assert same_answer(mine.body, want, path), (path, body[:200])
            tally.compared += 1
        else:
            assert 400 <= mine.status < 500 or frontend_form_refusal(
                engine, content_type, mine), (path, body[:200], mine.status, mine.body[:300])
        for answer, (_, at), expected in zip(goods, PROPERTY_GOOD, alone, strict=True):
            assert answer.status == 200, (body[:200], answer.status, answer.body[:300])
            assert same_answer(answer.body, expected, at), body[:200]

    run_property(check, tally, plain, "reranker", engine, wanted)


def test_loadtest_sends_queries_with_documents_to_the_rerank_route(served) -> None:
    """`compress loadtest URL/v1/rerank --task reranking`: every request a query with 8
    documents, all answered (a classifier's `{"text"}` bodies would all be 400s)."""
    from click.testing import CliRunner

    from compress.cli.serve import loadtest

    args = [f"{served['url']}{RERANK}", "--task", "reranking", "--concurrency", "1,4",
            "--requests", "12", "--warmup", "2"]
    if served.get("token"):
        args += ["--token", served["token"]]
    result = CliRunner().invoke(loadtest, args)
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()
            if line.split()[:1] and line.split()[0].isdigit()]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("1", "12", "12", "0"),
                                                        ("4", "12", "12", "0")], result.output
