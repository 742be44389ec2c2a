"""The `handler:` section of an archive's `model-config.yaml`, typed: what the package stage
writes and the three handlers read, each its family's fields. Every default is written here
once: the package stage's options take theirs from it, and the handlers pass its values to
the runtime (`StaticDecoder`, the request `Limits`, the batcher, the prefiller), which have
none of their own. A key it does not know is refused, in one line that names it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


class UnknownSetting(ValueError):
    """A `handler:` key that no handler reads."""


@dataclass(frozen=True)
class HandlerSettings:
    """One archive's handler settings (model-config.yaml's `handler:` section)."""

    task: str = "classification"  # the family whose handler the archive ships
    threads: int | None = None  # intra-op threads per worker (None: cores / workers)
    # what one request may hold: classifier and embedding archives
    max_length: int = 128  # tokens a classifier's text is cut to
    max_text_chars: int = 10_000  # characters of one text (longer: a 413)
    max_items: int = 64  # texts or arrays in one request: each is a row of the batch
    length_buckets: bool = True  # a batch's texts run in passes of similar length
    # causal LMs
    max_new_tokens: int = 256  # the most a request may ask for
    default_new_tokens: int = 64  # what a request that asks for none gets
    cache_len: int = 512  # prompt + new tokens per row
    chat_template: bool = True  # a plain `prompt` goes through the chat template too
    compile: str = "none"  # the decode step: none, default or max-autotune
    cpp_wrapper: bool = True  # Inductor writes the compiled step's wrapper in C++
    rows: int | None = None  # continuous batching: rows decoded together (None: batchSize)
    max_waiting: int = 64  # continuous batching: rows that may wait, a request counted
    # from its arrival, before its body is parsed (past it: a 503 with Retry-After)
    # a request's JSON schema (response_format, tools), in characters of its JSON text: its
    # grammar compiles at about 3 us a character (longer: a 400; 0: no bound)
    max_schema_chars: int = 32_000
    # schemas waiting for (or in) compilation, on a thread at the lowest CPU priority: past
    # it, a request with a schema not yet compiled gets a 503 with Retry-After (0: no bound)
    max_schema_waiting: int = 2
    prefill_chunk: int = 32  # prompt tokens prefilled per step
    prefill_compile: bool = True  # the prefill compiled ahead of time (where the steps are)
    prefix_cache: bool | int = True  # reuse prompt prefixes (a number: positions kept)
    prefix_cache_mb: float | None = None  # the prefix cache's bound in MB (wins over positions)
    expert_parallel: int | None = None  # ranks that split a MoE model's experts
    speculate: int = 0  # continuous batching: the most prompt-lookup drafts a row verifies

    @classmethod
    def from_config(cls, section: dict[str, Any] | None) -> HandlerSettings:
        """The settings of a `handler:` section; `UnknownSetting` names a key it lacks."""
        section = dict(section or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise UnknownSetting(f"unknown handler setting {unknown[0]!r} (known: "
                                 f"{', '.join(sorted(known))})")
        return cls(**section)

    def rows_of(self, batch_size: int) -> int:
        """Rows decoded together: `rows`, or TorchServe's batchSize."""
        return max(1, int(self.rows or batch_size))
