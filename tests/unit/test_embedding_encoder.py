"""The embedding family's reader and measures (compress/families/embedding): the shipped
MiniLM and a random BERT folder with CLS pooling and no normalization, made here, embed as
sentence-transformers' own `encode` does; the measures score known cases exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import minilm_folder

from compress.errors import UserError
from compress.families.embedding.encoder import load_encoder, read_layout
from compress.families.embedding.measures import fidelity, knn_accuracy, recall_at_k

TEXTS = ["the film was wonderful", "a dull, lifeless movie", "hi",
         "one of the best performances of the year, and a script to match it"]


def embed(folder: Path, texts: list[str]) -> torch.Tensor:
    encoder, tokenizer, _ = load_encoder(folder)
    inputs = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return encoder(**inputs)


def sentence_transformers_encode(folder: Path, texts: list[str]) -> torch.Tensor:
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(folder), device="cpu")
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True))


def test_the_shipped_minilm_embeds_as_sentence_transformers_does() -> None:
    folder = Path(minilm_folder())
    layout = read_layout(folder)
    assert (layout.pooling, layout.normalize, layout.max_seq_length) == ("mean", True, 256)
    ours, theirs = embed(folder, TEXTS), sentence_transformers_encode(folder, TEXTS)
    assert ours.shape == (4, 384)
    assert fidelity(ours, theirs)["fidelity_p1"] > 0.99999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(4), atol=1e-5)


@pytest.fixture(scope="module")
def cls_bert_folder(tmp_path_factory) -> Path:
    """A random-init BERT sentence-transformers folder: CLS pooling, no Normalize."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = tmp_path_factory.mktemp("cls_bert")
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling/config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": True,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False}))
    return folder


def test_a_cls_pooled_folder_keeps_its_pooling(cls_bert_folder: Path) -> None:
    layout = read_layout(cls_bert_folder)
    assert (layout.pooling, layout.normalize) == ("cls", False)
    ours = embed(cls_bert_folder, TEXTS)
    theirs = sentence_transformers_encode(cls_bert_folder, TEXTS)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert not torch.allclose(ours.norm(dim=-1), torch.ones(4), atol=1e-3)  # not normalized


def test_a_folder_that_is_not_sentence_transformers_says_so(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="modules.json"):
        read_layout(tmp_path)


def test_the_measures_on_known_cases() -> None:
    torch.manual_seed(0)
    reference = torch.randn(40, 16)
    assert fidelity(reference, reference) == {"fidelity": 1.0, "fidelity_p1": 1.0}
    assert fidelity(-reference, reference)["fidelity"] == -1.0
    assert recall_at_k(reference * 3.0, reference, k=10) == 1.0  # scale keeps neighbours
    shuffled = reference[torch.randperm(40)]
    assert recall_at_k(shuffled, reference, k=10) < 0.5
    centres = torch.eye(4) * 10  # four tight clusters, labelled by cluster
    points = torch.cat([centres[c] + 0.1 * torch.randn(10, 4) for c in range(4)])
    labels = torch.arange(4).repeat_interleave(10)
    assert knn_accuracy(points, labels, k=5) == 1.0
    assert knn_accuracy(points, labels[torch.randperm(40)], k=5) < 0.6
