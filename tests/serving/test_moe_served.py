"""A tiny random Qwen2-MoE (shared expert and shared_expert_gate; `moe_models.py`) through
int8_grouped -> compile -> export -> package, served by one LitServe instance: concurrent
requests are batched (continuous batching) and answer the greedy text causal_lm.runtime
gives offline, and int8_grouped agrees with the float model on every greedy token."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import serving, serving_missing, write_recipe
from moe_models import tiny_moe_folder

pytest.importorskip("ts")

from serve.causal_lm.runtime import loading  # noqa: E402

pytestmark = [pytest.mark.serving,
              pytest.mark.skipif(bool(serving_missing("litserve")),
                                 reason="; ".join(serving_missing("litserve")))]

PROMPTS = ["the film was", "a much longer prompt about a movie that goes on and on", "hi",
           "why is the sky blue"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, data_dir: Path) -> Path:
    from compress.pipeline.loop import run_recipe
    from compress.recipe.schema import load_recipe

    folder = tmp_path_factory.mktemp("moe_served")
    model = tiny_moe_folder("qwen2_moe", folder / "model")
    (folder / "prompts.txt").write_text("\n".join(PROMPTS[:2]) + "\n")
    stages = [{"kind": "quantize", "scheme": "int8_grouped", "activations": "float32"},
              {"kind": "compile"},
              {"kind": "export", "format": "transformers"},
              {"kind": "package", "model_name": "tiny_moe", "batch_size": 4,
               "max_batch_delay_ms": 300, "max_new_tokens": 24, "threads": 1,
               "decode_compile": "none", "precompile": False}]
    raw = {"name": "tiny_moe", "model": {"source": str(model)},
           "data": {"source": "stanfordnlp/sst2", "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 8},
                    "prompts": str(folder / "prompts.txt")},
           "evaluation": {"generation": {"prompts": 2, "max_new_tokens": 8, "batch_sizes": [1],
                                         "compile": "none", "eager_generate": False,
                                         "cache_len": 64}},
           "stages": stages, "output_dir": str(folder / "runs")}
    recipe = load_recipe(write_recipe(folder / "moe.yaml", raw), check_sources=True)
    return run_recipe(recipe, echo=lambda _: None)


@pytest.fixture(scope="module")
def served(moe_run: Path, state_dir) -> dict:
    yield from serving(moe_run, "litserve", 300)


def generate(info: dict, prompt: str) -> tuple[int, str, dict]:
    """(status, X-Batch-Size, final answer) of one non-streamed request."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(info["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if info.get("token"):
        headers["Authorization"] = f"Bearer {info['token']}"
    body = {"prompt": prompt, "max_new_tokens": 24, "stream": False}
    conn.request("POST", parts.path, body=json.dumps(body).encode(), headers=headers)
    answer = conn.getresponse()
    final = json.loads(answer.read())
    conn.close()
    return answer.status, answer.headers["X-Batch-Size"], final


def test_the_chain_keeps_every_greedy_token(moe_run: Path) -> None:
    manifest = json.loads((moe_run / "manifest.json").read_text())
    quant, compiled, export, package = manifest["stages"]
    assert quant["metrics"]["agreement"] == 1.0 and quant["metrics"]["scheme"] == "int8_grouped"
    assert compiled["metrics"]["decode_compile"] == "default"
    assert compiled["metrics"]["agreement"] == 1.0  # the compiled decode: same tokens
    assert export["metrics"]["parity_token_agreement"] == 1.0
    assert package["metrics"]["continuous_batching"]
    folder = moe_run / export["outputs"][0]["export_dir"]
    assert (folder / "causal_lm/runtime/experts.py").is_file()


def test_served_answers_are_batched_and_equal_the_offline_text(moe_run: Path, served) -> None:
    manifest = json.loads((moe_run / "manifest.json").read_text())
    lm = loading.load_folder(moe_run / manifest["stages"][2]["outputs"][0]["export_dir"])
    gate = threading.Barrier(len(PROMPTS))

    def ask(prompt: str) -> tuple[int, str, dict]:
        gate.wait()
        return generate(served, prompt)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    assert [status for status, _, _ in answers] == [200] * len(PROMPTS)
    assert max(int(batch) for _, batch, _ in answers) > 1
    for prompt, (_, _, final) in zip(PROMPTS, answers, strict=True):
        ids = loading.prompt_ids(lm.tokenizer, prompt)
        out = loading.StaticDecoder(lm.model, 256).generate(
            [ids], 24, loading.stop_ids(lm.model, lm.tokenizer))
        assert final["text"] == lm.tokenizer.decode(out.tokens, skip_special_tokens=True)
