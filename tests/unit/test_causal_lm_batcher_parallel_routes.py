"""The OpenAI routes of an archive without the continuous batcher (tensor- and
pipeline-parallel workers decode TorchServe's batches, in `_handle_batch`): openapi.json
leaves them out, and the handler answers them with OpenAI's 404, beside good native
requests of the same batch. The batch path runs here in one process (ranks 1), as it does on
every rank of a parallel worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from compress.serving.openapi import write_openapi

PARALLEL = {"tp": {"parallelType": "tp", "torchrun": {"nproc-per-node": 2}},
            "pp": {"parallelType": "pp", "torchrun": {"nproc-per-node": 2}}}


def unpacked(folder: Path, settings: dict) -> Path:
    """An unpacked causal-LM archive's model-config.yaml and manifest."""
    folder.mkdir(parents=True)
    handler = {"task": "causal-lm", "max_new_tokens": 16}
    (folder / "model-config.yaml").write_text(yaml.safe_dump(settings | {"handler": handler}))
    (folder / "MAR-INF").mkdir()
    (folder / "MAR-INF/MANIFEST.json").write_text(json.dumps({"model": {"modelVersion": "2.0"}}))
    return folder


@pytest.mark.parametrize("kind", ["tp", "pp", "continuous"])
def test_openapi_lists_the_openai_routes_only_where_the_handler_answers_them(
        tmp_path: Path, kind: str) -> None:
    settings = PARALLEL.get(kind) or {"asyncCommunication": True, "batchSize": 1}
    path = write_openapi(unpacked(tmp_path / "m", settings), tmp_path, "tiny")
    assert path is not None
    paths = set(json.loads(path.read_text())["paths"])
    openai = {f"/predictions/tiny/2.0/v1/{r}" for r in ("chat/completions", "completions",
                                                        "models")}
    assert paths == {"/predictions/tiny"} | (openai if kind == "continuous" else set())


@pytest.fixture(scope="module")
def batch_handler(varied_llama_folder, tmp_path_factory):
    pytest.importorskip("ts")
    from builders import causal_lm_handler, saved_causal_lm

    from compress.families.causal_lm.stages.export import export_causal_lm
    from compress.models.bundle import ModelBundle
    from serve.causal_lm.runtime.loading import load_folder

    folder = tmp_path_factory.mktemp("lm_export") / "transformers"
    lm = load_folder(saved_causal_lm(varied_llama_folder, tmp_path_factory.mktemp("saved")))
    export_causal_lm(ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer,
                                 causal_lm_facts=lm.facts),
                     folder)
    handler = causal_lm_handler(folder, 4, {"threads": 1, "max_new_tokens": 8,
                                            "default_new_tokens": 4, "cache_len": 32,
                                            "compile": "none", "chat_template": False})
    assert handler.batcher is None  # the batch path, as on a parallel worker's ranks
    return handler


@pytest.mark.parametrize("route", ["v1/chat/completions", "v1/completions", "v1/models"])
def test_the_batch_path_answers_the_openai_routes_with_openais_404(batch_handler,
                                                                   route: str) -> None:
    from builders import handler_batch
    from ts.context import RequestProcessor

    bodies = [{"prompt": "the film was", "max_new_tokens": 4, "stream": False},
              {"model": "tiny_lm", "messages": [{"role": "user", "content": "hi"}],
               "prompt": "hi", "max_tokens": 4}]
    data, context, _ = handler_batch(bodies)
    context.request_processor[1] = RequestProcessor({"url_path": route})
    answers = [json.loads(a) for a in batch_handler.handle(data, context)]
    assert context.get_response_status(1)[0] == 404
    assert answers[1]["error"]["type"] == "not_found_error"
    assert set(answers[1]["error"]) >= {"message", "type", "param", "code"}
    assert answers[0]["finish_reason"] == "length"  # the native request beside it: answered
    assert answers[0]["usage"]["completion_tokens"] == 4
