"""benchmarks/causal_lm/peers.py's zentorch peer without installing it: `--zentorch`'s dtypes,
where zentorch has no wheel, the environment's marker, a failed install as one error line
with exit 2, the rows' specs, the agreement reference and the table's zentorch note, and
the child's weight bytes and bad dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.causal_lm import peers as peers_llm
from benchmarks.causal_lm import table
from benchmarks.causal_lm import zentorch_child as child
from benchmarks.causal_lm import zentorch_env as zenv
from benchmarks.harness import venv as venvs
from benchmarks.harness.venv import PeerError

FACTS = {"zentorch": "2.13.0.2", "torch": "2.13.0+cpu", "bf16": True,
         "install": [p for ps in zenv.INSTALL for p in ps]}


def test_the_flag_takes_dtypes_and_rejects_others(capsys) -> None:
    assert peers_llm.parse_args([]).zentorch == []
    assert peers_llm.parse_args(["--zentorch"]).zentorch == ["fp32", "bf16"]
    assert peers_llm.parse_args(["--zentorch", "bf16,bf16"]).zentorch == ["bf16"]
    with pytest.raises(SystemExit) as exit_:
        peers_llm.parse_args(["--zentorch", "fp32,fp16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown zentorch dtype 'fp16' (known: fp32, bf16)" in err
    assert "Traceback" not in err


def test_where_zentorch_has_no_wheel() -> None:
    ok = {"system": "Linux", "machine": "x86_64", "version": (3, 11), "flags": {"avx2"}}
    assert zenv.unsupported(**ok) is None
    assert "Linux x86_64 only, not Darwin arm64" in zenv.unsupported(
        **{**ok, "system": "Darwin", "machine": "arm64"})
    assert "Python 3.9-3.13, not 3.14" in zenv.unsupported(**{**ok, "version": (3, 14)})
    assert "need AVX2" in zenv.unsupported(**{**ok, "flags": {"sse4_2"}})


def test_a_marker_with_this_install_list_is_the_environment(tmp_path: Path, monkeypatch
                                                            ) -> None:
    monkeypatch.setattr(zenv, "unsupported", lambda: None)
    venv = tmp_path / "venv"
    venv.mkdir()
    with pytest.raises(zenv.ZentorchError, match="not a virtual environment"):
        zenv.ensure_zentorch(venv, print)
    (venv / zenv.READY).write_text(json.dumps(FACTS))
    assert zenv.ensure_zentorch(venv, print) == FACTS


def test_an_environment_that_cannot_be_built_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch, capsys) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(zenv, "DEFAULT_VENV", str(tmp_path / "env"))
    monkeypatch.setattr(zenv, "unsupported", lambda: None)

    def pip_fails(command: list[str], what: str, log: Path | None = None) -> str:
        if what.startswith("pip install"):
            raise PeerError(f"{what} failed with exit code 1: ERROR: No matching distribution "
                            "found for zentorch==2.13.0.2")
        return ""

    monkeypatch.setattr(venvs, "call", pip_fails)
    assert peers_llm.main(["--gguf", str(gguf), "--no-llama", "--zentorch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: ZentorchError: pip install torch==2.13.0 failed with exit code "
                       "1: ERROR: No matching distribution found for zentorch==2.13.0.2")
    monkeypatch.setattr(zenv, "unsupported", lambda: "zentorch 2.13.0.2 has wheels for Linux "
                        "x86_64 only, not Darwin arm64")
    assert peers_llm.main(["--gguf", str(gguf), "--no-llama", "--zentorch"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: ZentorchError: zentorch 2.13.0.2 has wheels for Linux x86_64 only, "
                   "not Darwin arm64\n")


def test_rows_carry_their_child_and_spec(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(zenv, "ensure_zentorch", lambda venv, echo: {**FACTS, "bf16": False})
    said: list[str] = []
    items = zenv.zentorch_items(tmp_path / "m.gguf", ["fp32", "bf16"], said.append)
    assert [i["name"] for i in items] == ["zentorch fp32"]  # no native bf16: left out
    assert "bf16 left out" in said[0]
    args = peers_llm.parse_args(["--zentorch"])
    spec = peers_llm.spec_of(items[0], args, tmp_path / "inputs.json", True)
    assert spec["mode"] == "measure" and spec["dtype"] == "fp32"
    assert spec["model"] == str(tmp_path / "m.gguf") and spec["quality"] is True
    assert items[0]["child"] == "benchmarks.causal_lm.zentorch_child"


def test_zentorch_rows_render_against_zentorch_fp32_without_compress_float() -> None:
    items = [
        {"name": "llama.cpp Q8_0", "runtime": "llama.cpp", "weights": "Q8_0",
         "rounds": [{"tok_s_b1": 100.0, "greedy": [[1, 2, 3, 9]]}]},
        {"name": "zentorch fp32", "runtime": "zentorch", "weights": "fp32",
         "rounds": [{"tok_s_b1": 40.0, "tok_s_b8": 200.0, "ttft_ms": 90.0,
                     "perplexity": 20.0, "bytes_per_token": 538_000_000,
                     "greedy": [[1, 2, 3, 4]], "b8_rows": [[1, 2, 3, 4]]}]},
        {"name": "zentorch bf16", "runtime": "zentorch", "weights": "bf16",
         "rounds": [], "error": "the process exited with code 1: boom"},
    ]
    rows = {r["name"]: r for r in table.table_rows(items, 40.0)}
    assert rows["llama.cpp Q8_0"]["agreement"] == pytest.approx(3 / 4)
    assert rows["zentorch fp32"]["agreement"] == 1.0
    assert rows["zentorch fp32"]["x_peer_b1"] is None  # no llama.cpp pair
    text = table.render_text(list(rows.values()))
    line = next(ln for ln in text.splitlines() if ln.startswith("zentorch fp32"))
    assert line.split()[3:7] == ["40.0", "200.0", "90.0", "20.000"]
    assert "zentorch bf16: failed: the process exited with code 1: boom" in text
    markdown = table.render_markdown(list(rows.values()), {})
    assert 'torch.compile(backend="zentorch")' in markdown
    assert "| zentorch bf16 | bf16 | failed |" in markdown


def test_child_weight_bytes_and_a_bad_dtype(capsys) -> None:
    torch.manual_seed(0)
    config = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    layer, embed = 9312, 300 * 32  # as in test_causal_lm_peers.py
    tied = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=True))
    untied = LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=False))
    assert child.weight_bytes_per_token(tied) == 4 * (layer + embed)
    assert child.weight_bytes_per_token(untied) == 4 * (layer + embed + 32)
    assert child.main([json.dumps({"mode": "measure", "dtype": "fp16"})]) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["error"] == "ValueError: unknown dtype 'fp16' (known: fp32, bf16)"
