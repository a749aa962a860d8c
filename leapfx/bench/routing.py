"""Routing statistics of an MoE model: what an expert cache and a prefetcher can count on.

``routing_stats(model, batches)`` runs the model's own layers on token batches and reports, per
MoE layer:

- ``entropy``: mean entropy (bits) of the router's full distribution per token, and
  ``load``: the share of top-k assignments each expert receives (uniform = 1/E each);
  ``load_max_over_mean`` summarises the imbalance;
- ``next_gate`` at distance d (1, 2): precision and recall of predicting layer l+d's top-k from
  layer l's post-attention residual through layer l+d's norm and router (what
  ``OffloadOptions(prefetch="next_gate")`` does at d = 1), against layer l+d's actual top-k;
- ``reuse``: the share of a token's top-k experts that the previous token also used in that
  layer (what an LRU cache of recent experts benefits from).

>>> stats = routing_stats(moe_model, [ids])   # ids: [1, S] token ids
>>> stats["layers"]["3"]["next_gate"]["1"]["precision"]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..passes.capture import decoder_parts, is_moe_layer


@torch.no_grad()
def routing_stats(model, batches: list[torch.Tensor], distances: tuple[int, ...] = (1, 2)) -> dict:
    """Per-MoE-layer routing entropy, load, token-to-token reuse and next-gate predictability."""
    parts = decoder_parts(model)
    moe = [i for i, layer in enumerate(parts.layers) if is_moe_layer(layer)]
    if not moe:
        raise ValueError("model: has no MoE layers; allowed: an MoE model (olmoe, mixtral, ...)")
    residuals: dict[int, list[torch.Tensor]] = {i: [] for i in moe}  # post-attention [T, H]
    hooks = []
    for i in moe:
        layer = parts.layers[i]

        def grab(module, args, i=i):
            residuals[i].append(args[0].reshape(-1, args[0].shape[-1]))

        # post_attention_layernorm's input is the residual stream after the attention
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(grab))
    try:
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    h = {i: torch.cat(residuals[i]) for i in moe}

    def route(target: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer = parts.layers[target]
        x = layer.post_attention_layernorm(hidden)
        probs = torch.softmax(F.linear(x, layer.mlp.gate.weight).float(), dim=-1)
        return probs, probs.topk(layer.mlp.gate.top_k, dim=-1).indices

    report: dict = {"layers": {}}
    actual = {i: route(i, h[i]) for i in moe}
    for n, i in enumerate(moe):
        probs, top = actual[i]
        e = probs.shape[-1]
        entropy = -(probs * probs.clamp_min(1e-12).log2()).sum(-1).mean().item()
        load = torch.bincount(top.flatten(), minlength=e).float()
        load = load / load.sum()
        reuse = _overlap(top[1:], top[:-1]) if len(top) > 1 else float("nan")
        entry = {
            "entropy_bits": entropy,
            "entropy_max_bits": math.log2(e),
            "load": [round(x, 4) for x in load.tolist()],
            "load_max_over_mean": (load.max() * e).item(),
            "reuse_previous_token": reuse,
            "next_gate": {},
        }
        for d in distances:
            if n + d >= len(moe):
                continue
            j = moe[n + d]
            _, predicted = route(j, h[i])
            precision = _overlap(predicted, actual[j][1])
            entry["next_gate"][str(d)] = {"target_layer": j, "precision": precision,
                                          "recall": precision}  # fmt: skip
        report["layers"][str(i)] = entry
    report["tokens"] = int(sum(b.numel() for b in batches))
    return report


def _overlap(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Mean over tokens of |predicted & actual| / k (both [T, k]: precision = recall here)."""
    hits = (predicted[:, :, None] == actual[:, None, :]).any(-1).float()
    return hits.mean().item()
