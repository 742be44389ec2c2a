"""Issue 71's serving tier: retrieval models as users save them, through
recipes/embed_int8.yaml shrunk (its fp32 ONNX export and its ONNX Runtime int8 export, each
packaged) and served by a real server. Two folders around a 2-layer, 32-wide random BERT:

- `v6`: saved by the installed sentence-transformers (v6 keys), mean pooling, a Tanh Dense
  head to 256, Normalize, prompts (`query: ` / `passage: `, default `query`), `truncate_dim:
  128`, and declared Matryoshka widths 256 / 128 / 64;
- `legacy`: as sentence-transformers 2 wrote it (a `0_Transformer` subfolder, pooling flags
  mean and max, a Dense in `pytorch_model.bin`, Normalize).

Each fp32 archive answers what `SentenceTransformer.encode` gives within 1e-5, each int8
one within a mean cosine of 0.99 of it; `v6` answers 128 wide unless asked, `input_type: query` is
`encode(prompt_name="query")`, and its report has recall@10 at each declared width. The fp32
and int8 archives of a folder are served by different engines (TorchServe and LitServe), so
both engines serve both layouts' halves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import REPO, http_post, serving, write_recipe, write_sentiment_tables

pytest.importorskip("ts")
pytest.importorskip("litserve")
st = pytest.importorskip("sentence_transformers")

pytestmark = pytest.mark.serving

TEXTS = ["the film was wonderful", "a dull, lifeless movie", "hi",
         "one of the best performances of the year, and a script to match it"]
PROMPTS = {"query": "query: ", "document": "passage: "}
WIDTH = 32
# (folder kind, engine of its fp32 archive, engine of its int8 archive)
CASES = [("v6", "torchserve", "litserve"), ("legacy", "litserve", "torchserve")]


def v6_folder(folder: Path, bert: Path) -> Path:
    from sentence_transformers.sentence_transformer import modules

    torch.manual_seed(1)
    model = st.SentenceTransformer(
        modules=[modules.Transformer(str(bert)), modules.Pooling(WIDTH, "mean"),
                 modules.Dense(WIDTH, 256, activation_function=torch.nn.Tanh()),
                 modules.Normalize()],
        prompts=PROMPTS, default_prompt_name="query", truncate_dim=128, device="cpu")
    model.save(str(folder), create_model_card=False)
    config = folder / "config_sentence_transformers.json"
    saved = json.loads(config.read_text())
    config.write_text(json.dumps({**saved, "matryoshka": True,
                                  "matryoshka_dims": [256, 128, 64]}))
    return folder


@pytest.fixture(scope="module", params=CASES, ids=[case[0] for case in CASES])
def case(request) -> tuple[str, str, str]:
    return request.param


@pytest.fixture(scope="module")
def run(case, tmp_path_factory) -> dict[str, Any]:
    """The folder through embed_int8.yaml shrunk: {"folder", "run_dir", "mars": {"fp32",
    "int8"}, "encode"}: encode(texts, **options) is sentence-transformers' own."""
    from builders import legacy_st_folder, run_in_process, tiny_bert_folder

    kind = case[0]
    tmp = tmp_path_factory.mktemp(f"layout_{kind}")
    bert = tiny_bert_folder(tmp / "bert", WIDTH)
    folder = (v6_folder(tmp / "st", bert) if kind == "v6"
              else legacy_st_folder(tmp / "st", bert, WIDTH, 48, 64, bias_scale=1 / 8))
    raw = yaml.safe_load((REPO / "recipes/embed_int8.yaml").read_text())
    raw["name"] = f"layout_{kind}"
    raw["model"]["source"] = str(folder)
    raw["data"] = {"source": str(write_sentiment_tables(tmp / "data", 16, 24)),
                   "text_column": "sentence", "label_column": "label", "max_length": 64,
                   "eval": {"split": "validation"}}
    fp32, int8 = raw["stages"][0], raw["stages"][1]
    assert (fp32["name"], int8["name"], int8["quantize"]) == ("fp32_onnx", "int8_onnx",
                                                                "dynamic")
    package = {**raw["stages"][-1], "batch_size": 8, "max_batch_delay_ms": 20, "threads": 1}
    raw["stages"] = [fp32, int8, {**package, "name": "serve_fp32", "artifact": "fp32_onnx"},
                     {**package, "name": "serve_int8", "artifact": "int8_onnx"}]
    raw["evaluation"] = {"batch_size": 16, "latency": {"enabled": False}}
    raw["output_dir"] = str(tmp / "runs")
    manifest = run_in_process(write_recipe(tmp / "embed.yaml", raw))
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 4
    run_dir = tmp / "runs" / raw["name"]
    mars = {which: run_dir / manifest["stages"][i]["outputs"][0]["path"]
            for which, i in (("fp32", 2), ("int8", 3))}
    model = st.SentenceTransformer(str(folder), device="cpu")

    def encode(texts: list[str], **options: Any) -> torch.Tensor:
        return model.encode(texts, convert_to_tensor=True, **options).float()

    return {"folder": folder, "run_dir": run_dir, "mars": mars, "encode": encode}


