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
  layer (what an LRU cache of recent experts benefits from);
- ``cache``: for ``slots`` experts resident per layer (fractions of its experts, rounded up like
  ``OffloadOptions.slots``), the hit rate of on-demand loading into an LRU cache (what
  ``OffloadOptions(policy="lru", prefetch="none")`` gets, the tokens in order) and under the
  optimal eviction (Belady's: evict the expert used again last, knowing the whole future). A
  prefetcher only moves loads earlier; how many loads a token costs is the eviction's doing,
  and the optimal rate bounds every policy that loads only demanded experts.

>>> stats = routing_stats(moe_model, [ids])   # ids: [1, S] token ids
>>> stats["layers"]["3"]["next_gate"]["1"]["precision"]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..passes.capture import decoder_pieces, is_moe_layer


def moe_layers(model) -> list[int]:
    pieces = decoder_pieces(model)
    moe = [i for i, layer in enumerate(pieces.layers) if is_moe_layer(layer)]
    if not moe:
        raise ValueError("model: has no MoE layers; allowed: an MoE model (olmoe, mixtral, ...)")
    return moe


def route_hidden(model, target: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``target``'s norm and router on ``hidden`` [T, H]: (probs [T, E], top-k [T, k])."""
    layer = decoder_pieces(model).layers[target]
    x = layer.post_attention_layernorm(hidden)
    probs = torch.softmax(F.linear(x, layer.mlp.gate.weight).float(), dim=-1)
    return probs, probs.topk(layer.mlp.gate.top_k, dim=-1).indices


@torch.no_grad()
def routing_stats(
    model,
    batches: list[torch.Tensor],
    distances: tuple[int, ...] = (1, 2),
    slots: tuple[float, ...] = (0.5, 0.25),
) -> dict:
    """Per-MoE-layer routing entropy, load, token-to-token reuse, next-gate predictability and
    expert-cache hit rates (LRU and optimal) at ``slots``."""
    moe = moe_layers(model)
    h = post_attention_residuals(model, moe, batches)

    def route(target: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_hidden(model, target, hidden)

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
            "cache": {},
        }
        for fraction in slots:
            count = max(1, math.ceil(fraction * e))
            lru, optimal = cache_hit_rates(top, count)
            entry["cache"][str(fraction)] = {"slots": count, "lru_hit_rate": lru,
                                             "optimal_hit_rate": optimal}  # fmt: skip
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


def cache_hit_rates(top: torch.Tensor, slots: int) -> tuple[float, float]:
    """Hit rates of one layer's expert cache of ``slots`` experts, loading on demand only, for
    the routing ``top`` [T, k] in token order: (LRU, optimal). A token's experts are all
    resident while it computes (they are never each other's victims); the optimal eviction
    (Belady's) evicts the resident expert whose next use is latest (never: latest of all).
    NaN where ``slots`` is below the distinct experts of one token."""
    rows = _rows(top, slots)
    if rows is None:
        return float("nan"), float("nan")
    never = len(rows)
    next_use: list[dict[int, int]] = [{} for _ in rows]  # token t, expert -> its next use
    seen: dict[int, int] = {}
    for t in range(len(rows) - 1, -1, -1):
        for expert in rows[t]:
            next_use[t][expert] = seen.get(expert, never)
            seen[expert] = t
    lru = _replay(
        rows, slots, lambda t, e: t, lambda t, keys: min(keys, key=lambda k: (keys[k], k))
    )
    optimal = _replay(rows, slots, lambda t, e: next_use[t][e],
                      lambda t, keys: max(keys, key=keys.__getitem__))  # fmt: skip
    return lru, optimal


def scored_hit_rate(top: torch.Tensor, slots: int, scores: torch.Tensor) -> float:
    """The hit rate of the same cache evicting, at token t, the resident expert with the lowest
    ``scores[t]`` [T, E] (ties: the least recently used): an eviction order computed from what
    is known at token t, e.g. a predictor of the experts the next tokens will use."""
    rows = _rows(top, slots)
    if rows is None:
        return float("nan")
    table = scores.tolist()
    return _replay(rows, slots, lambda t, e: t,
                   lambda t, keys: min(keys, key=lambda k: (table[t][k], keys[k], k)))  # fmt: skip


def _rows(top: torch.Tensor, slots: int) -> list[list[int]] | None:
    rows = [sorted(set(r)) for r in top.tolist()]
    return rows if rows and max(len(r) for r in rows) <= slots else None


def _replay(rows: list[list[int]], slots: int, key, evict) -> float:
    """Demand-only caching of ``rows``: ``key(t, expert)`` is stored at each use, ``evict(t,
    {expert: key})`` picks the victim among the residents the token does not use."""
    resident: dict[int, int] = {}
    hits = total = 0
    for t, row in enumerate(rows):
        total += len(row)
        hits += sum(expert in resident for expert in row)
        for expert in row:
            if expert not in resident and len(resident) >= slots:
                others = {k: v for k, v in resident.items() if k not in row}
                del resident[evict(t, others)]
            resident[expert] = key(t, expert)
    return hits / total


def post_attention_residuals(model, moe: list[int], batches) -> dict[int, torch.Tensor]:
    """Each MoE layer's post-attention residual (its router's input, before the norm) [T, H]."""
    layers = decoder_pieces(model).layers
    residuals: dict[int, list[torch.Tensor]] = {i: [] for i in moe}
    hooks = []
    for i in moe:

        def grab(module, args, i=i):
            residuals[i].append(args[0].reshape(-1, args[0].shape[-1]))

        # post_attention_layernorm's input is the residual stream after the attention
        hooks.append(layers[i].post_attention_layernorm.register_forward_pre_hook(grab))
    try:
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {i: torch.cat(residuals[i]) for i in moe}


def _overlap(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Mean over tokens of |predicted & actual| / k (both [T, k]: precision = recall here)."""
    hits = (predicted[:, :, None] == actual[:, None, :]).any(-1).float()
    return hits.mean().item()
