"""Issue 44 item 4, acceptance: recipes/embed_int8.yaml on the real all-MiniLM-L6-v2 (shrunk:
24 eval sentences, no latency), its fp32 ONNX and ONNX Runtime int8 exports packaged and
served by LitServe (the handler is TorchServe's; tests/serving runs both engines): the
served embeddings of 16 texts, one past max_seq_length, equal sentence-transformers' own
`encode` of the same model (cosine >= 0.99999 for fp32; mean >= 0.99 for int8), through
OpenAI's client and the native route alike."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, http_post, minilm_folder, removed_after_module, serving, write_recipe

pytest.importorskip("ts")
pytest.importorskip("litserve")
openai = pytest.importorskip("openai")
sentence_transformers = pytest.importorskip("sentence_transformers")

pytestmark = [pytest.mark.integration, pytest.mark.serving]

LONG = " ".join(["a long and winding review of a film that goes on and on"] * 40)  # > 256


def _texts(data_dir: Path) -> list[str]:
    """15 SST-2 validation sentences past those the run evaluates, and LONG."""
    lines = (data_dir / "stanfordnlp/sst2/validation.tsv").read_text().splitlines()
    column = lines[0].split("\t").index("sentence")
    return [line.split("\t")[column] for line in lines[101:116]] + [LONG]


@pytest.fixture(scope="module")
def minilm_run(request, tmp_path_factory, data_dir: Path) -> Path:
    """The recipe's fp32 ONNX and int8 ONNX exports, each packaged (embed_fp32,
    embed_int8); the run folder."""
    from builders import run_in_process

    tmp = removed_after_module(request, tmp_path_factory.mktemp("embed_int8"))
    raw = yaml.safe_load((REPO / "recipes/embed_int8.yaml").read_text())
    fp32, int8, *_, package = raw["stages"]
    assert (fp32["name"], int8["name"], package["kind"]) == ("fp32_onnx", "int8_onnx",
                                                            "package")
    raw["stages"] = [fp32, int8,
                     {**package, "name": "pkg_fp32", "artifact": "fp32_onnx",
                      "model_name": "embed_fp32"},
                     {**package, "name": "pkg_int8", "artifact": "int8_onnx"}]
    raw["data"]["eval"]["max_samples"] = 24
    raw["evaluation"]["latency"] = {"enabled": False}
    raw["output_dir"] = str(tmp / "runs")
    recipe = write_recipe(tmp / "embed_int8.yaml", raw)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COMPRESS_DATA_DIR", str(data_dir))
        manifest = run_in_process(recipe)
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 4
    return tmp / "runs" / "embed_int8"


def _served(mar: Path, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the OpenAI client's embeddings of `texts` in one request, the native route's with
    every text a request of its own, all at once) from `mar` served by LitServe."""
    server = serving(mar, "litserve", 180)
    info = next(server)
    try:
        client = openai.OpenAI(base_url=f"{info['url']}/1.0/v1", api_key=info["token"],
                               max_retries=0)
        answer = client.embeddings.create(model=mar.stem, input=texts)
        with ThreadPoolExecutor(len(texts)) as pool:
            natives = list(pool.map(lambda t: http_post(
                info["url"], json.dumps({"text": t}).encode(), info["token"]), texts))
    finally:
        next(server, None)
    assert [status for status, _, _ in natives] == [200] * len(texts)
    return (torch.tensor([d.embedding for d in answer.data]),
            torch.tensor([a["embedding"] for _, _, a in natives]))


def test_served_minilm_embeds_as_sentence_transformers(minilm_run: Path, data_dir: Path,
                                                       state_dir) -> None:
    texts = _texts(data_dir)
    model = sentence_transformers.SentenceTransformer(minilm_folder(), device="cpu")
    assert len(model.tokenizer(LONG)["input_ids"]) > model.max_seq_length == 256
    want = torch.as_tensor(model.encode(texts, convert_to_numpy=True))
    cosine = torch.nn.functional.cosine_similarity
    for mar, least_each, least_mean in (("03-package/embed_int8.mar", 0.98, 0.99),
                                        ("02-package/embed_fp32.mar", 0.99999, 0.99999)):
        for got in _served(minilm_run / mar, texts):
            each = cosine(got, want, dim=-1)
            assert each.min() >= least_each and each.mean() >= least_mean, (mar, each)
