"""Requests to a served embedding model, read into token rows (shipped in the embedding
archive's `embedding` package; no compress imports).

The native route takes `{"text": s}`, `{"texts": [s, ...]}` or a plain-text body, and
`prompt_name` (one of the model's prompts). OpenAI's `v1/embeddings` takes `input` (a string,
a list of strings, a token array or a list of token arrays), `encoding_format` (float or
base64), `dimensions` (only for a model trained for shorter embeddings: Matryoshka, or one
whose folder sets `truncate_dim`), `input_type` (`query` or `document`, as Voyage and Jina
name it: the model's prompt of that kind), `model` (any name) and `user` (ignored); `null` is
absent. With neither `prompt_name` nor `input_type`, a text gets the model's default prompt,
as sentence-transformers' encode does; the prompt is put before the text, then tokenized.
Without `dimensions`, an embedding is cut at the folder's `truncate_dim` where it has one.
Texts are truncated at the export's `max_seq_length` tokens, as sentence-transformers does;
a token array is the text's tokens without the special ones, which are added around it as
the tokenizer adds them around a text (so that a text and its tokens embed alike). Every
limit passed is a ValueError, a 400 for that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from serve.batching import Row, check_texts, complete_row, text_items, token_rows

FIELDS = ("input", "model", "encoding_format", "dimensions", "input_type", "user")
# OpenAI-route input_type -> the model's prompt names that serve it, first found wins
INPUT_TYPES = {"query": ("query", "search_query", "queries"),
               "document": ("document", "passage", "search_document", "corpus", "documents")}
FORMATS = ("float", "base64")
INPUT_HELP = ("input: a string, a list of strings, a token array (a list of token ids) or a "
              "list of token arrays")
PROBE = "a"  # a text whose tokens show where the tokenizer puts its special tokens


@dataclass(frozen=True)
class Limits:
    """What a request may send, and what the export says of its embeddings."""

    max_items: int  # inputs in one request
    max_chars: int  # characters of a text (tokens of a token array)
    max_tokens: int  # the export's max_seq_length: longer inputs are truncated
    width: int  # the export's dimensions
    matryoshka: bool = False  # a prefix of an embedding is an embedding too
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before a text
    default_prompt_name: str | None = None  # the prompt of a request that names none
    truncate_dim: int | None = None  # the width of an answer that asks for none

    @classmethod
    def of_export(cls, facts: dict[str, Any], max_items: int, max_chars: int,
                  max_tokens: int) -> Limits:
        """The limits of an export whose `export.json` embedding block is `facts`."""
        return cls(max_items, max_chars, max_tokens, int(facts["dimensions"]),
                   bool(facts.get("matryoshka")), dict(facts.get("prompts") or {}),
                   facts.get("default_prompt_name"), facts.get("truncate_dim"))

    @property
    def default_width(self) -> int | None:
        """The width of an answer that asks for none (None: the whole embedding)."""
        cut = self.truncate_dim
        return cut if cut and cut < self.width else None


@dataclass(frozen=True)
class EmbeddingRequest:
    """One request read: a token row per input, and how its answer is written."""

    rows: list[Row]
    many: bool = False  # native: a list of embeddings was asked for
    openai: bool = False
    dimensions: int | None = None  # the width answered (None: the model's whole width)
    base64: bool = False  # OpenAI: embeddings as base64 of little-endian float32

    @property
    def tokens(self) -> int:
        """The tokens the model reads for this request (special tokens included)."""
        return sum(len(row[0]) for row in self.rows)


class Reader:
    """Reads request bodies into `EmbeddingRequest`s with the export's tokenizer."""

    def __init__(self, tokenizer: Any, names: list[str], limits: Limits):
        self.tokenizer, self.names, self.limits = tokenizer, names, limits
        self.vocab = len(tokenizer)
        full = tokenizer(PROBE)
        plain = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        start = _find(full["input_ids"], plain)
        self.prefix = {k: v[:start] for k, v in full.items()}  # what the tokenizer adds
        self.suffix = {k: v[start + len(plain):] for k, v in full.items()}  # around a text
        self.inner = {k: v[start] for k, v in full.items() if k != "input_ids"}

    def native(self, body: Any) -> EmbeddingRequest:
        """`{"text": s}`, `{"texts": [s, ...]}` or a plain string."""
        texts, many = text_items(body, self.limits.max_items, self.limits.max_chars)
        name = body.get("prompt_name") if isinstance(body, dict) else None
        return EmbeddingRequest(self.text_rows(texts, self.named_prompt(name)), many,
                                dimensions=self.limits.default_width)

    def openai(self, body: Any) -> EmbeddingRequest:
        """An OpenAI `v1/embeddings` body."""
        if not isinstance(body, dict):
            raise ValueError('send a JSON object: {"input": "...", "model": "..."}')
        body = {k: v for k, v in body.items() if v is not None}
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise ValueError(f"unsupported field {unknown[0]!r}: this server answers "
                             f"{', '.join(FIELDS)}")
        for name in ("model", "user"):
            if name in body and not isinstance(body[name], str):
                raise ValueError(f"{name}: a string")
        fmt = body.get("encoding_format", "float")
        if fmt not in FORMATS:
            raise ValueError(f"encoding_format: float or base64, not {fmt!r}")
        if "input" not in body:
            raise ValueError("input is required")
        texts, arrays = _inputs(body["input"])
        limits = self.limits
        prompt = self.typed_prompt(body.get("input_type"))
        if texts:
            check_texts(texts, limits.max_items, limits.max_chars, "inputs")
            rows = self.text_rows(texts, prompt)
        else:
            rows = self.array_rows(arrays, prompt)
        return EmbeddingRequest(rows, openai=True, dimensions=self.width(body),
                                base64=fmt == "base64")

    def width(self, body: dict[str, Any]) -> int | None:
        """The `dimensions` asked for: None for the model's own width."""
        wanted, width = body.get("dimensions"), self.limits.width
        if wanted is None:
            return self.limits.default_width
        if isinstance(wanted, bool) or not isinstance(wanted, int):
            raise ValueError(f"dimensions: an integer, got {wanted!r}")
        if not (self.limits.matryoshka or self.limits.truncate_dim):
            if wanted == width:
                return None
            raise ValueError(f"dimensions: this model's embeddings have {width} dimensions "
                             "and it was not trained to be cut shorter (no Matryoshka "
                             f"training), so dimensions can only be {width}; leave it out")
        if not 1 <= wanted <= width:
            raise ValueError(f"dimensions: from 1 to {width}, got {wanted}")
        return None if wanted == width else wanted

    def named_prompt(self, name: Any) -> str:
        """The prompt `prompt_name` names (None: the default prompt, else none)."""
        prompts = self.limits.prompts
        if name is None:
            return prompts.get(self.limits.default_prompt_name or "", "")
        if not isinstance(name, str) or name not in prompts:
            choices = ", ".join(sorted(prompts)) or "none: this model has no prompts"
            raise ValueError(f"prompt_name: one of this model's prompts ({choices}), "
                             f"got {name!r}")
        return prompts[name]

    def typed_prompt(self, input_type: Any) -> str:
        """The prompt of OpenAI-route `input_type` (None: the default prompt): the model's
        prompt of that kind, or none where it has no such prompt."""
        if input_type is None:
            return self.named_prompt(None)
        if input_type not in INPUT_TYPES:
            raise ValueError(f"input_type: {' or '.join(INPUT_TYPES)}, got {input_type!r}")
        names = [n for n in INPUT_TYPES[input_type] if n in self.limits.prompts]
        return self.limits.prompts[names[0]] if names else ""

    def text_rows(self, texts: list[str], prompt: str = "") -> list[Row]:
        """Each text's token row, the prompt put before it, truncated at max_seq_length
        tokens."""
        return token_rows(self.tokenizer, [prompt + text for text in texts],
                          self.limits.max_tokens, self.names)

    def array_rows(self, arrays: list[list[int]], prompt: str = "") -> list[Row]:
        """Each token array's row, the prompt's tokens before it: truncated so that with the
        special tokens around it it fits max_seq_length, as a text's tokens are."""
        lead = (self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                if prompt else [])
        limits = self.limits
        if len(arrays) > limits.max_items:
            raise ValueError(f"too many inputs: {len(arrays)}, at most {limits.max_items} in "
                             "one request")
        room = max(1, limits.max_tokens - len(self.prefix["input_ids"])
                   - len(self.suffix["input_ids"]))
        rows = []
        for ids in arrays:
            if len(ids) > limits.max_chars:
                raise ValueError(f"token array too long: {len(ids)} tokens, at most "
                                 f"{limits.max_chars}")
            if not all(0 <= t < self.vocab for t in ids):
                raise ValueError(f"token ids: from 0 to {self.vocab - 1} (this model's "
                                 "vocabulary)")
            ids = (lead + ids)[:room]
            tokens = {name: self.prefix[name] + ([self.inner[name]] * len(ids)
                                                 if name != "input_ids" else ids)
                      + self.suffix[name] for name in self.prefix}
            rows.append(complete_row(tokens, self.names))
        return rows


def narrowed(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """The embeddings cut to their first `dimensions` values (None: whole), made unit length
    again where the model normalizes (sentence-transformers' truncate_dim, then Normalize)."""
    if dimensions is None:
        return vectors
    cut = vectors[:, :dimensions]
    return torch.nn.functional.normalize(cut, p=2, dim=-1) if normalize else cut


def _inputs(value: Any) -> tuple[list[str], list[list[int]]]:
    """(texts, token arrays) of OpenAI's `input`: exactly one of them is not empty."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(INPUT_HELP)
    if all(_is_id(t) for t in value):
        return [], [value]
    if all(isinstance(t, str) for t in value):
        if not all(t.strip() for t in value):
            raise ValueError("input: an empty string has no embedding; send some text")
        return value, []
    if all(isinstance(a, list) and a and all(_is_id(t) for t in a) for a in value):
        return [], value
    raise ValueError(INPUT_HELP + " (not a mix, and no empty array)")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _find(sequence: list[int], part: list[int]) -> int:
    """Where `part` starts in `sequence` (0 when the tokenizer's probe shows no part)."""
    for start in range(len(sequence) - len(part) + 1):
        if sequence[start:start + len(part)] == part:
            return start
    return 0
