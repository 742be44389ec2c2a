"""MoEfication of a dense causal LM (Zhang et al., 2022): which feed-forward neurons form each
expert, and the routers that pick an expert set per token.

A SwiGLU feed-forward layer computes down(act(gate(x)) * up(x)): a sum over its I neurons,
neuron i adding h_i * down[:, i]. Splitting the neurons into E groups makes that sum a sum
of E experts' outputs. How large neuron i's share of one token's output is: its score
|h_i| x ||down[:, i]|| (an upper bound of its output's norm); an expert's mass for a token
is the sum of its neurons' scores, and a good router picks the k experts of largest mass.

- `capture`: the feed-forward inputs x and neuron scores of every layer, by forward hooks.
- `balanced_kmeans`: the coactivation split; each neuron described by its (L2-normalised)
  scores over calibration tokens, clustered into E groups of exactly I/E neurons.
- `router_loss` / `selected_mass`: the router objective (the top-k mass experts as a
  soft target) and the share of activation mass a router's choice keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from compress.families.causal_lm.algorithms.distill import decoder_layers


def swiglu_mlps(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's SwiGLU feed-forward module (gate_proj, up_proj, down_proj)."""
    mlps = [getattr(layer, "mlp", None) for layer in decoder_layers(model)]
    if not all(all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))
               for m in mlps):
        raise ValueError(f"{type(model).__name__}'s decoder layers have no SwiGLU "
                         "feed-forward (mlp.gate_proj/up_proj/down_proj) to split")
    return mlps


