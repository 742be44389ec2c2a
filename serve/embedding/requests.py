"""Requests to a served embedding model, read into token rows (shipped in the embedding
archive's `embedding` package; no compress imports).

The native route takes `{"text": s}`, `{"texts": [s, ...]}` or a plain-text body. OpenAI's
`v1/embeddings` takes `input` (a string, a list of strings, a token array or a list of token
arrays), `encoding_format` (float or base64), `dimensions` (only for a model trained for
shorter embeddings: Matryoshka), `model` (any name) and `user` (ignored); `null` is absent.
Texts are truncated at the export's `max_seq_length` tokens, as sentence-transformers does;
a token array is the text's tokens without the special ones, which are added around it as
the tokenizer adds them around a text (so that a text and its tokens embed alike). Every
limit passed is a ValueError, a 400 for that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve.batching import Row, check_texts, complete_row, text_items, token_rows

FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
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


@dataclass(frozen=True)
class EmbeddingRequest:
    """One request read: a token row per input, and how its answer is written."""

    rows: list[Row]
    many: bool = False  # native: a list of embeddings was asked for
    openai: bool = False
    dimensions: int | None = None  # OpenAI: the width asked for (None: the model's)
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
        return EmbeddingRequest(self.text_rows(texts), many)

    def openai(self, body: Any) -> EmbeddingRequest:
        """An OpenAI `v1/embeddings` body."""
        if not isinstance(body, dict):
            raise ValueError('send a JSON object: {"input": "...", "model": "..."}')
        body = {k: v for k, v in body.items() if v is not None}
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise ValueError(f"unsupported field {unknown[0]!r}: this server answers "
                             f"{', '.join(FIELDS)}")
        if "model" in body and not isinstance(body["model"], str):
            raise ValueError("model: a string")
        fmt = body.get("encoding_format", "float")
        if fmt not in FORMATS:
            raise ValueError(f"encoding_format: float or base64, not {fmt!r}")
        if "input" not in body:
            raise ValueError("input is required")
        texts, arrays = _inputs(body["input"])
        limits = self.limits
        if texts:
            check_texts(texts, limits.max_items, limits.max_chars, "inputs")
            rows = self.text_rows(texts)
        else:
            rows = self.array_rows(arrays)
        return EmbeddingRequest(rows, openai=True, dimensions=self.width(body),
                                base64=fmt == "base64")

    def width(self, body: dict[str, Any]) -> int | None:
        """The `dimensions` asked for: None for the model's own width."""
        wanted, width = body.get("dimensions"), self.limits.width
        if wanted is None:
            return None
        if isinstance(wanted, bool) or not isinstance(wanted, int):
            raise ValueError(f"dimensions: an integer, got {wanted!r}")
        if not self.limits.matryoshka:
            if wanted == width:
                return None
            raise ValueError(f"dimensions: this model's embeddings have {width} dimensions "
                             "and it was not trained to be cut shorter (no Matryoshka "
                             f"training), so dimensions can only be {width}; leave it out")
        if not 1 <= wanted <= width:
            raise ValueError(f"dimensions: from 1 to {width}, got {wanted}")
        return None if wanted == width else wanted

    def text_rows(self, texts: list[str]) -> list[Row]:
        """Each text's token row, truncated at max_seq_length tokens."""
        return token_rows(self.tokenizer, texts, self.limits.max_tokens, self.names)

    def array_rows(self, arrays: list[list[int]]) -> list[Row]:
        """Each token array's row: truncated so that with the special tokens around it it
        fits max_seq_length, as a text's tokens are."""
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
            ids = ids[:room]
            tokens = {name: self.prefix[name] + ([self.inner[name]] * len(ids)
                                                 if name != "input_ids" else ids)
                      + self.suffix[name] for name in self.prefix}
            rows.append(complete_row(tokens, self.names))
        return rows


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
