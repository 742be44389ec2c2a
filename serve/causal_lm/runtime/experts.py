"""The experts of a mixture-of-experts layer (part of the runtime package; imports torch,
`grouped.py` and `kernels.py` only).

transformers 5 keeps a layer's experts as ONE module (`MixtralExperts`, `Qwen2MoeExperts`,
`Qwen3MoeExperts`, `OlmoeExperts`) holding 3D parameters `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I], called as `experts(hidden_states, top_k_index, top_k_weights)`.
`GroupedExperts` stores them as `grouped.py`'s int8 or 4-bit codes per expert (groups of 32
inputs, a scale and an offset each) and computes only the experts the router picked: each
through `grouped_kernels.cpp`'s operator on that expert's records, so a token reads the
groups of its top-k experts and no others. The whole routed computation is one C++
operator (`compress_lm::routed_experts`, routed_experts.cpp: `routed_experts` below, to
float32 rounding, without a Python loop or a host sync per layer), which torch.compile (and so
`StaticDecoder.compile`, fullgraph) and AOTInductor call as one opaque kernel.

`is_experts`, `expert_count` and `keep_experts` work on both kinds of module (expert
parallelism keeps a rank's share of a layer's experts with them).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from .grouped import ACTIVATIONS as MODES
from .grouped import dequantize_groups, fit_groups, pack_nibbles, unpack_nibbles
from .kernels import GROUP, grouped_mm_available

ACTIVATIONS = {"silu": functional.silu, "gelu": functional.gelu, "relu": functional.relu}
# routed_experts.cpp's `act` and `activations` numbers: positions in these orders
ACT_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}
MODE_CODES = {mode: code for code, mode in enumerate(MODES)}
PROJECTIONS = ("gate_up", "down")  # GroupedExperts' records: gate_up [E, 2I, H], down [E, H, I]


def is_experts(module: nn.Module) -> bool:
    """Whether `module` is a layer's experts: a transformers experts module (3D `gate_up_proj`
    and `down_proj`) or a `GroupedExperts`."""
    if isinstance(module, GroupedExperts):
        return True
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3)


def expert_count(module: nn.Module) -> int:
    """How many experts an experts module holds."""
    if isinstance(module, GroupedExperts):
        return module.num_experts
    return int(module.gate_up_proj.shape[0])


def keep_experts(module: nn.Module, ids: list[int]) -> None:
    """Keep experts `ids` of an experts module in place, renumbered 0..len(ids)-1 in that
    order (the others' weights are dropped, so the module's bytes shrink with them)."""
    index = torch.tensor(ids, dtype=torch.long)
    if isinstance(module, GroupedExperts):
        module.keep(index)
        return
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        weight = getattr(module, name, None)
        if isinstance(weight, torch.Tensor):
            setattr(module, name, nn.Parameter(weight.detach()[index].clone(),
                                               requires_grad=weight.requires_grad))
    module.num_experts = len(ids)


def activation_name(module: nn.Module) -> str:
    """The hidden activation of a transformers experts module (its config's `hidden_act`)."""
    name = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if name not in ACTIVATIONS:
        raise ValueError(f"grouped experts: activation {name!r} is not one of "
                         f"{', '.join(ACTIVATIONS)}; keep this model's experts in float")
    return name


class GroupedExperts(nn.Module):
    """A layer's experts as `bits`-bit codes in groups of `group_size` inputs per expert:
    `{gate_up,down}_{qweight,scale,offset}` stacked over the experts as `GroupedLinear`
    stores one weight, and `*_packed` the kernel's layout per expert (not saved)."""

    freeze_weights = False  # read by StaticDecoder.compile (as GroupedLinear's)

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bits: int = 8,
                 act: str = "silu", group_size: int = GROUP):
        super().__init__()
        if hidden % group_size or intermediate % group_size:
            raise ValueError(f"grouped experts: group_size {group_size} does not divide the "
                             f"hidden size {hidden} and the expert size {intermediate}")
        if bits == 4 and group_size != GROUP:
            raise ValueError(f"int4_grouped: group_size must be {GROUP}, not {group_size}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.bits, self.group_size, self.act = bits, group_size, act
        dtype = torch.int8 if bits == 8 else torch.uint8
        for name, rows, cols in (("gate_up", 2 * intermediate, hidden),
                                 ("down", hidden, intermediate)):
            width = cols if bits == 8 else cols // 2
            self.register_buffer(f"{name}_qweight",
                                 torch.zeros(num_experts, rows, width, dtype=dtype))
            self.register_buffer(f"{name}_scale", torch.ones(num_experts, rows, cols // group_size))
            self.register_buffer(f"{name}_offset", torch.zeros(num_experts, rows,
                                                               cols // group_size))
            self.register_buffer(f"{name}_packed", None, persistent=False)
        self.half = {name: False for name in PROJECTIONS}
        self.activations = "float32"  # one of grouped.ACTIVATIONS (GroupedLinear.forward)

    @classmethod
    def from_experts(cls, experts: nn.Module, bits: int = 8, group_size: int = GROUP
                     ) -> GroupedExperts:
        """A transformers experts module's weights fitted onto per-group grids per expert
        (`grouped.fit_groups`)."""
        if getattr(experts, "has_bias", False) or not getattr(experts, "is_concatenated", True):
            raise ValueError("grouped experts: only experts without biases and with "
                             "concatenated gate/up weights can be grouped; keep them in float")
        gate_up, down = experts.gate_up_proj.detach().float(), experts.down_proj.detach().float()
        module = cls(gate_up.shape[0], gate_up.shape[2], down.shape[2], bits,
                     activation_name(experts), group_size)
        for name, weight in (("gate_up", gate_up), ("down", down)):
            count, rows, cols = weight.shape
            q, scale, offset = fit_groups(weight.reshape(count * rows, cols), group_size, bits)
            q = q if bits == 8 else pack_nibbles(q)
            getattr(module, f"{name}_qweight").copy_(q.view(count, rows, -1))
            getattr(module, f"{name}_scale").copy_(scale.view(count, rows, -1))
            getattr(module, f"{name}_offset").copy_(offset.view(count, rows, -1))
        module.pack()
        return module

    def pack(self) -> None:
        """Lay each expert's weights out for the kernel, where it is at hand (as
        `GroupedLinear.pack`: float16 scales and offsets where they all are float16 values)."""
        if self.group_size != GROUP or not grouped_mm_available():
            return
        for name in PROJECTIONS:
            q, scale, offset = (getattr(self, f"{name}_{part}")
                                for part in ("qweight", "scale", "offset"))
            half = all(torch.equal(t.half().float(), t) for t in (scale, offset))
            self.half[name] = half
            setattr(self, f"{name}_packed", torch.stack([
                torch.ops.compress_lm.grouped_pack(q[e], scale[e], offset[e], self.bits, half)
                for e in range(self.num_experts)]) if self.num_experts else None)

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super()._load_from_state_dict(*args, **kwargs)
        self.pack()

    def keep(self, index: torch.Tensor) -> None:
        """Keep the experts at `index` (in that order) and lay them out again."""
        for name in PROJECTIONS:
            for part in ("qweight", "scale", "offset"):
                key = f"{name}_{part}"
                setattr(self, key, getattr(self, key)[index].clone())
        self.num_experts = int(index.numel())
        self.pack()

    def dequantize(self, name: str, expert: int) -> torch.Tensor:
        """The float32 weight of one expert's projection `name` (gate_up or down)."""
        q = getattr(self, f"{name}_qweight")[expert]
        codes = q if self.bits == 8 else unpack_nibbles(q)
        return dequantize_groups(codes, getattr(self, f"{name}_scale")[expert],
                                 getattr(self, f"{name}_offset")[expert])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """sum over each token's top-k experts of weight * down(act(gate) * up), in float32,
        computing only the experts some token was routed to."""
        x = hidden_states.float()
        if self.gate_up_packed is not None:
            out = torch.ops.compress_lm.routed_experts(
                x, top_k_index, top_k_weights.float(), self.gate_up_packed, self.down_packed,
                self.intermediate, self.bits, self.half["gate_up"], self.half["down"],
                ACT_CODES[self.act], MODE_CODES[self.activations])
        else:
            out = routed_experts(x, top_k_index, top_k_weights.float(), self.num_experts,
                                 self.act, lambda e, h: functional.linear(
                                     h, self.dequantize("gate_up", e)),
                                 lambda e, h: functional.linear(h, self.dequantize("down", e)))
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, "
                f"intermediate={self.intermediate}, bits={self.bits}, act={self.act}")


def routed_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   num_experts: int, act: str, gate_up, down) -> torch.Tensor:  # noqa: ANN001
    """The experts' output for tokens `x` [T, H]: per expert some token picked, its rows
    through `gate_up(expert, rows)` and `down(expert, rows)`, weighted and summed back."""
    out = torch.zeros_like(x)
    for expert in torch.unique(top_k_index).tolist():
        if not 0 <= expert < num_experts:  # an expert another rank holds
            continue
        token, slot = torch.where(top_k_index == expert)
        gate, up = gate_up(expert, x[token]).chunk(2, dim=-1)
        rows = down(expert, ACTIVATIONS[act](gate) * up)
        out.index_add_(0, token, rows * top_k_weights[token, slot, None])
    return out


def quantize_experts(model: nn.Module, bits: int, fit: bool = True,
                     group_size: int = GROUP, activations: str = "float32") -> int:
    """Replace every experts module of `model` by a `GroupedExperts` in place; how many were
    replaced. `fit=False`: empty modules of the same shapes, their weights loaded next.
    `activations`: the kernels' mode, one of grouped.ACTIVATIONS."""
    if activations not in MODES:
        raise ValueError(f"grouped experts: activations {activations!r} is not one of "
                         f"{', '.join(MODES)}")
    chosen = [(name, module) for name, module in model.named_modules()
              if is_experts(module) and not isinstance(module, GroupedExperts)]
    for name, experts in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if fit:
            module = GroupedExperts.from_experts(experts, bits, group_size)
        else:
            count, rows, hidden = experts.gate_up_proj.shape
            module = GroupedExperts(count, hidden, rows // 2, bits, activation_name(experts),
                                    group_size)
        module.activations = activations
        setattr(parent, child, module)
    route_per_token(model)
    return len(chosen)


# transformers 5's top-k routers, all one computation (Mixtral's normalizes its top-k always)
ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter")


def route(router: nn.Module, hidden_states: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A transformers top-k router's forward (`ROUTERS`), its logits summed per token: each
    token's products with the router's weight added over the hidden size by one reduction,
    so a token routes to the same experts with the same weights, bit for bit, alone and in
    any batch (`F.linear`'s BLAS sums one row otherwise than several). (router logits,
    top-k weights, top-k experts), as the router returns them."""
    hidden = hidden_states.reshape(-1, router.hidden_dim)
    logits = (hidden[:, None, :] * router.weight).sum(-1)
    probs = functional.softmax(logits, dtype=torch.float, dim=-1)
    top, index = torch.topk(probs, router.top_k, dim=-1)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def route_per_token(model: nn.Module) -> int:
    """Every transformers top-k router of `model` (`ROUTERS`) routes through `route` from
    now on (their weights stay as they are: float); how many. Part of batch invariance
    (docs/causal-lm.md), done with the experts' quantization."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTERS
               and m.forward.__func__ is not route]
    for router in routers:
        router.forward = route.__get__(router)
    return len(routers)
