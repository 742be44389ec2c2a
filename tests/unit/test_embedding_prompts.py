"""Issue 71 items 2 and 3, served in this process: a folder saved by sentence-transformers with
prompts (`query: ` / `passage: `, default `query`), a Dense head to 256 and `truncate_dim:
128`, traced to TorchScript and answered by the embedding handler as a TorchServe worker
drives it. `input_type: query` equals `encode(prompt_name="query")`, the native route's
`prompt_name` names a prompt, an unknown one is a 400 naming the choices, and an answer is
128 wide unless the request asks for another width."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

pytest.importorskip("ts")
st = pytest.importorskip("sentence_transformers")

from sentence_transformers.sentence_transformer import modules  # noqa: E402
from ts.context import Context, RequestProcessor  # noqa: E402

from compress.families.embedding.folder import load_recipe_encoder, provenance  # noqa: E402
from serve.embedding.handler import EmbeddingHandler  # noqa: E402

TEXTS = ["the film was wonderful", "a dull, lifeless movie", "hi"]
PROMPTS = {"query": "query: ", "document": "passage: "}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[EmbeddingHandler, Any]:
    """(the handler on the traced folder, the SentenceTransformer it was saved from)."""
    from conftest import minilm_folder
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("prompted")
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=64)).save_pretrained(root / "bert")
    tokenizer.save_pretrained(root / "bert")
    model = st.SentenceTransformer(
        modules=[modules.Transformer(str(root / "bert")), modules.Pooling(32, "mean"),
                 modules.Dense(32, 256), modules.Normalize()],
        prompts=PROMPTS, default_prompt_name="query", truncate_dim=128, device="cpu")
    model.save(str(root / "st"), create_model_card=False)
    bundle = load_recipe_encoder(str(root / "st"))
    export = root / "export"
    export.mkdir()
    ids = torch.tensor([[101, 2204, 3185, 7592, 102], [101, 2919, 102, 0, 0]])
    with torch.no_grad():
        traced = torch.jit.trace(bundle.model, (ids, (ids > 0).long(), torch.zeros_like(ids)),
                                 strict=False, check_trace=False)
    traced.save(str(export / "model.pt"))
    (export / "export.json").write_text(json.dumps({
        "format": "torchscript", "file": "model.pt", "outputs": ["embedding"],
        "inputs": ["input_ids", "attention_mask", "token_type_ids"],
        "embedding": provenance(bundle)}))
    bundle.tokenizer.save_pretrained(export)
    context = Context("m", str(export), None, 8, None, "0.12.0", model_yaml_config={
        "maxWorkers": 1, "batchSize": 8, "handler": {"threads": 1}})
    handler = EmbeddingHandler()
    handler.initialize(context)
    return handler, model


def post(handler: EmbeddingHandler, body: dict[str, Any], path: str = "v1/embeddings"
         ) -> tuple[int, Any]:
    """(status, answer) of one JSON body on `path` ("": the native route)."""
    context = Context("m", "", None, 1, None, "0.12.0")
    context.request_processor = [RequestProcessor({"body": {"content-type": "application/json"},
                                                   "url_path": path})]
    [answer] = handler.handle([{"body": body}], context)
    return context.get_response_status(0)[0], json.loads(answer)


def vectors(answer: dict[str, Any]) -> torch.Tensor:
    if "data" in answer:
        return torch.tensor([row["embedding"] for row in answer["data"]])
    return torch.tensor(answer["embeddings"])


def encode(model: Any, width: int = 128, **options: Any) -> torch.Tensor:
    """sentence-transformers' embeddings cut at `width`, made unit length again (the served
    model normalizes: a cut embedding is normalized again, as OpenAI's are)."""
    whole = model.encode(TEXTS, convert_to_tensor=True, truncate_dim=256, **options).float()
    return torch.nn.functional.normalize(whole[:, :width], dim=-1)


def test_input_type_is_the_models_prompt_and_truncate_dim_the_default_width(served) -> None:
    handler, model = served
    for input_type, name in (("query", "query"), ("document", "document")):
        status, answer = post(handler, {"input": TEXTS, "input_type": input_type})
        assert status == 200, answer
        got = vectors(answer)
        assert got.shape == (3, 128)  # truncate_dim: the width of an answer that asks none
        assert torch.allclose(got, encode(model, prompt_name=name), atol=1e-5)
    status, answer = post(handler, {"input": TEXTS})  # no input_type: the default prompt
    assert torch.allclose(vectors(answer), encode(model, prompt_name="query"), atol=1e-5)
    assert not torch.allclose(vectors(answer), encode(model, prompt_name="document"), atol=1e-3)


def test_dimensions_override_truncate_dim_within_the_width(served) -> None:
    handler, model = served
    status, answer = post(handler, {"input": TEXTS, "dimensions": 256})
    assert status == 200 and torch.allclose(vectors(answer), encode(model, 256), atol=1e-5)
    status, answer = post(handler, {"input": TEXTS, "dimensions": 64})
    assert status == 200 and vectors(answer).shape == (3, 64)
    status, answer = post(handler, {"input": TEXTS, "dimensions": 257})
    assert status == 400 and "from 1 to 256" in answer["error"]["message"]


def test_the_native_route_takes_prompt_name(served) -> None:
    handler, model = served
    status, answer = post(handler, {"texts": TEXTS, "prompt_name": "document"}, path="")
    assert status == 200
    assert torch.allclose(vectors(answer), encode(model, prompt_name="document"), atol=1e-5)
    status, answer = post(handler, {"text": TEXTS[0]}, path="")
    assert status == 200 and len(answer["embedding"]) == 128


def test_an_unknown_prompt_is_a_400_naming_the_choices(served) -> None:
    handler, _ = served
    status, answer = post(handler, {"input": "hi", "input_type": "passage"})
    assert status == 400 and "input_type: query or document, got 'passage'" in \
        answer["error"]["message"]
    status, answer = post(handler, {"text": "hi", "prompt_name": "search"}, path="")
    assert status == 400 and "one of this model's prompts (document, query)" in json.dumps(answer)


def test_model_and_user_are_strings_or_a_400(served) -> None:
    handler, _ = served
    for field in ("model", "user"):
        status, answer = post(handler, {"input": "hi", field: [1]})
        assert status == 400 and answer["error"]["message"] == f"{field}: a string"
    status, _ = post(handler, {"input": "hi", "model": "m", "user": "someone"})
    assert status == 200
