"""A moefied Llama as a standard transformers `MixtralForCausalLM`: the same attention,
RMSNorms, rotary embedding, head and (tied) embeddings, and each feed-forward layer as
Mixtral's sparse MoE block (`gate`: the router, E x H; `experts`: `gate_up_proj`
E x 2I/E x H and `down_proj` E x H x I/E).

The weighting. The dense layer's output is the plain sum of its experts' outputs, while
Mixtral multiplies each chosen expert by its router weight, renormalised so the k weights
sum to 1. So every expert's down_proj is multiplied by k, and the router's logits are scaled
down (`ROUTER_LOGIT_STD` over calibration tokens) so that the k renormalised weights are
1/k to within about 1%: each chosen expert then adds what it added in the dense model. The
scale changes no ranking, so the top-k choice is the trained router's. With all router
weights zero and top_k = E the MoE model is the dense model to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from compress.families.causal_lm.algorithms.moefy import swiglu_mlps

ROUTER_LOGIT_STD = 0.01  # the routers' logit spread over calibration tokens, after scaling
LLAMA_ONLY = ("attention_bias", "mlp_bias", "pretraining_tp")


def mixtral_config(dense_config, experts: int, top_k: int):
    """The dense Llama config as a MixtralConfig with E experts of I/E neurons, top-k."""
    from transformers import MixtralConfig

    fields = dense_config.to_dict()
    if fields.get("model_type") != "llama":
        raise ValueError(f"moefy converts a Llama-architecture model (SmolLM2, Llama); this "
                         f"one is {fields.get('model_type')!r}")
    if fields.get("attention_bias") or fields.get("mlp_bias"):
        raise ValueError("moefy: this Llama has attention or MLP biases, which Mixtral has "
                         "no place for")
    width = fields["intermediate_size"]
    if width % experts:
        raise ValueError(f"experts: {experts} does not divide the feed-forward width {width}")
    for name in (*LLAMA_ONLY, "model_type", "architectures", "transformers_version",
                 "_name_or_path", "quantization_config"):  # a GGUF's, already dequantized
        fields.pop(name, None)
    fields["head_dim"] = getattr(dense_config, "head_dim", None) or (
        dense_config.hidden_size // dense_config.num_attention_heads)
    fields.update(intermediate_size=width // experts, num_local_experts=experts,
                  num_experts_per_tok=top_k, sliding_window=None, router_jitter_noise=0.0,
                  output_router_logits=False, architectures=["MixtralForCausalLM"])
    return MixtralConfig(**fields)


def scaled_routers(weights: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each router weight (E x H) scaled so its logits over `inputs` (tokens x H, that
    layer's feed-forward inputs) have standard deviation ROUTER_LOGIT_STD."""
    out = []
    for weight, x in zip(weights, inputs, strict=True):
        spread = float((x.float() @ weight.float().T).std())
        out.append(weight.float() * (ROUTER_LOGIT_STD / spread if spread > 0 else 0.0))
    return out


@torch.no_grad()
def to_mixtral(dense: nn.Module, groups: list[torch.Tensor], top_k: int,
               routers: list[torch.Tensor] | None = None) -> nn.Module:
    """A MixtralForCausalLM computing `dense` with layer l's neurons split into the experts
    `groups[l]` (E x I/E indexes) and routed by `routers[l]` (E x H; None: zeros)."""
    from transformers import MixtralForCausalLM

    experts = groups[0].shape[0]
    config = mixtral_config(dense.config, experts, top_k)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    for index, (mlp, group) in enumerate(zip(swiglu_mlps(dense), groups, strict=True)):
        flat = group.flatten()
        if sorted(flat.tolist()) != list(range(mlp.down_proj.weight.shape[1])):
            raise ValueError(f"layer {index}: the experts do not cover every neuron once")
        gate, up = mlp.gate_proj.weight[group], mlp.up_proj.weight[group]  # E x I/E x H
        down = mlp.down_proj.weight[:, group].permute(1, 0, 2)  # E x H x I/E
        prefix = f"model.layers.{index}.mlp"
        state[f"{prefix}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        state[f"{prefix}.experts.down_proj"] = (down * top_k).contiguous()
        weight = routers[index] if routers is not None else torch.zeros(
            experts, config.hidden_size)
        state[f"{prefix}.gate.weight"] = weight.to(gate.dtype).contiguous()
    model = MixtralForCausalLM(config).to(next(dense.parameters()).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"moefy: weights that do not map onto Mixtral: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if getattr(dense, "generation_config", None) is not None:
        model.generation_config = dense.generation_config
    return model.eval()
