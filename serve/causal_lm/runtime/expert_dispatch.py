"""The mixture-of-experts layer of an expert-parallel rank: its share of a layer's experts
behind `torch.distributed.all_to_all_single` (`shard_experts` puts it in a model), and a
record of the collectives' time and bytes (torch only; shipped in the `causal_lm` package,
used by `expert_parallel.py` and `expert_compare.py`).

Every rank holds the same hidden states (everything but the experts is replicated), so the
tokens are assigned by position: of the T tokens a layer sees, rank r routes the contiguous
slice [r*ceil(T/N), (r+1)*ceil(T/N)) (at batch-1 decode, one token: rank 0 routes it, the
others route none and still serve their experts). For its slice a rank sorts the (token,
chosen expert) pairs by expert, which sorts them by the rank holding it (contiguous blocks
of E/N experts); one all_to_all_single exchanges the pairs' counts per expert, a second sends
the pairs' hidden rows to the experts' ranks, each rank runs its experts on what it received,
and a third sends the results back the same way. The routing rank scales them by the routing
weights and sums them per token in expert order, as transformers' experts module does, and an
all_gather re-replicates the layer's output on every rank.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .experts import expert_count, is_experts, keep_experts


class CommRecord:
    """Seconds and bytes of this rank's collectives by kind since the last `take()`; bytes
    follow nccl-tests' convention (the whole send buffer of an all-to-all, the gathered
    output of an all-gather), as compress's training telemetry counts them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.nbytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def add(self, kind: str, seconds: float, nbytes: int) -> None:
        """Note one collective of `kind`."""
        with self._lock:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
            self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def take(self) -> dict[str, dict[str, float]]:
        """{kind: {"s", "bytes", "calls"}} since the last call; starts afresh."""
        with self._lock:
            out = {k: {"s": self.seconds[k], "bytes": self.nbytes[k], "calls": self.calls[k]}
                   for k in self.seconds}
            self.seconds, self.nbytes, self.calls = {}, {}, {}
        return out


COMM = CommRecord()  # every expert-parallel layer of this process records here


def _timed(kind: str, nbytes: int, call: Any, *args: Any, **kwargs: Any) -> None:
    """Run the collective `call` (synchronous), recording it in `COMM`."""
    began = time.perf_counter()
    call(*args, **kwargs)
    COMM.add(kind, time.perf_counter() - began, nbytes)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ExpertParallelExperts(nn.Module):
    """A layer's experts module split across the ranks: `local` holds this rank's block of
    experts (global ids rank*E/N .. (rank+1)*E/N - 1, renumbered from 0); `forward` takes and
    gives what the whole module does (see the module doc)."""

    def __init__(self, local: nn.Module, experts: int, rank: int, ranks: int,
                 group: Any = None):
        super().__init__()
        self.local = local
        self.experts, self.rank, self.ranks, self.group = experts, rank, ranks, group
        self.per_rank = experts // ranks
        self.num_experts = experts  # what a router-side caller may read

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, width = hidden_states.shape
        share = -(-tokens // self.ranks)
        lo, hi = min(self.rank * share, tokens), min((self.rank + 1) * share, tokens)
        mine = self._route(hidden_states[lo:hi], top_k_index[lo:hi], top_k_weights[lo:hi])
        slices = [hidden_states.new_empty(share, width) for _ in range(self.ranks)]
        padded = torch.cat([mine, mine.new_zeros(share - mine.shape[0], width)])
        _timed("all_gather", _bytes(padded) * self.ranks, dist.all_gather, slices, padded,
               group=self.group)
        return torch.cat(slices)[:tokens]

    def _route(self, hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
               ) -> torch.Tensor:
        """This rank's tokens through their experts, wherever those live: the weighted sum
        of their chosen experts' outputs per token."""
        rows, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by the rank holding it
        token = torch.arange(rows, device=hidden.device).repeat_interleave(k)[order]
        counts = torch.bincount(flat, minlength=self.experts)  # pairs per global expert
        their = torch.empty_like(counts)  # pairs for each of my experts, from each rank
        _timed("all_to_all", _bytes(counts), dist.all_to_all_single, their, counts,
               group=self.group)
        send = counts.view(self.ranks, self.per_rank).sum(1).tolist()
        receive = their.view(self.ranks, self.per_rank).sum(1).tolist()
        outgoing = hidden[token]
        incoming = hidden.new_empty(sum(receive), hidden.shape[1])
        _timed("all_to_all", _bytes(outgoing), dist.all_to_all_single, incoming, outgoing,
               receive, send, group=self.group)
        local_ids = torch.arange(self.per_rank, device=hidden.device).repeat(
            self.ranks).repeat_interleave(their)
        done = self.local(incoming, local_ids[:, None],
                          incoming.new_ones(incoming.shape[0], 1))
        back = hidden.new_empty(outgoing.shape)
        _timed("all_to_all", _bytes(done), dist.all_to_all_single, back, done.contiguous(),
               send, receive, group=self.group)
        out = torch.zeros_like(hidden)  # weighted in the routing weights' dtype, as
        scale = weights.reshape(-1)[order]  # transformers does, then summed in the model's
        return out.index_add_(0, token, (back * scale[:, None]).to(out.dtype))


def shard_experts(model: nn.Module, rank: int, ranks: int, group: Any = None) -> int:
    """Replace every experts module of `model` by its rank's block behind the all-to-all
    dispatch, in place; how many were split."""
    found = [(name, m) for name, m in model.named_modules() if is_experts(m)]
    if not found:
        raise ValueError("expert_parallel: the model has no mixture-of-experts layers")
    for name, module in found:
        experts = expert_count(module)
        if experts % ranks:
            raise ValueError(f"expert_parallel: {ranks} does not divide the model's "
                             f"{experts} experts per layer; use a divisor of {experts}")
        per = experts // ranks
        keep_experts(module, list(range(rank * per, (rank + 1) * per)))
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, ExpertParallelExperts(module, experts, rank, ranks, group))
    return len(found)


def expert_weight_bytes(model: nn.Module) -> int:
    """Bytes of the experts' weights this rank holds (each storage once; a quantized tensor
    by its inner tensors)."""
    def inner(t: Any) -> list[Any]:
        if hasattr(t, "__tensor_flatten__"):
            return [x for n in t.__tensor_flatten__()[0] for x in inner(getattr(t, n))]
        return [t]

    owners = [m for m in model.modules() if is_experts(m)]
    tensors = [t for m in owners for w in (*m.parameters(), *m.buffers()) for t in inner(w)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())
