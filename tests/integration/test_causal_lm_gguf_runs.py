"""Issue 76 acceptance, shrunk: recipes/llm_gguf.yaml (distill → prune → int4_grouped on the
GGUF grid → export gguf) runs on a tiny Llama with SmolLM2's tokenizer: the export stage
writes the GGUF, whose every weight is the pruned, quantized model's (read back with the
`gguf` package), and an Ollama Modelfile beside it; where llama-cpp-python can be run,
llama.cpp loads the file and its perplexity on the eval texts is within 1% of the model's.
A scheme the format cannot hold is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, cli, write_recipe

gguf = pytest.importorskip("gguf")

from compress.families.causal_lm.llama_cpp import llama_python  # noqa: E402
from compress.pipeline.loop import run_recipe  # noqa: E402
from compress.recipe.schema import load_recipe  # noqa: E402

pytestmark = pytest.mark.integration


def shrunk(tmp_path: Path, model: Path, stages: list[dict] | None = None) -> Path:
    raw = yaml.safe_load((REPO / "recipes/llm_gguf.yaml").read_text())
    distill, prune, quantize, export = raw["stages"]
    distill.update(student={"layer_indices": [0]}, max_steps=2, batch_size=4,
                   checkpoint_every=1000)
    prune.update(amount=0.5,  # 64 neurons to 32: whole groups of 32
                 recovery={"max_steps": 2, "batch_size": 4, "checkpoint_every": 1000})
    quantize.update(qat={"max_steps": 2, "batch_size": 4, "checkpoint_every": 1000})
    raw["model"]["source"] = str(model)
    raw["data"].update(max_length=32, train={"split": "train", "max_samples": 64},
                       eval={"split": "validation", "max_samples": 12})
    raw["data"].pop("prompts")
    raw["evaluation"] = {"generation": {"prompts": 2, "max_new_tokens": 4, "batch_sizes": [1],
                                        "compile": "none", "eager_generate": False,
                                        "cache_len": 128},
                         "latency": {"enabled": False}}
    raw["stages"] = stages or [distill, prune, quantize, export]
    raw["output_dir"] = str(tmp_path / "runs")
    return write_recipe(tmp_path / "llm_gguf.yaml", raw)


def test_llm_gguf_shrunk_runs_and_its_file_holds_the_model(
        tmp_path: Path, smol_tokenizer_llama_folder: Path, data_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    recipe = load_recipe(shrunk(tmp_path, smol_tokenizer_llama_folder), check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert [s["status"] for s in manifest["stages"]] == ["done"] * 4
    export = manifest["stages"][-1]
    metrics = export["metrics"]
    assert metrics["gguf_rerounded_groups"] == 0 and metrics["gguf_groups"] > 0
    assert metrics["gguf_tensor_types"] == "F32 3, Q4_1 7, Q8_0 2"  # 1 layer; embed, head
    path = run_dir / export["outputs"][0]["path"]
    assert path.suffix == ".gguf" and path.is_file()
    assert (path.parent / "Modelfile").read_text().startswith(f"FROM ./{path.name}\n")
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["llama.block_count"].contents() == 1  # distilled to one layer
    assert fields["llama.feed_forward_length"].contents() == 32  # pruned
    assert fields["tokenizer.ggml.pre"].contents() == "default"  # no GGUF source here
    if llama_python() is None:
        assert metrics["gguf_parity"] == "skipped: no llama-cpp-python"
    else:
        assert metrics["gguf_parity"] == "llama.cpp"
        assert abs(metrics["gguf_perplexity_change_pct"]) <= 1.0
        assert metrics["gguf_kv_cache"] == "f32" and metrics["gguf_perplexity_f16_cache"] > 1
        assert metrics["gguf_top1_agreement"] >= 0.9


def test_a_scheme_gguf_cannot_hold_is_one_line(tmp_path: Path,
                                               smol_tokenizer_llama_folder: Path,
                                               data_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    stages = [{"kind": "quantize", "scheme": "int8_weight_only"},
              {"kind": "export", "format": "gguf"}]
    code, _, err = cli(monkeypatch, capsys, "run",
                       str(shrunk(tmp_path, smol_tokenizer_llama_folder, stages)))
    assert code == 2, err
    assert ("stages.1.format: gguf holds float, int8_grouped (Q8_0) and int4_grouped (Q4_1) "
            "weights, not int8_weight_only") in err
    assert "Traceback" not in err
