"""The shrunk bert_int8 run served by a real TorchServe: 200 SST-2 validation sentences
answered as the packaged artifact answers them offline (the ONNX Runtime int8 file, and
the int8 AOTInductor .pt2 archived on the spot)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import http_post

pytest.importorskip("ts")

from compress.serving import server  # noqa: E402
from compress.serving.archive import build_mar, model_config  # noqa: E402
from compress.system import processes  # noqa: E402
from export.folder import load_export  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.serving]


def _sst2(data_dir: Path, n: int = 200) -> list[str]:
    lines = (data_dir / "stanfordnlp/sst2/validation.tsv").read_text().splitlines()
    column = lines[0].split("\t").index("sentence")
    return [line.split("\t")[column] for line in lines[1:n + 1]]


def _served_and_offline(mar: Path, export_dir: Path, texts: list[str]):
    """Probabilities from the server (8 requests in flight) and from the export offline."""
    target = server.resolve_target(mar)
    (port,) = server.free_ports(1)
    info = server.start(target, port=port, timeout_s=300, echo=lambda _: None)
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda t: http_post(info["url"], json.dumps({"text": t}).encode(), info["token"]),
                texts))
    finally:
        server.stop(target.serve_dir)
    assert not processes.alive(info["pid"])
    assert [status for status, _, _ in answers] == [200] * len(texts)
    offline = load_export(export_dir)
    names = offline.label_names
    expected = []
    with torch.inference_mode():
        for start in range(0, len(texts), 32):
            encoded = offline.tokenizer(texts[start:start + 32], padding=True, truncation=True,
                                        max_length=128, return_tensors="pt")
            expected.append(torch.softmax(offline.model(**encoded).float(), dim=-1))
    got = torch.tensor([[a["probabilities"][n] for n in names] for _, _, a in answers])
    batches = [int(headers["X-Batch-Size"]) for _, headers, _ in answers]
    return got, torch.cat(expected), batches


def test_served_int8_and_fp32_answer_like_the_artifact_offline(
        bert_int8_run, data_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_STATE_DIR", str(tmp_path / "state"))
    run_dir, result = bert_int8_run
    assert result.returncode == 0, result.stderr[-2000:]
    texts = _sst2(data_dir)
    got, expected, batches = _served_and_offline(
        run_dir / "05-package/bert_int8.mar", run_dir / "04-export/onnx", texts)
    # dynamic int8 scales each batch by its own largest activation, so a served batch (other
    # sentences, other padding) rounds differently from the offline one. With the attention
    # MatMuls in int8 too (as Optimum's --avx512_vnni): 192-194 of 200 equal argmax, a mean
    # probability gap of 0.015 and a largest of 0.13 (borderline sentences of the shrunk,
    # 40-step model; weight-only MatMuls gave 198-199); a broken model agrees on about half
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    gap = (got - expected).abs()
    assert agree >= 0.95 and gap.mean().item() <= 0.03 and gap.max().item() <= 0.3
    assert max(batches) > 1

    aoti_dir = run_dir / "02-export/aoti"
    config = model_config(16, 10, 1, 120, {"max_length": 128})
    mar = build_mar(aoti_dir, tmp_path, "bert_aoti_int8", "1.0", config, {})
    got, expected, _ = _served_and_offline(mar, aoti_dir, texts)
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()  # all 200
    # int8 kernels round differently with the padding of each batch (a borderline activation
    # crosses one quantization step): 1e-3 was measured on an AVX-512 VNNI machine, 0.0073 on
    # an AVX2-only EPYC, 0.0109 on a Zen 3 (AVX2) in a clean-clone CI run; every argmax is
    # equal on all three, and a broken lowering moves probabilities by tenths
    assert (got - expected).abs().max().item() <= 2e-2
