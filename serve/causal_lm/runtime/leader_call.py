"""What rank 0 of a served split model (pipeline or expert parallel) tells the other ranks
before each generation, sent as int64 tensors by `torch.distributed.broadcast`: never a
pickle, so a rank runs no code that another process chose.

The message is its length (one int64), then the payload:

    VERSION, rows, chunks, stop count (-1: None), sampling given (0 / 1),
    each row's prompt length, each row's max_new_tokens, the prompts' tokens, the stop ids,
    and with sampling, per row: given (0 / 1), temperature and top_p (float64 bits), seed
    given (0 / 1), seed (its 64 bits: seeds run to 2**64 - 1).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .decode import Sampling

VERSION = 1
HEADER = 5


@dataclass(frozen=True)
class LeaderCall:
    """One generation's arguments, as every rank runs it."""

    prompt: list[list[int]]
    max_new_tokens: list[int]
    stop: set[int] | None = None
    sampling: list[Sampling | None] | None = None
    chunks: int = 1  # a pipeline's micro-batches

    @classmethod
    def of(cls, prompt: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: Any,
           stop: set[int] | None = None, sampling: Sequence[Sampling | None] | None = None,
           chunks: int = 1) -> LeaderCall:
        """A call from `generate`'s arguments (a tensor or lists of ids; one limit or one a
        row)."""
        rows = prompt.tolist() if isinstance(prompt, torch.Tensor) else [
            [int(t) for t in row] for row in prompt]
        limits = ([int(n) for n in max_new_tokens] if isinstance(max_new_tokens, Sequence)
                  else [int(max_new_tokens)] * len(rows))
        return cls(rows, limits, None if stop is None else {int(t) for t in stop},
                   None if sampling is None else list(sampling), chunks)


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def seed_bits(seed: int) -> int:
    """A seed of 0 to 2**64 - 1 as an int64 (its bits: the upper half wraps below 0)."""
    return seed - 2**64 if seed >= 2**63 else seed


def seed_of(bits: int) -> int:
    """The seed `seed_bits` wrote."""
    return bits + 2**64 if bits < 0 else bits


def encode(call: LeaderCall) -> torch.Tensor:
    """The payload of `call` (see the module doc)."""
    rows = len(call.prompt)
    if len(call.max_new_tokens) != rows or (call.sampling is not None
                                            and len(call.sampling) != rows):
        raise ValueError(f"leader call: {rows} prompts, {len(call.max_new_tokens)} limits, "
                         f"{len(call.sampling or [])} samplings")
    stop = sorted(call.stop) if call.stop is not None else []
    out = [VERSION, rows, call.chunks, -1 if call.stop is None else len(stop),
           int(call.sampling is not None)]
    out += [len(row) for row in call.prompt] + list(call.max_new_tokens)
    out += [t for row in call.prompt for t in row] + stop
    for pick in call.sampling or []:
        if pick is None:
            out += [0, 0, 0, 0, 0]
        else:
            out += [1, _bits(pick.temperature), _bits(pick.top_p),
                    int(pick.seed is not None), seed_bits(pick.seed or 0)]
    return torch.tensor(out, dtype=torch.int64)


def decode(payload: torch.Tensor) -> LeaderCall:
    """The call `encode` wrote; RuntimeError on a payload that is not one."""
    values = payload.tolist()
    if len(values) < HEADER or values[0] != VERSION:
        raise RuntimeError(f"leader call: not a version-{VERSION} message "
                           f"({len(values)} values)")
    _, rows, chunks, stops, sampled = values[:HEADER]
    at = HEADER
    lengths, limits = values[at:at + rows], values[at + rows:at + 2 * rows]
    at += 2 * rows
    size = (at + sum(lengths) + max(stops, 0) + (5 * rows if sampled else 0)
            if rows >= 0 and len(limits) == rows and min(lengths, default=0) >= 0 else -1)
    if size != len(values):
        raise RuntimeError(f"leader call: {len(values)} values where the header says {size}")
    prompt = []
    for length in lengths:
        prompt.append(values[at:at + length])
        at += length
    stop = None if stops < 0 else set(values[at:at + stops])
    at += max(stops, 0)
    sampling: list[Sampling | None] | None = None
    if sampled:
        sampling = []
        for _ in range(rows):
            given, temperature, top_p, has_seed, seed = values[at:at + 5]
            at += 5
            sampling.append(Sampling(_float(temperature), _float(top_p),
                                     seed_of(seed) if has_seed else None) if given else None)
    return LeaderCall(prompt, limits, stop, sampling, chunks)


def broadcast(call: LeaderCall | None, src: int = 0) -> LeaderCall:
    """`call` (given on rank `src`, None elsewhere) on every rank, decoded from the tensors
    sent: rank `src` gets back exactly what the others get."""
    if dist.get_rank() == src:
        if call is None:
            raise ValueError("leader call: the leading rank has no call to send")
        payload = encode(call)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.int64)
    dist.broadcast(payload, src=src)
    return decode(payload)
