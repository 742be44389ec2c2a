"""The causal-LM runtime, export and archive on a tiny random Llama (seconds): batched
decoding equals batch-1 decoding, the exported folder decodes without compress and as the
in-process model does, the .mar holds the generation handler, and options of the other
family are one validation line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import cli, import_alone, write_recipe

from compress.pipeline.loop import run_recipe
from compress.recipe.kinds.quantize import WEIGHT_SCHEMES
from compress.recipe.schema import load_recipe
from compress.runfolder.code_digest import shipped_files
from serve.causal_lm.runtime import loading

REPO = Path(__file__).resolve().parents[2]

SST2 = "stanfordnlp/sst2"
PROMPTS = ["the film was", "a much longer prompt about a movie that goes on and on", "hi",
           "what is the capital of france ?"]


@pytest.fixture(autouse=True)
def _data_dir(monkeypatch) -> None:
    if not os.environ.get("COMPRESS_DATA_DIR"):
        monkeypatch.setenv("COMPRESS_DATA_DIR", str(Path(__file__).parents[3] / "shared/data"))


@pytest.fixture(scope="module")
def tiny(varied_llama_folder) -> loading.LoadedCausalLM:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(varied_llama_folder).eval()
    return loading.LoadedCausalLM(model, AutoTokenizer.from_pretrained(varied_llama_folder), {})


def causal_lm_recipe(tmp_path: Path, model: Path, stages: list[dict]) -> Path:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    raw = {"name": "tiny_lm", "model": {"source": str(model)},
           "data": {"source": SST2, "text_column": "sentence", "max_length": 32,
                    "eval": {"split": "validation", "max_samples": 8},
                    "prompts": str(prompts)},
           "evaluation": {"generation": {"prompts": 4, "max_new_tokens": 8, "batch_sizes": [1],
                                         "compile": "none", "eager_generate": False,
                                         "cache_len": 64}},
           "stages": stages, "output_dir": str(tmp_path / "runs")}
    return write_recipe(tmp_path / "lm.yaml", raw)


def test_rows_of_different_lengths_decode_as_each_alone(tiny) -> None:
    ids = [loading.prompt_ids(tiny.tokenizer, p, chat_template=False) for p in PROMPTS]
    assert len({len(i) for i in ids}) == 4  # four lengths: three rows are left-padded
    alone = [loading.StaticDecoder(tiny.model, 64).generate([i], 16).tokens for i in ids]
    assert len({t for row in alone for t in row}) > 32  # tokens vary: no trivial match
    with torch.inference_mode():  # and batch 1 is Hugging Face's own greedy decoding
        first = torch.tensor([ids[0]])
        want = tiny.model.generate(first, attention_mask=torch.ones_like(first),
                                   max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   pad_token_id=0)[0, first.shape[1]:].tolist()
    assert alone[0] == want
    eager = loading.StaticDecoder(tiny.model, 64).generate(ids, 16)
    assert eager.rows == alone and eager.finish == ["length"] * 4
    compiled = loading.StaticDecoder(tiny.model, 64, always_mask=True).compile()
    assert compiled.generate(ids, 16).rows == alone
    assert compiled.generate(ids[:1] * 4, 16).rows == [alone[0]] * 4  # no padding, masked
    # each row stops on its own: its limit, a stop token, or the callback
    stop = alone[1][2]
    assert all(stop not in row[:4] for row in (alone[0], alone[2], alone[3]))
    out = loading.StaticDecoder(tiny.model, 64).generate(
        ids, [3, 16, 1, 16], stop={stop}, on_tokens=lambda t: [3] if t[3] is not None else [])
    assert [len(r) for r in out.rows] == [3, 3, 1, 1] and out.rows[1][-1] == stop
    assert out.finish == ["length", "stop", "length", "stop"]
    assert out.rows == [alone[0][:3], alone[1][:3], alone[2][:1], alone[3][:1]]


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(tiny) -> None:
    ids = [loading.prompt_ids(tiny.tokenizer, p, chat_template=False) for p in PROMPTS]
    decoder = loading.StaticDecoder(tiny.model, 64)
    greedy = decoder.generate(ids, 12).rows
    hot = [loading.Sampling(1.5, 1.0, seed=7)] * 4
    once, again = (decoder.generate(ids, 12, sampling=hot).rows for _ in range(2))
    assert once == again and once != greedy  # 48 draws from a near-uniform 30k vocabulary
    narrow = [loading.Sampling(1.5, 1e-9, seed=7)] * 4
    assert decoder.generate(ids, 12, sampling=narrow).rows == greedy


def test_the_runtime_knows_the_same_weight_schemes() -> None:
    assert loading.SCHEMES == WEIGHT_SCHEMES


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int8_grouped"])
def test_export_and_package_an_int8_causal_lm(tmp_path, varied_llama_folder, scheme) -> None:
    stages = [{"kind": "quantize", "scheme": scheme, "activations": "float32"},
              {"kind": "export", "format": "transformers"},
              {"kind": "package", "model_name": "tiny_lm", "max_new_tokens": 16,
               "batch_size": 4}]
    recipe = load_recipe(causal_lm_recipe(tmp_path, varied_llama_folder, stages),
                         check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    quant, export, package = manifest["stages"]
    metrics = export["metrics"]
    assert metrics["parity_token_agreement"] == 1.0 and metrics["parity_prompts"] == 4
    assert metrics["parity_prompt_ids_equal"] and metrics["runtime"] == "transformers"
    assert abs(metrics["perplexity"] - quant["metrics"]["perplexity"]) < 1e-6 * metrics[
        "perplexity"]  # the exported model measured again: the same int8 model
    folder = run_dir / export["outputs"][0]["export_dir"]
    names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert {"model.pt", "config.json", "causal_lm.json", "export.json", "parity.json",
            "tokenizer.json"} <= names
    # its causal_lm/ package is serve/causal_lm/runtime/, whole, and nothing else
    runtime = REPO / "serve" / "causal_lm"
    assert {n for n in names if n.startswith("causal_lm/")} == {"causal_lm/__init__.py"} | {
        f"causal_lm/{p.relative_to(runtime)}" for p in shipped_files("serve.causal_lm.runtime")}
    assert {"causal_lm/runtime/loading.py", "causal_lm/runtime/__main__.py",
            "causal_lm/runtime/csrc/grouped_kernels.cpp",
            "causal_lm/runtime/csrc/grouped_layout.h"} <= names
    assert json.loads((folder / "parity.json").read_text())["parity_first_difference"] is None

    # the folder decodes without compress: a fresh interpreter imports its causal_lm.runtime
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
              "import causal_lm.runtime as loading; "
              "lm = loading.load_folder(sys.argv[1]); "
              "ids = loading.prompt_ids(lm.tokenizer, sys.argv[2], False); "
              "out = loading.StaticDecoder(lm.model, 64).generate([ids], 8); "
              "print(json.dumps([out.tokens, sorted(m for m in sys.modules "
              "if m.split('.')[0] in ('compress', 'serve', 'export'))]))")
    done = subprocess.run([sys.executable, "-c", script, str(folder), PROMPTS[1]],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    tokens, ours = json.loads(done.stdout.strip().splitlines()[-1])
    assert ours == []
    in_process = loading.load_folder(run_dir / quant["outputs"][0]["model_dir"])
    ids = loading.prompt_ids(in_process.tokenizer, PROMPTS[1], False)
    assert tokens == loading.StaticDecoder(in_process.model, 64).generate([ids], 8).tokens
    # the shipped command prints the greedy text (runtime/__main__.py), run in the folder
    shown = subprocess.run([sys.executable, "-m", "causal_lm.runtime", ".", PROMPTS[1],
                            "--max-new-tokens", "8", "--no-chat-template"],
                           capture_output=True, text=True, cwd=folder, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    greedy = loading.StaticDecoder(in_process.model, 512).generate(
        [ids], 8, loading.stop_ids(in_process.model, in_process.tokenizer),
        [loading.Sampling(0.0)])
    text = in_process.tokenizer.decode(greedy.tokens, skip_special_tokens=True)
    assert text.strip() and shown.stdout == text + "\n"

    mar = run_dir / package["outputs"][0]["path"]
    assert package["outputs"][0]["served_format"] == "transformers"
    with zipfile.ZipFile(mar) as archive:
        inside = set(archive.namelist())
        config = yaml.safe_load(archive.read("model-config.yaml"))
    # its code: serve/'s own modules and serve/causal_lm/ whole (runtime and server), the
    # kernel library built here, the generated entry module, and nothing flat beside them
    code = {f"serve/causal_lm/{p.relative_to(runtime)}" for p in shipped_files("serve.causal_lm")}
    shared = {f"serve/{p.name}" for p in (REPO / "serve").iterdir() if p.is_file()
              and p.suffix in (".py", ".cpp")}
    inside_code = {n for n in inside if n.startswith("serve/") and not n.endswith(".so")}
    assert inside_code == code | shared
    assert {"serve/causal_lm/server/handler.py", "serve/causal_lm/runtime/loading.py",
            "serve/http_answers.py", "serve/worker_threads.py"} <= inside_code
    assert {"generation_handler.py", "model.pt", "causal_lm.json", "tokenizer.json"} <= inside
    assert not any(n.startswith(("causal_lm/", "embedding/", "serve/classifier/",
                                 "serve/embedding/")) for n in inside)
    assert {"requests.py", "openai.py", "runtime.py", "handler.py"}.isdisjoint(inside)
    assert "index_to_name.json" not in inside
    # continuous batching: TorchServe passes each request on as it comes (batchSize 1) to
    # the handler's 4 rows
    assert config["asyncCommunication"] is True and config["batchSize"] == 1
    assert config["handler"]["rows"] == 4 and config["handler"]["task"] == "causal-lm"
    assert config["handler"]["max_new_tokens"] == 16 and config["handler"]["cache_len"] == 64

    # the archive's handler imports with the repository out of reach: no path to it, no
    # editable-install finder; every `serve` module comes from the archive's own package
    with zipfile.ZipFile(mar) as archive:
        archive.extractall(tmp_path / "unpacked")
    reach, project, _ = import_alone(tmp_path / "unpacked",
                                     "generation_handler, serve.causal_lm.runtime, "
                                     "serve.worker_threads")
    assert reach == [] and project == []


@pytest.mark.parametrize(("stage", "line"), [
    ({"kind": "export", "format": "onnx"},
     "stages.0.format: onnx exports a classifier's forward pass; a causal LM exports with "
     "format: transformers"),
    ({"kind": "export", "format": "transformers", "threads": 2},
     "stages.0.threads: a classifier export option; a causal LM's export is checked by "
     "greedy token agreement"),
    ({"kind": "package", "max_text_chars": 10},
     "stages.0.max_text_chars: a classifier's option"),
    ({"kind": "package", "length_buckets": False},
     "stages.0.length_buckets: a text encoder's option"),
])
def test_a_classifier_export_option_on_a_causal_lm_is_one_line(
        tmp_path, varied_llama_folder, monkeypatch, capsys, stage, line) -> None:
    stages = [stage] if stage["kind"] == "export" else [
        {"kind": "export", "format": "transformers"}, stage]
    line = line.replace("stages.0", f"stages.{len(stages) - 1}")
    path = causal_lm_recipe(tmp_path, varied_llama_folder, stages)
    code, _, err = cli(monkeypatch, capsys, "validate", str(path))
    assert code == 2 and "Traceback" not in err
    assert [e for e in err.splitlines() if e.startswith("error:")] == [
        e for e in err.splitlines() if line in e], err


def test_a_causal_lm_export_on_a_classifier_is_one_line(
        tmp_path, tiny_bert, monkeypatch, capsys) -> None:
    raw = {"name": "bert", "model": {"source": str(tiny_bert)},
           "data": {"source": SST2, "text_column": "sentence"},
           "stages": [{"kind": "export", "format": "transformers"},
                      {"kind": "package", "max_new_tokens": 32}]}
    code, _, err = cli(monkeypatch, capsys, "validate",
                       str(write_recipe(tmp_path / "bert.yaml", raw)))
    assert code == 2 and "Traceback" not in err
    assert "stages.0.format: transformers exports a causal LM" in err
    assert "stages.1.max_new_tokens: only a causal LM takes this option" in err


def test_an_export_that_decodes_differently_fails_the_stage(
        tmp_path, varied_llama_folder, monkeypatch) -> None:
    from compress.errors import StageError
    from compress.families.causal_lm.stages import export as export_causal_lm

    load = loading.load_folder

    def perturbed(folder):  # the folder as written, read back with its head perturbed
        lm = load(folder)
        weight = lm.model.lm_head.weight
        with torch.no_grad():
            weight += 0.1 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        return lm

    monkeypatch.setattr(export_causal_lm.runtime, "load_folder", perturbed)
    stages = [{"kind": "export", "format": "transformers", "min_agreement": 0.99}]
    recipe = load_recipe(causal_lm_recipe(tmp_path, varied_llama_folder, stages),
                         check_sources=True)
    with pytest.raises(StageError, match=r"greedy token agreement 0\.\d+ < 0\.99 \(first "
                                         r"difference: prompt \d, token \d\)"):
        run_recipe(recipe, echo=lambda _: None)
    run_dir = tmp_path / "runs/tiny_lm"
    figures = json.loads((run_dir / "00-export/transformers/parity.json").read_text())
    assert figures["parity_token_agreement"] < 0.99
    diff = figures["parity_first_difference"]
    assert diff["source_token"] != diff["exported_token"]
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    assert stage["status"] == "failed" and not stage["outputs"]
