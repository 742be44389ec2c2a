"""An expert-parallel mixture-of-experts causal LM served by a real TorchServe in its
torchrun mode (2 ranks over gloo on this CPU, `parallelType: pp`: rank 0 alone gets the
requests): each rank's handler keeps half of every layer's experts, rank 0 leads every
generation, and the endpoint streams the greedy text causal_lm.runtime gives offline in one
process, batching concurrent requests; LitServe refuses the archive in one line."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import model_log, packaged_causal_lm_run, run_cli
from loopback_checks import assert_only_loopback_listeners
from moe_models import tiny_moe_folder

pytest.importorskip("ts")

from compress.serving import server  # noqa: E402
from serve.causal_lm.runtime import loading  # noqa: E402

pytestmark = [pytest.mark.serving,
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPU cores")]

PROMPTS = ["the film was", "a great movie about", "hi there", "why is the sky blue"]


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, data_dir: Path) -> Path:
    model = tiny_moe_folder("mixtral", tmp_path_factory.mktemp("tiny_mixtral"))
    return packaged_causal_lm_run(tmp_path_factory.mktemp("ep_served"), "tiny_ep", model,
                                  {"batch_size": 4, "max_batch_delay_ms": 300,
                                   "max_new_tokens": 16, "expert_parallel": 2}, data_dir, 64)


def test_an_expert_parallel_worker_streams_the_offline_greedy_text_and_batches(
        ep_run: Path, state_dir) -> None:
    mar = next((ep_run / "01-package").glob("*.mar"))
    with zipfile.ZipFile(mar) as archive:
        config = yaml.safe_load(archive.read("model-config.yaml"))
        inside = set(archive.namelist())
        assert {"serve/causal_lm/runtime/expert_parallel.py",
                "serve/causal_lm/runtime/expert_dispatch.py"} <= inside
    assert config["parallelType"] == "pp" and config["torchrun"] == {"nproc-per-node": 2}
    assert config["handler"]["compile"] == "none"
    assert config["handler"]["expert_parallel"] == 2

    offline = loading.load_folder(ep_run / "00-export/transformers")
    decoder = loading.StaticDecoder(offline.model, 64)
    want = {p: offline.tokenizer.decode(decoder.generate(
        [loading.prompt_ids(offline.tokenizer, p, True)], 8).tokens,
        skip_special_tokens=True) for p in PROMPTS}

    refused = run_cli("serve", str(ep_run), "--engine", "litserve")
    assert refused.returncode == 2 and "only TorchServe starts" in refused.stderr
    assert "Traceback" not in refused.stderr

    target = server.resolve_target(ep_run)
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=300, echo=lambda _: None)
    try:
        from test_causal_lm_serving import split_model_answers_like_one_process

        split_model_answers_like_one_process(info, want)
        log = model_log(target.serve_dir)
        assert "compile none, 2 rank(s)" in log
        assert_only_loopback_listeners(info, 2)
    finally:
        server.stop(target.serve_dir)
