"""Ahead-of-time expert prediction from the accelerated residual (M2R2 sec. 2.3.3).

With a fast stream at twice the slow rate (R = 2: gate N/2, so the fast state after fast layer i,
``p^{i+1}``, approximates the slow state ``h^{2i+2}``), "the experts needed for layers 2i+2 and
2i+3 can be identified while still computing in layer i": apply layer L's own post-attention
norm and router to ``p^{i+1}`` and take its top-k (``num_experts_per_tok``), for
L in {2i+2, 2i+3}. Layers 0 and 1 are never predicted. The MoE offload runtime issues the loads
of these experts ahead of use (it runs the whole fast stream before a step's slow pass:
``leapfx.modules.moe``), then checks residency before layer L's experts run.

This module works on the HF MoE modules directly (Mixtral, OLMoE, Qwen2-MoE in transformers 5:
``layer.post_attention_layernorm`` and the router ``layer.mlp.gate``, which returns
``(logits, scores, top_k_indices)``), because ``capture`` does not support MoE architectures
yet: the caller supplies the fast states. Dense layers of a mixed model (no router) are skipped.

Example::

    >>> predicted = predict_experts(moe_model, fast_state, layer=3)   # while layer 3 runs
    >>> sorted(predicted)                                            # layers 8 and 9
    [8, 9]
    >>> predicted[8].shape                                           # [B, S, top_k]
"""

from __future__ import annotations

import torch
from torch import nn

# The rule's one home is the offload pass's fast stream (2i+2, 2i+3 below N).
from ..modules.moe import predicted_layers

__all__ = ["predict_experts", "predicted_layers", "router_of"]


def router_of(layer: nn.Module) -> nn.Module | None:
    """The top-k router of an HF MoE decoder layer (``mlp.gate``), or None for a dense layer."""
    gate = getattr(getattr(layer, "mlp", None), "gate", None)
    return gate if gate is not None and hasattr(gate, "top_k") else None


@torch.no_grad()
def predict_experts(
    model: nn.Module, fast_state: torch.Tensor, layer: int
) -> dict[int, torch.Tensor]:
    """Predicted top-k expert indices {L: [B, S, top_k]} of layers 2i+2 and 2i+3 (MoE ones only),
    from ``fast_state`` [B, S, H], the accelerated residual after fast layer i = ``layer``."""
    layers = model.model.layers
    if fast_state.dim() != 3 or fast_state.shape[-1] != model.config.hidden_size:
        raise ValueError(
            f"fast_state: shape {tuple(fast_state.shape)} is invalid; allowed: [B, S, "
            f"{model.config.hidden_size}]"
        )
    out: dict[int, torch.Tensor] = {}
    for target in predicted_layers(layer, len(layers)):
        router = router_of(layers[target])
        if router is None:
            continue
        x = layers[target].post_attention_layernorm(fast_state)
        _, _, indices = router(x)  # [B * S, top_k]
        out[target] = indices.reshape(*fast_state.shape[:-1], router.top_k)
    return out
