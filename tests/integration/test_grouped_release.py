"""A served model holds each grouped weight once (serve/causal_lm/runtime/grouped.py
`release_sources`, called by the causal-LM handler): the state dict's codes, scales and
offsets are dropped and read back from the kernel records exactly (`unpack_records`),
fused projections included, so the state dict, the dequantized weights and every logit stay
the same; an embedding table keeps its codes and no records; a worker's load drops each
module's copy as its records are made (`loading.load_folder(held_once=True)`); the worker's
freed memory goes back to the system (serve/worker_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import grouped_module
from transformers import LlamaConfig, LlamaForCausalLM

from serve.causal_lm.runtime import grouped, loading
from serve.causal_lm.runtime.kernels import build_error, grouped_mm_available
from serve.causal_lm.runtime.loading import quantize_weights
from serve.worker_memory import return_freed_memory

pytestmark = pytest.mark.skipif(not grouped_mm_available(), reason=f"{build_error()}")


@pytest.mark.parametrize("half", [True, False])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_released_module_reads_its_weights_back_from_its_records(bits, half) -> None:
    module = grouped_module(bits, half, 7 + bits, "float32")  # 96 -> 77: a partial tile
    before = {k: v.clone() for k, v in module.state_dict().items()}
    weight = module.dequantize()
    x = torch.randn(3, 96)
    out = module(x)
    assert module.release_sources()
    assert module.qweight is None and module.scale is None and module.offset is None
    after = module.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert torch.equal(module.dequantize(), weight)
    assert torch.equal(module(x), out)
    assert not module.release_sources()  # once


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, initializer_range=0.1)).eval()


@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped"])
def test_a_released_model_keeps_its_state_dict_and_logits(scheme) -> None:
    model = quantize_weights(llama(), scheme)  # fitted: q/k/v and gate/up fused
    table = model.get_input_embeddings().table
    assert table.packed is None  # looked up by row: no kernel records
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[5, 17, 3, 9, 5, 17, 40, 2]])
    with torch.inference_mode():
        want = model(ids).logits
    records = sum(m.qweight is not None for m in model.modules()
                  if isinstance(m, grouped.GroupedLinear) and m is not table)
    assert grouped.release_sources(model) == records == 2 * 7 + 1  # the head too
    assert table.qweight is not None  # the table keeps its codes: it has no records
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # a fused projection's weight comes back from its slice of the group's records
    q_proj = model.model.layers[1].self_attn.q_proj
    assert q_proj.packed is None and q_proj.fused_records is not None
    assert torch.equal(q_proj.sources()[0], before["model.layers.1.self_attn.q_proj.qweight"])


@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped"])
def test_a_worker_s_load_drops_each_copy_as_it_goes_and_decodes_as_a_full_load(
        scheme, varied_llama_folder: Path, tmp_path: Path, monkeypatch) -> None:
    """`held_once`: each grouped module's codes, scales and offsets go as soon as its records
    are packed, before the next module loads (so the file's copy of a weight is freed while
    the others load, not after them all); the loaded model decodes the tokens, and has the
    state dict, of a full load; a file that does not fit the model is refused."""
    from transformers import AutoTokenizer

    from compress.families.causal_lm.folder import save_causal_lm
    from compress.models.bundle import ModelBundle

    model = quantize_weights(LlamaForCausalLM.from_pretrained(varied_llama_folder).eval(),
                             scheme)
    save_causal_lm(ModelBundle(model, "causal-lm", [],
                               tokenizer=AutoTokenizer.from_pretrained(varied_llama_folder),
                               causal_lm_facts={"scheme": scheme, "group_size": 32,
                                                "head_scheme": loading.head_scheme_of(scheme)}),
                   tmp_path)
    full = loading.load_folder(tmp_path)
    packed_after = []  # at each module's packing: how many modules had dropped their copy
    pack = grouped.GroupedLinear.pack

    def counting_pack(module) -> None:
        packed_after.append(sum(m.qweight is None for m in module_list))
        pack(module)

    module_list: list[grouped.GroupedLinear] = []
    monkeypatch.setattr(grouped.GroupedLinear, "pack", counting_pack)
    original_load = loading.load_releasing

    def load_releasing(model, state):  # noqa: ANN001, ANN202
        module_list.extend(m for m in model.modules() if isinstance(m, grouped.GroupedLinear))
        return original_load(model, state)

    monkeypatch.setattr(loading, "load_releasing", load_releasing)
    once = loading.load_folder(tmp_path, held_once=True)
    table = once.model.get_input_embeddings().table
    kept = [m for m in module_list if m is not table]
    assert full.released == 0 and once.released == len(kept) == 2 * 7 + 1  # the head too
    assert all(m.qweight is None for m in kept) and table.qweight is not None
    n = len(module_list)  # one by one, in the loading order (the table keeps its codes)
    assert packed_after[:n] == [sum(m is not table for m in module_list[:i]) for i in range(n)]
    assert full.model.state_dict().keys() == once.model.state_dict().keys()
    assert all(torch.equal(v, once.model.state_dict()[k])
               for k, v in full.model.state_dict().items())
    ids = [[5, 17, 3, 9], [40, 2, 7, 7, 1, 30]]
    want = loading.StaticDecoder(full.model, 32).generate(ids, 8).rows
    assert len({t for row in want for t in row}) > 4
    assert loading.StaticDecoder(once.model, 32).generate(ids, 8).rows == want

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    del state["model.layers.1.mlp.down_proj.scale"]
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(RuntimeError, match="missing .*down_proj.scale"):
        loading.load_folder(tmp_path, held_once=True)


def test_freed_memory_goes_back_to_the_system() -> None:
    """glibc keeps a freed heap block for reuse; return_freed_memory hands it back."""
    def resident_kb() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    blocks = [bytearray(64 * 1024) for _ in range(3000)]  # 192 MB of small heap blocks
    for block in blocks:
        block[::4096] = b"x" * len(block[::4096])
    keep = blocks[-1]  # the heap's top stays in use: trimming the top alone frees nothing
    del blocks
    held = resident_kb()
    assert return_freed_memory()
    assert resident_kb() < held - 100 * 1024, (held, resident_kb())
    assert keep