@contextlib.contextmanager
def capture(model: nn.Module) -> Iterator[list[dict[str, torch.Tensor]]]:
    """While open, each forward of `model` fills one dict per decoder layer: `x` the
    feed-forward input (tokens x H) and `score` each neuron's |h| x ||down column||
    (tokens x I), both detached."""
    mlps = swiglu_mlps(model)
    found: list[dict[str, torch.Tensor]] = [{} for _ in mlps]
    handles = []
    for slot, mlp in zip(found, mlps, strict=True):
        def on_mlp(module, args, slot=slot):
            slot["x"] = args[0].detach().reshape(-1, args[0].shape[-1])

        def on_down(module, args, slot=slot):
            h = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            slot["score"] = h.abs() * module.weight.detach().float().norm(dim=0)

        handles += [mlp.register_forward_pre_hook(on_mlp),
                    mlp.down_proj.register_forward_pre_hook(on_down)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def split_neurons(model: nn.Module, batches: list[torch.Tensor], experts: int, method: str,
                  cluster_tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """Per decoder layer, E x I/E neuron indexes: `contiguous`, or `coactivation` (balanced
    k-means of each neuron's scores over the first `cluster_tokens` tokens of `batches`)."""
    widths = [mlp.down_proj.weight.shape[1] for mlp in swiglu_mlps(model)]
    if method == "contiguous":
        return [contiguous_groups(width, experts) for width in widths]
    scores: list[list[torch.Tensor]] = [[] for _ in widths]
    seen = 0
    with torch.no_grad(), capture(model) as found:
        for ids in tqdm(batches, desc="moefy: neuron activations", unit="batch",
                        mininterval=1.0, dynamic_ncols=True):
            model(input_ids=ids)
            for kept, slot in zip(scores, found, strict=True):
                kept.append(slot["score"][:cluster_tokens - seen].half())
            seen += len(scores[0][-1])
            if seen >= cluster_tokens:
                break
    return [balanced_kmeans(torch.cat(kept).T, experts, seed=seed + layer)
            for layer, kept in enumerate(tqdm(scores, desc="moefy: balanced k-means",
                                              unit="layer", mininterval=1.0,
                                              dynamic_ncols=True))]


@torch.no_grad()
def routing_quality(model: nn.Module, routers: Routers, groups: list[torch.Tensor],
                    batches: list[torch.Tensor], top_k: int, seed: int = 0) -> dict[str, float]:
    """Mean over layers of the share of expert mass kept by the top-k of: the trained
    routers, a random Gaussian router, and the best possible choice (the top-k by mass)."""
    gen = torch.Generator().manual_seed(seed)
    shares: dict[str, list[float]] = {"trained": [], "random": [], "oracle": []}
    with capture(model) as found:
        for ids in batches:
            model(input_ids=ids)
            logits = routers([slot["x"] for slot in found])
            for z, slot, group in zip(logits, found, groups, strict=True):
                mass = expert_mass(slot["score"], group)
                noise = torch.randn(z.shape, generator=gen)
                shares["trained"].append(selected_mass(z, mass, top_k))
                shares["random"].append(selected_mass(noise, mass, top_k))
                shares["oracle"].append(selected_mass(mass, mass, top_k))
    return {name: round(sum(v) / len(v), 4) for name, v in shares.items()}


def expert_mass(score: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """tokens x E: each expert's mass (summed neuron scores); `groups` is E x I/E neuron
    indexes."""
    return score[:, groups].sum(-1)


def balanced_kmeans(features: torch.Tensor, experts: int, iterations: int = 20,
                    seed: int = 0) -> torch.Tensor:
    """E x I/E neuron indexes: `features` (I x D, one row per neuron) clustered by cosine
    similarity into `experts` groups of exactly I/E rows. Each round assigns neurons in order
    of their best similarity to the best centroid that still has room, then moves each
    centroid to its members' mean."""
    count = features.shape[0]
    if count % experts:
        raise ValueError(f"{experts} experts do not divide the feed-forward width {count}")
    size = count // experts
    rows = nn.functional.normalize(features.float(), dim=1)
    gen = torch.Generator().manual_seed(seed)
    centroids = rows[torch.randperm(count, generator=gen)[:experts]].clone()
    assign = torch.arange(count) // size
    for _ in range(iterations):
        sims = rows @ centroids.T  # I x E
        order = torch.argsort(sims.max(1).values, descending=True).tolist()
        ranked = torch.argsort(sims, dim=1, descending=True).tolist()
        room = [size] * experts
        new = [0] * count
        for neuron in order:
            expert = next(e for e in ranked[neuron] if room[e])
            room[expert] -= 1
            new[neuron] = expert
        new_assign = torch.tensor(new)
        for e in range(experts):
            centroids[e] = nn.functional.normalize(rows[new_assign == e].mean(0), dim=0)
        if torch.equal(new_assign, assign):
            break
        assign = new_assign
    return torch.stack([torch.nonzero(assign == e).flatten() for e in range(experts)])


def contiguous_groups(width: int, experts: int) -> torch.Tensor:
    """E x I/E: neurons 0..I/E-1 to expert 0, and so on."""
    if width % experts:
        raise ValueError(f"{experts} experts do not divide the feed-forward width {width}")
    return torch.arange(width).view(experts, width // experts)


def top_k_target(mass: torch.Tensor, top_k: int) -> torch.Tensor:
    """tokens x E: 1/k on each token's k experts of largest mass, 0 elsewhere."""
    target = torch.zeros_like(mass)
    return target.scatter_(1, mass.topk(top_k, dim=1).indices, 1.0 / top_k)


def router_loss(logits: torch.Tensor, mass: torch.Tensor, top_k: int) -> torch.Tensor:
    """Cross-entropy of the router's softmax against the top-k mass experts (a soft target
    of 1/k each): it ranks those experts above the others; the logits' scale is free."""
    target = top_k_target(mass, top_k)
    return -(target * torch.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def selected_mass(logits: torch.Tensor, mass: torch.Tensor, top_k: int) -> float:
    """Share of all experts' mass that the router's top-k experts hold, over the tokens."""
    chosen = mass.gather(1, logits.topk(top_k, dim=1).indices)
    return float(chosen.sum() / mass.sum().clamp_min(1e-12))


class Routers(nn.Module):
    """One bias-free Linear H -> E per decoder layer (Mixtral's router shape), trained
    together; near zero at the start (every expert about equally likely; not exactly zero,
    which the training loop would take for pruned weights and hold)."""

    def __init__(self, layers: int, hidden: int, experts: int, seed: int = 0):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(hidden, experts, bias=False)
                                     for _ in range(layers))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for linear in self.linears:
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 1e-3)

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [linear(x.float()) for linear, x in zip(self.linears, xs, strict=True)]


def make_router_loss_fn(dense: nn.Module, groups: list[torch.Tensor], top_k: int):
    """A `loss_fn(routers, ids, _)` for the shared loop: the frozen dense model runs the
    block, and each layer's router learns its feed-forward input's top-k mass experts."""
    dense.eval()

    def loss_fn(routers: nn.Module, ids: torch.Tensor, _: object) -> torch.Tensor:
        with torch.no_grad(), capture(dense) as found:
            dense(input_ids=ids)
        logits = routers([slot["x"] for slot in found])
        losses = [router_loss(z, expert_mass(slot["score"], g), top_k)
                  for z, slot, g in zip(logits, found, groups, strict=True)]
        return torch.stack(losses).mean()

    return loss_fn
