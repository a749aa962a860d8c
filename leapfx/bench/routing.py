"""Routing statistics in the bench: those of the model itself live in
:mod:`leapfx.models.routing` (re-exported here); what the M2R2 fast stream predicts is scored
here, since that needs a rewritten model."""

from __future__ import annotations

import torch

from ..models.routing import (  # noqa: F401
    _overlap,
    cache_hit_rates,
    moe_layers,
    post_attention_residuals,
    route_hidden,
    routing_stats,
    scored_hit_rate,
)
from ..rewrite import apply
from ..runtime.expert_prediction import predicted_layers
from ..train.m2r2 import fast_states, slow_pass


@torch.no_grad()
def fast_stream_precision(model, parts, batches: list[torch.Tensor]) -> dict[str, dict]:
    """What ``OffloadOptions(prefetch="m2r2", m2r2_parts=parts)`` predicts, scored offline:
    per predicted MoE layer L (2i+2 and 2i+3 from fast layer i), the overlap of L's norm and
    router on p^{i+1} with L's actual top-k, beside next-gate from the slow state at the same
    lead (layer i's post-attention residual) and at distance 1.

    >>> fast_stream_precision(moe_model, "assets/moe-reference/m2r2", [ids])["4"]["m2r2"]
    """

    moe = moe_layers(model)
    sm = apply(model, "m2r2", parts=str(parts))
    n = model.config.num_hidden_layers
    h = post_attention_residuals(model, moe, batches)
    fast: dict[int, list[torch.Tensor]] = {}
    for ids in batches:
        for i, p in fast_states(sm, slow_pass(sm, ids)).items():
            fast.setdefault(i, []).append(p.reshape(-1, p.shape[-1]))
    out: dict[str, dict] = {}
    for i, states in sorted(fast.items()):
        for target in (t for t in predicted_layers(i, n) if t in moe):
            actual = route_hidden(model, target, h[target])[1]
            entry = {
                "from_fast_layer": i,
                "m2r2": _overlap(route_hidden(model, target, torch.cat(states))[1], actual),
            }
            if i in h:  # next-gate at the same lead: layer i's slow state
                same = route_hidden(model, target, h[i])[1]
                entry["next_gate_same_lead"] = _overlap(same, actual)
            if target - 1 in h:
                entry["next_gate_distance_1"] = _overlap(
                    route_hidden(model, target, h[target - 1])[1], actual
                )
            out[str(target)] = entry
    return out
