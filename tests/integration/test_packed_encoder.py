"""Issue 44: a sentence encoder that packs its batch (compress/families/embedding/packing.py):
its pooling against the padded one, MiniLM packed against MiniLM padded, an AOTInductor
package of a packed encoder (export.json's `aoti_packed`) run by the shipped loader and by
the embedding handler in one pass, and the refusals of `attention: packed`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import minilm_folder

from compress.errors import CompressError
from compress.families.embedding.encoder import MODES, SentenceEncoder, load_encoder, pool
from compress.families.embedding.packing import pool_packed
from export.errors import CaptureError
from serve import encoder_attention

TEXTS = ["ok", "a film that is both funny and sad, and never dull for a moment",
         "the plot holds together", "", "one more review of middling length, with commas"]


@pytest.fixture(scope="module")
def kernel() -> None:
    assert encoder_attention.load(), encoder_attention.error()


def padded_batch(lengths: list[int], width: int, seed: int = 0):
    """(tokens rows x width x 8, right-padded mask, the packed tokens, their rows, offsets)."""
    tokens = torch.randn(len(lengths), width, 8, generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    kept = mask.reshape(-1).nonzero().squeeze(1)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return tokens, mask, tokens.reshape(-1, 8)[kept], kept // width, offsets


@pytest.mark.parametrize("mode", MODES)
def test_packed_pooling_is_the_padded_pooling(mode: str) -> None:
    tokens, mask, packed, row, offsets = padded_batch([3, 7, 1, 7], 7)
    want = pool(tokens, mask, mode)
    got = pool_packed(packed, row, offsets, 4, mode)
    assert got.shape == (4, 8)
    assert torch.allclose(got, want, atol=1e-6), mode


def test_packed_minilm_embeds_as_padded_minilm(kernel) -> None:
    """Every text alone and the batch padded against the batch packed: one vector a text,
    the same up to the kernel's bfloat16 products (sdpa's float32 where it has none)."""
    encoder, tokenizer, layout = load_encoder(Path(minilm_folder()))
    packed = encoder.packed()
    assert packed.modes == layout.pooling == ("mean",) and packed.normalize
    assert encoder.transformer.config._attn_implementation != "compress_packed"  # a copy
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = encoder(**batch)
        got = packed(**batch)
        alone = torch.cat([packed(**tokenizer([t], return_tensors="pt")) for t in TEXTS])
    assert got.shape == (len(TEXTS), 384)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.9995
    assert torch.nn.functional.cosine_similarity(got, alone).min() > 0.9995
    with pytest.raises(CompressError, match="eval mode only"):
        packed.train()(**batch)


def tiny_sentence_encoder(tmp_path: Path):
    """A 2-layer random BERT (heads of 16) as a mean-pooled, normalized sentence encoder
    bundle, with MiniLM's tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from compress.models.bundle import ModelBundle

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    transformer = BertModel(config).eval()
    transformer.set_attn_implementation("sdpa")
    encoder = SentenceEncoder(transformer, "mean", True, 128).eval()
    return ModelBundle(encoder, "embedding", [],
                       tokenizer=AutoTokenizer.from_pretrained(minilm_folder()))


def test_a_packed_aoti_package_is_served_in_one_pass(kernel, tmp_path: Path) -> None:
    from compress.recipe.kinds.export import ExportConfig
    from compress.serving.handler_host.context import HandlerContext
    from compress.stages.export import export
    from export.folder import load_export
    from serve.batching import padded, token_rows
    from serve.embedding.handler import EmbeddingHandler

    bundle = tiny_sentence_encoder(tmp_path)
    facts = {"pooling": "mean", "normalize": True, "dimensions": 32, "max_seq_length": 128,
             "matryoshka": False}
    folder = tmp_path / "aoti"
    export(bundle, ExportConfig(format="aoti", attention="packed"), folder, None, 128,
           lambda _: None, meta={"outputs": ["embedding"], "embedding": facts})
    meta = json.loads((folder / "export.json").read_text())
    assert meta["aoti_packed"] is True and meta["aoti_attention_kernel_calls"] == 2
    batch = bundle.tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = bundle.model(**batch)
        got = load_export(folder, 1).model(**batch)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.999

    handler = EmbeddingHandler()
    handler.initialize(HandlerContext("tiny", folder, {"handler": {"length_buckets": True}},
                                      {"model": {"modelName": "tiny"}}))
    assert handler.length_buckets is False  # a packed file: every row in one pass
    names = meta["inputs"]
    rows = token_rows(bundle.tokenizer, TEXTS, 128, names)
    passes = []
    forward = handler.forward
    handler.forward = lambda *inputs: passes.append(inputs[0].shape) or forward(*inputs)
    served = torch.stack(handler.run_rows(rows))
    assert passes == [padded(rows, 0, names)[0].shape]
    assert torch.nn.functional.cosine_similarity(served, want).min() > 0.999


def test_packed_is_refused_where_it_cannot_be(kernel, tmp_path: Path) -> None:
    """A classifier has no packed form; an int8 graph captured padded is not packed."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from compress.models.bundle import ModelBundle
    from compress.recipe.kinds.export import ExportConfig
    from compress.search.candidates import candidate_stages, packed_bundle
    from compress.stages.export import export
    from export.aoti import packed_calls
    from export.graphs import export_graph, export_inputs, graph_module

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=2)
    classifier = ModelBundle(BertForSequenceClassification(config).eval(), "hf", ["n", "p"],
                             tokenizer=AutoTokenizer.from_pretrained(minilm_folder()))
    with pytest.raises(CaptureError, match="attention: packed packs the texts"):
        export(classifier, ExportConfig(format="aoti", attention="packed"), tmp_path / "c",
               None, 128, lambda _: None)
    with pytest.raises(CompressError, match="for sentence encoders"):
        packed_bundle(classifier)
    encoder = tiny_sentence_encoder(tmp_path)
    program = export_graph(graph_module(encoder), export_inputs(encoder), True, 128)
    with pytest.raises(CaptureError, match="captured before packing"):
        packed_calls(program)
    stages = candidate_stages("pt2e_static_packed_aoti", [], {"samples": 8, "batch_size": 4})
    assert stages[0].mode == "static" and stages[-1].attention == "packed"
