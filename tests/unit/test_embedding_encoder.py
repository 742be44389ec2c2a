"""The embedding family's reader and measures (compress/families/embedding): the shipped
MiniLM and a random BERT folder with CLS pooling and no normalization (the `cls_bert_folder`
fixture) embed as sentence-transformers' own `encode` does; the measures score known cases
exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import minilm_folder

from compress.errors import UserError
from compress.families.embedding.encoder import load_encoder
from compress.families.embedding.layout import read_layout
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
    assert (layout.pooling, layout.normalize, layout.max_seq_length) == (("mean",), True, 256)
    ours, theirs = embed(folder, TEXTS), sentence_transformers_encode(folder, TEXTS)
    assert ours.shape == (4, 384)
    assert fidelity(ours, theirs)["fidelity_p1"] > 0.99999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(4), atol=1e-5)


def test_a_cls_pooled_folder_keeps_its_pooling(cls_bert_folder: Path) -> None:
    layout = read_layout(cls_bert_folder)
    assert (layout.pooling, layout.normalize) == (("cls",), False)
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


def test_a_matryoshka_model_is_measured_at_each_width() -> None:
    from compress.families.embedding.measures import quality_at_widths, widths_to_measure

    assert widths_to_measure(768, (768, 512, 256, 128, 64), True) == [512, 256, 128, 64]
    assert widths_to_measure(384, (), True) == [192, 96, 48]  # none declared: halvings
    assert widths_to_measure(384, (128,), False) == []
    torch.manual_seed(0)
    reference = torch.randn(40, 64)
    figures = quality_at_widths(reference, reference, [32, 16])
    assert set(figures) == {"fidelity_d32", "recall_at_10_d32", "fidelity_d16",
                            "recall_at_10_d16"}
    assert figures["fidelity_d32"] == 1.0
    # cutting a random (not Matryoshka-trained) embedding loses neighbours, more when shorter
    assert figures["recall_at_10_d16"] < figures["recall_at_10_d32"] < 1.0
