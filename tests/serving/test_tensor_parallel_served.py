"""A tensor-parallel causal LM served by a real TorchServe in its torchrun mode
(`parallelType: tp`, 2 ranks over gloo on this CPU): the package stage writes the settings,
each rank's handler joins the process group and splits the layers, and the endpoint streams
the greedy text causal_lm.runtime gives offline, batching concurrent requests."""

from __future__ import annotations

import json
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import model_log, packaged_causal_lm_run
from loopback_checks import assert_only_loopback_listeners

pytest.importorskip("ts")

from compress.serving import server  # noqa: E402
from serve.causal_lm.runtime import loading  # noqa: E402

pytestmark = [pytest.mark.serving,
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")]

PROMPTS = ["the film was", "a great movie about", "hi there", "why is the sky blue"]


@pytest.fixture(scope="module")
def tp_run(varied_llama_folder: Path, tmp_path_factory, data_dir: Path) -> Path:
    return packaged_causal_lm_run(tmp_path_factory.mktemp("tp_served"), "tiny_tp",
                                  varied_llama_folder,
                                  {"batch_size": 4, "max_batch_delay_ms": 300,
                                   "max_new_tokens": 16, "tensor_parallel": 2}, data_dir, 64)


def test_a_tensor_parallel_worker_streams_the_offline_greedy_text_and_batches(
        tp_run: Path, state_dir) -> None:
    mar = next((tp_run / "01-package").glob("*.mar"))
    with zipfile.ZipFile(mar) as archive:
        config = yaml.safe_load(archive.read("model-config.yaml"))
        assert "serve/causal_lm/runtime/tensor_parallel.py" in archive.namelist()
    assert config["parallelType"] == "tp" and config["torchrun"] == {"nproc-per-node": 2}
    assert config["handler"]["compile"] == "none"

    offline = loading.load_folder(tp_run / "00-export/transformers")
    decoder = loading.StaticDecoder(offline.model, 64)
    want = {p: offline.tokenizer.decode(decoder.generate(
        [loading.prompt_ids(offline.tokenizer, p, True)], 8).tokens,
        skip_special_tokens=True) for p in PROMPTS}

    target = server.resolve_target(tp_run)
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=300, echo=lambda _: None)
    try:
        from test_causal_lm_serving import generate

        status, _, lines = generate(info, {"prompt": PROMPTS[0], "max_new_tokens": 8})
        assert status == 200 and len(lines) > 2  # deltas, then the final answer
        assert json.loads(lines[-1][1])["text"] == want[PROMPTS[0]]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda p: generate(
                info, {"prompt": p, "max_new_tokens": 8, "stream": False}), PROMPTS))
        for prompt, (status, _, lines) in zip(PROMPTS, answers, strict=True):
            assert status == 200
            assert json.loads(lines[-1][1])["text"] == want[prompt]
        assert max(int(h["X-Batch-Size"]) for _, h, _ in answers) > 1
        body = {"prompt": PROMPTS[1], "max_new_tokens": 8, "stream": False,
                "temperature": 0.9}  # rank 0's seeds reach the other rank (a tensor)
        sampled = [generate(info, body | {"seed": 7}) for _ in range(2)] + [
            generate(info, body | {"seed": 8}), generate(info, body)]
        assert [status for status, _, _ in sampled] == [200] * 4
        texts = [json.loads(lines[-1][1])["text"] for _, _, lines in sampled]
        assert texts[0] == texts[1] != texts[2]
        log = model_log(target.serve_dir)
        assert "compile none, 2 rank(s)" in log
        assert_only_loopback_listeners(info, 2)
    finally:
        server.stop(target.serve_dir)
