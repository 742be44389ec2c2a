"""The 2:4 schemes `int8_sparse24` and `int4_sparse24` (serve/causal_lm/runtime/sparse24.py) through
`quantize_weights`, the quantize stage, export and package, on a tiny random Llama whose
Linears are made 2:4 here (the 2 smallest |w| of every 4 inputs zeroed)."""

from __future__ import annotations

import copy
import json
import zipfile
from pathlib import Path

import pytest
import torch
from builders import causal_lm_recipe
from conftest import cli
from test_sparse24_kernel import make_24
from torch import nn

from compress.families.causal_lm.generation import DECISIVE_MARGIN, agreement, reference_margins
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.grouped import GroupedLinear
from serve.causal_lm.runtime.sparse24 import Sparse24Linear

PROMPTS = [[101, 2023, 2003, 1037], [101, 7592, 2088], [101, 1996, 4937, 2001, 2204, 1012]]


@pytest.fixture
def sst2(data_dir, monkeypatch) -> None:
    """The recipes' SST-2 text (the runs skip without the mirror)."""
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))


def mask_24(model: nn.Module) -> nn.Module:
    """Every Linear but the output head made 2:4, in place."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(make_24(module.weight))
    return model


@pytest.fixture(scope="module")
def sparse_llama_folder(tmp_path_factory, varied_llama_folder) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("sparse_llama")
    mask_24(AutoModelForCausalLM.from_pretrained(varied_llama_folder)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(varied_llama_folder).save_pretrained(folder)
    return folder


def greedy(model: nn.Module, tokens: int = 16) -> list[list[int]]:
    decoder = loading.StaticDecoder(model.eval(), 64)
    return [decoder.generate([ids], tokens).tokens for ids in PROMPTS]


def test_int8_sparse24_decodes_int8_grouped_tokens_of_the_same_2_4_model(
        sparse_llama_folder) -> None:
    from transformers import AutoModelForCausalLM

    masked = AutoModelForCausalLM.from_pretrained(sparse_llama_folder).eval()
    dense = loading.quantize_weights(copy.deepcopy(masked), "int8_grouped")
    sparse = loading.quantize_weights(copy.deepcopy(masked), "int8_sparse24")
    layer = sparse.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Sparse24Linear)
    assert isinstance(layer.mlp.down_proj, Sparse24Linear)
    assert isinstance(sparse.lm_head, GroupedLinear)  # the head is not pruned: int8 groups
    # against int8_grouped's tokens: every decisive step agrees (teacher forced); where the
    # free-running tokens part, they part at a near-tie of this random model (int8_grouped
    # itself leaves the float model's tokens at such ties: on this model both agree with it
    # on 0.7-0.75 of the free-running positions)
    reference = greedy(dense)
    prompts = [torch.tensor([ids]) for ids in PROMPTS]
    margins = reference_margins(dense, prompts, reference)
    found = agreement(sparse, prompts, greedy(sparse), reference, margins)
    assert found["next_token_agreement_decisive"] == 1.0, found
    assert found["agreement"] == 1.0 or found["divergence_margin_median"] < DECISIVE_MARGIN
    # 4 bits: the kernel's logits are the masked dequantized model's
    four = loading.quantize_weights(copy.deepcopy(masked), "int4_sparse24")
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        kernel = four(ids).logits
        for module in four.modules():
            if isinstance(module, Sparse24Linear):
                module.packed = None  # the torch fallback: dequantized weight, float product
        assert torch.allclose(four(ids).logits, kernel, atol=1e-4)


def test_the_stage_exports_and_packages_int4_sparse24(tmp_path, sparse_llama_folder,
                                                      sst2) -> None:
    stages = [{"kind": "quantize", "scheme": "int4_sparse24"},
              {"kind": "export", "format": "transformers"},
              {"kind": "package", "model_name": "tiny_lm", "max_new_tokens": 16,
               "batch_size": 4}]
    recipe = load_recipe(causal_lm_recipe(tmp_path, sparse_llama_folder, stages),
                         check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    quant, export, package = json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert quant["metrics"]["scheme"] == "int4_sparse24"
    assert quant["metrics"]["head_scheme"] == "int8_grouped"
    assert quant["metrics"]["activation_dtype"] == "float32"
    assert export["metrics"]["parity_token_agreement"] == 1.0
    folder = run_dir / export["outputs"][0]["export_dir"]
    assert {"causal_lm/runtime/sparse24.py", "causal_lm/runtime/csrc/sparse24_kernel.cpp"} <= {
        str(p.relative_to(folder)) for p in folder.rglob("*")}
    loaded = loading.load_folder(folder)
    down = loaded.model.model.layers[1].mlp.down_proj
    assert isinstance(down, Sparse24Linear) and down.packed is not None and down.bits == 4
    assert float((down.dequantize() != 0).float().mean()) <= 0.5  # 2:4 in the exported file
    with zipfile.ZipFile(run_dir / package["outputs"][0]["path"]) as archive:
        assert {"serve/causal_lm/runtime/sparse24.py",
                "serve/causal_lm/runtime/csrc/sparse24_kernel.cpp",
                "model.pt"} <= set(archive.namelist())


def test_a_linear_that_is_not_2_4_is_refused_in_one_line(
        tmp_path, varied_llama_folder, sst2, monkeypatch, capsys) -> None:
    recipe = causal_lm_recipe(tmp_path, varied_llama_folder,
                              [{"kind": "quantize", "scheme": "int8_sparse24"}])
    code, _, err = cli(monkeypatch, capsys, "run", str(recipe))
    assert code == 1 and "Traceback" not in err
    line = next(x for x in err.splitlines() if "n:m pattern (2:4)" in x)
    assert "model.layers.0.self_attn.q_proj: " in line

    bad = causal_lm_recipe(tmp_path, varied_llama_folder, [
        {"kind": "quantize", "scheme": "int4_sparse24", "activations": "int8"}])
    code, _, err = cli(monkeypatch, capsys, "validate", str(bad))
    assert code == 2 and "stages.0.activations: int4_sparse24 computes in float32" in err


def test_the_peers_benchmark_counts_the_2_4_records(sparse_llama_folder) -> None:
    """Bytes read per token: each 2:4 Linear its records (0.69 bytes a weight at 8 bits)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.causal_lm import child

    masked = AutoModelForCausalLM.from_pretrained(sparse_llama_folder).eval()
    dense = loading.quantize_weights(copy.deepcopy(masked), "int8_grouped")
    sparse = loading.quantize_weights(copy.deepcopy(masked), "int8_sparse24")
    layers = sum(m.in_features * m.out_features for m in sparse.modules()
                 if isinstance(m, Sparse24Linear))
    records = sum(m.packed.numel() for m in sparse.model.layers.modules()  # fused groups too
                  if getattr(m, "packed", None) is not None)
    assert records == 0.6875 * layers
    grouped = sum(m.packed.numel() for m in dense.model.layers.modules()  # fused groups too
                  if getattr(m, "packed", None) is not None)
    saved = grouped - records
    assert child.weight_bytes_per_token(dense) - child.weight_bytes_per_token(sparse) == saved
