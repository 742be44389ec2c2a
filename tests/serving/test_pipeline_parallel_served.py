"""A pipeline-parallel causal LM served by a real TorchServe in its torchrun mode
(`parallelType: pp`, 2 ranks over gloo on this CPU): the package stage writes the settings,
each rank's handler joins the process group and keeps its pipeline stage, and the endpoint
streams the greedy text causal_lm.runtime gives offline in one process, batching concurrent
requests."""

from __future__ import annotations

import os
import zipfile
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
def pp_run(varied_llama_folder: Path, tmp_path_factory, data_dir: Path) -> Path:
    return packaged_causal_lm_run(tmp_path_factory.mktemp("pp_served"), "tiny_pp",
                                  varied_llama_folder,
                                  {"batch_size": 4, "max_batch_delay_ms": 300,
                                   "max_new_tokens": 16, "pipeline_parallel": 2}, data_dir, 64)


def test_a_pipeline_parallel_worker_streams_the_offline_greedy_text_and_batches(
        pp_run: Path, state_dir) -> None:
    mar = next((pp_run / "01-package").glob("*.mar"))
    with zipfile.ZipFile(mar) as archive:
        config = yaml.safe_load(archive.read("model-config.yaml"))
        inside = set(archive.namelist())
        assert {"serve/causal_lm/runtime/pipeline.py",
                "serve/causal_lm/runtime/pipeline_parallel.py"} <= inside
    assert config["parallelType"] == "pp" and config["torchrun"] == {"nproc-per-node": 2}
    assert config["handler"]["compile"] == "none"
    assert "asyncCommunication" not in config  # the synchronous batch path

    offline = loading.load_folder(pp_run / "00-export/transformers")
    decoder = loading.StaticDecoder(offline.model, 64)
    want = {p: offline.tokenizer.decode(decoder.generate(
        [loading.prompt_ids(offline.tokenizer, p, True)], 8).tokens,
        skip_special_tokens=True) for p in PROMPTS}

    target = server.resolve_target(pp_run)
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=300, echo=lambda _: None)
    try:
        from test_causal_lm_serving import split_model_answers_like_one_process

        texts = split_model_answers_like_one_process(info, want)
        assert want[PROMPTS[1]] not in texts  # sampling happened
        log = model_log(target.serve_dir)
        assert "compile none, 2 rank(s)" in log
        assert_only_loopback_listeners(info, 2)
    finally:
        server.stop(target.serve_dir)