def served(run: dict[str, Any], which: str, engine: str):
    """A fixture body: the `which` archive served by `engine` (its .serve folder beside it)."""
    return serving(run["mars"][which], engine, 180)


def embeddings(info: dict, body: dict[str, Any]) -> torch.Tensor:
    status, _, answer = http_post(f"{info['url']}/1.0/v1/embeddings", json.dumps(body).encode(),
                                  info.get("token"))
    assert status == 200, answer
    return torch.tensor([row["embedding"] for row in answer["data"]])


def asked(case, **body: Any) -> dict[str, Any]:
    """A request for TEXTS at the folder's full width: v6 names it (its default is
    truncate_dim's 128); legacy, which declares no Matryoshka training, takes no
    `dimensions` and answers 48 wide."""
    return {"input": TEXTS, **body, **({"dimensions": 256} if case[0] == "v6" else {})}


def full_width(case) -> int:
    return 256 if case[0] == "v6" else 48


def test_fp32_serves_what_encode_gives(run, case, state_dir) -> None:
    kind, engine, _ = case
    width = full_width(case)
    server = served(run, "fp32", engine)
    info = next(server)
    try:
        whole = embeddings(info, asked(case))
        want = run["encode"](TEXTS, truncate_dim=width)
        assert whole.shape == want.shape == (len(TEXTS), width)
        assert (whole - want).abs().max() <= 1e-5, (whole - want).abs().max()
        if kind == "v6":
            # truncate_dim: 128 wide unless asked, cut and made unit length again
            default = embeddings(info, {"input": TEXTS})
            assert default.shape == (len(TEXTS), 128)
            cut = torch.nn.functional.normalize(want[:, :128], dim=-1)
            assert (default - cut).abs().max() <= 1e-5
            query = embeddings(info, asked(case, input_type="query"))
            document = embeddings(info, asked(case, input_type="document"))
            assert (query - run["encode"](TEXTS, prompt_name="query",
                                          truncate_dim=width)).abs().max() <= 1e-5
            assert (document - run["encode"](TEXTS, prompt_name="document",
                                             truncate_dim=width)).abs().max() <= 1e-5
            assert (query - document).abs().max() > 1e-3  # the prompts change the vectors
    finally:
        next(server, None)


def test_int8_serves_within_cosine_0_99_of_encode(run, case, state_dir) -> None:
    _, _, engine = case
    width = full_width(case)
    server = served(run, "int8", engine)
    info = next(server)
    try:
        got = embeddings(info, asked(case))
    finally:
        next(server, None)
    want = run["encode"](TEXTS, truncate_dim=width)
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    # the mean over the texts, as min_fidelity reads it (a random 32-wide model: v6's "hi"
    # alone is at 0.988, its mean 0.993)
    assert cosine.mean() >= 0.99 and cosine.min() >= 0.98, cosine


def test_the_report_gives_recall_at_each_declared_width(run, case) -> None:
    from compress.report.build import build_report, render_markdown

    report = build_report(run["run_dir"])
    rows = {row["name"]: row for row in report["rows"]}
    measured = [rows["fp32_onnx"], rows["int8_onnx"]]
    if case[0] == "legacy":  # no Matryoshka widths declared: none measured
        assert not any(k.startswith("recall_at_10_d") for row in measured for k in row)
        assert all(0 <= row["recall_at_10"] <= 1 for row in measured)
        return
    for row in measured:
        for width in (128, 64):
            assert 0 <= row[f"recall_at_10_d{width}"] <= 1, row
        assert 0 <= row["recall_at_10_document"] <= 1  # the other prompt, measured too
    assert rows["fp32_onnx"]["fidelity"] > 0.99999
    markdown = render_markdown(report)
    for header in ("recall@10 d128", "recall@10 d64", "cosine d128", "recall@10 document"):
        assert header in markdown
