"""The GPU path of 2:4 sparsity: a tiny BERT classifier pruned 2:4 on the CPU, moved to
CUDA in float16, its 2:4 Linears turned into semi-structured sparse tensors; its logits
match the dense masked float16 model's, eagerly and replayed from a CUDA graph, and every
2:4 Linear was converted. Imports nothing that needs torchao, which a GPU machine may lack."""

from __future__ import annotations

import copy

import torch

from compress.algorithms.pruning import select_layers
from compress.algorithms.semi_structured import prune_n_m
from compress.algorithms.semi_structured_gpu import graphed, to_semi_structured

EXCLUDE = ["*embeddings*", "*classifier*", "*pooler*"]


def _bert_2_4() -> tuple[torch.nn.Module, list[str]]:
    """A 2-layer BERT classifier (hidden 128, FFN 512: shapes both backends take) with its
    encoder Linears pruned 2:4 by magnitude; (the model, the names pruned)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=128, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=512, num_labels=2)
    model = BertForSequenceClassification(config).eval()
    _, pruned, _ = prune_n_m(select_layers(model, ["*"], EXCLUDE), 2, 4)
    return model, sorted(pruned)


def test_2_4_bert_logits_match_the_dense_masked_model_in_fp16() -> None:
    model, pruned = _bert_2_4()
    dense = model.half().cuda()
    sparse = copy.deepcopy(dense)
    result = to_semi_structured(sparse)

    assert sorted(result.converted) == pruned, result
    assert len(pruned) == 12  # q, k, v, attention out, intermediate, out: 6 a layer
    modules = dict(sparse.named_modules())
    for name in pruned:
        weight = modules[name].weight
        assert isinstance(weight, torch.sparse.SparseSemiStructuredTensor), name
        assert not weight.requires_grad
    # the classifier (2 x 128) is too small for the backend, the pooler was left dense
    assert "shape 2x128" in result.skipped["classifier"], result.skipped
    assert "not 2:4" in result.skipped["bert.pooler.dense"], result.skipped

    # 3 x 12 and 5 x 37 tokens: row counts the backend pads to its dense minimum
    for batch, length in ((3, 12), (5, 37)):
        ids = torch.randint(0, 100, (batch, length), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(batch))
        with torch.no_grad():
            want = dense(input_ids=ids).logits.float()
            got = sparse(input_ids=ids).logits.float()
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

        # the same products replayed from a CUDA graph (what makes them fast, see
        # semi_structured_gpu.graphed); a new input is copied into the captured one
        replay = graphed(lambda x: sparse(input_ids=x).logits, ids)
        other = torch.randint(0, 100, (batch, length), device="cuda")
        with torch.no_grad():
            want_other = dense(input_ids=other).logits.float()
        torch.testing.assert_close(replay(ids).float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(replay(other).float(), want_other, atol=2e-2, rtol=2e-2)


def test_a_model_left_on_the_cpu_is_skipped_with_why() -> None:
    model, pruned = _bert_2_4()
    result = to_semi_structured(model.half())
    assert result.converted == []
    assert all("not CUDA" in result.skipped[name] for name in pruned), result.skipped
