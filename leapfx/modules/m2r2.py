"""M2R2's accelerated residual stream: the modules that ``InsertAccelerator`` inserts.

M2R2 (sec. 2.2, eq. 1, 2, 4) runs a second, "fast" residual stream p through the same layer
indices as the model's own ("slow") stream h. Gates ``0 = E_0 < E_1 < ... < E_J`` cut the
layers into intervals; in interval j the fast stream starts from the slow state (the reset,
``p^{E_j} = h^{E_j}``) and each of its layers moves it ``R_j = (N - E_j) / (E_{j+1} - E_j)``
slow layers ahead, so that at the gate ``p^{E_{j+1}} ~ h^N``. There is no fast stream after
``E_J``. One accelerated layer i computes (eq. 2)::

    a   = gate_i * A_i(p)              A_i: layer i's own attention, sliced to a few heads
    p'  = p + a + M_i(p + a)           M_i: a rank-r MLP in place of the layer's own

- ``A_i`` reads the slow stream's keys/values of layer i for positions < t plus ONE key/value
  computed from the fast state at t (the shared KV cache of sec. 2.2): the fast query never sees
  the slow state of its own position, and the fast stream writes nothing into the shared cache.
  Its q/k/v/o are the host's projections restricted to the chosen query heads (default: one per
  KV group under grouped-query attention, else 8; sec. 2.5) and the KV heads they read, frozen,
  with trainable rank-r LoRA on q and o. The host's norms, q/k norms and rotary are used as is.
- ``M_i(x) = W_up SiLU(W_down norm(x))`` with the host's post-attention norm (frozen), rank r
  (default 8: Fig. 10a's plateau). ``W_up`` and the attention gate (a per-channel vector) start
  at zero, so an untrained accelerator leaves the fast stream equal to its reset state: the
  branch starts as the identity and only adds what training puts there.

Queries at positions ``t_0..t_0+S-1`` are computed in parallel through one attention over
``[slow | fast]`` keys: slow column s is visible to fast row t iff s < t, fast column u iff u = t.
In a graph that runs the slow layers (``full``, training) the fast node of layer i runs right
after slow layer i has written its keys, so this mask is exactly eq. 2's attention. The drafting
stage (``leapfx.runtime.m2r2``) runs the fast layers alone, one token at a time, with a
``FastScratch`` (``m2r2_scratch.py``) holding the fast keys/values of the round's earlier
drafts: they stand in for the slow keys of positions the slow stream has not verified yet and
are discarded after verification. With ``fast_keys`` k a draft reads only k slow keys per layer
and KV head (sec. 2.5), ranked by the round's first draft (``AcceleratedLayer._top_keys`` says
why not the slow stream's own attention).

The modules live in an :class:`Accelerator` the rewritten GraphModule owns
(``gm.m2r2_accelerator``, ``leapfx.passes.accelerator`` inserts it); its state dict holds only the
trainable parts, the host's weights stay shared by reference. The scratch records a round or a
training chain carries (``FastScratch``, ``FastState``, ``ChainScratch``) are
``leapfx.modules.m2r2_scratch``'s; ``leapfx.modules.m2r2_kernels`` holds the kernel versions
(``KernelAcceleratedLayer``: a decoding copy of a layer on the ``leapfx_cpu`` kernels; whole
stages as one op).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from .m2r2_scratch import ChainScratch, FastScratch, FastState


def default_heads(num_heads: int, num_kv_heads: int) -> int:
    """One query head per KV group under grouped-query attention, else 8 (sec. 2.5)."""
    return num_kv_heads if num_kv_heads < num_heads else min(8, num_heads)


def rates(gates: tuple[int, ...], num_layers: int) -> list[float]:
    """R_j = (N - E_j) / (E_{j+1} - E_j) for every interval j (E_0 = 0)."""
    edges = (0, *gates)
    return [(num_layers - a) / (b - a) for a, b in zip(edges, edges[1:], strict=False)]


def target_layers(gates: tuple[int, ...], num_layers: int) -> dict[int, int]:
    """Fast layer i -> the slow layer index its output should match (eq. 5's MSE target):
    ``(i + 1 - E_j) R_j + E_j``, rounded and clipped to N."""
    out = {}
    edges = (0, *gates)
    spans = zip(edges, edges[1:], strict=False)
    for (a, b), r in zip(spans, rates(gates, num_layers), strict=True):
        for i in range(a, b):
            out[i] = min(num_layers, round((i + 1 - a) * r + a))
    return out


def _head_index(heads: list[int], total: int) -> slice | torch.Tensor:
    """A view (slice) where ``heads`` are evenly strided, else an index tensor (a copy)."""
    if heads == list(range(total)):
        return slice(None)
    step = heads[1] - heads[0] if len(heads) > 1 else 1
    if step > 0 and heads == list(range(heads[0], heads[0] + step * len(heads), step)):
        return slice(heads[0], heads[0] + step * len(heads), step)
    return torch.tensor(heads)


class AcceleratedLayer(nn.Module):
    """The fast stream through decoder layer ``index`` (eq. 2): sliced attention + rank-r MLP.

    Parameters (all trainable, all that ``state_dict`` holds): LoRA on q (``q_a``, ``q_b``) and o
    (``o_a``, ``o_b``), the attention gate, the rank-r MLP's ``down`` and ``up``. The host layer is
    held without registering it, and its sliced projections are non-persistent buffers.
    """

    def __init__(
        self,
        layer: nn.Module,
        *,
        index: int,
        heads: int,
        rank: int,
        window: int | None,
        fast_keys: int | None = None,
    ) -> None:
        super().__init__()
        attn = layer.self_attn
        config = attn.config
        object.__setattr__(self, "host", layer)  # shared, frozen, not a submodule
        self.index = index
        self.cache_layer = attn.layer_idx
        self.window = window
        self.fast_keys = fast_keys
        self.scaling = attn.scaling
        # The attention's module, not the layer's: an MoE layer in a captured graph is a plain
        # container of its submodules (see capture.layer_module).
        self._rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        nh = config.num_attention_heads
        nkv = getattr(config, "num_key_value_heads", None) or nh
        d = attn.head_dim
        hidden = config.hidden_size
        q_heads = [(i * nh) // heads for i in range(heads)]
        group = nh // nkv
        kv_of_q = [q // group for q in q_heads]
        kv_heads = sorted(set(kv_of_q))
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, d
        self.kv_index = _head_index(kv_heads, nkv)  # the cache's heads this layer reads
        per_query = [kv_heads.index(g) for g in kv_of_q]
        self.expand = None if per_query == list(range(len(kv_heads))) else per_query
        # Query heads in equal consecutive groups per KV head: SDPA reads the KV heads in place
        # (enable_gqa) instead of a per-query copy of the cache.
        per = heads // len(kv_heads)
        self.gqa = per > 1 and per_query == [i // per for i in range(heads)]
        if self.gqa:
            self.expand = None
        # query head -> its KV head among kv_heads: pools a group's attention (top-k keys)
        self.register_buffer("q_to_kv", torch.tensor(per_query), persistent=False)
        w_q, b_q, w_k, b_k, w_v, b_v = _qkv_weights(attn, nh, nkv, d)

        def rows(w, b, sel):
            idx = torch.tensor([h * d + j for h in sel for j in range(d)])
            return w.detach()[idx].clone(), None if b is None else b.detach()[idx].clone()

        for name, (w, b) in {
            "q": rows(w_q, b_q, q_heads), "k": rows(w_k, b_k, kv_heads),
            "v": rows(w_v, b_v, kv_heads),
        }.items():  # fmt: skip
            self.register_buffer(f"w_{name}", w, persistent=False)
            self.register_buffer(f"b_{name}", b, persistent=False)
        cols = torch.tensor([h * d + j for h in q_heads for j in range(d)])
        o = attn.o_proj
        self.register_buffer("w_o", o.weight.detach()[:, cols].clone(), persistent=False)
        self.register_buffer(
            "b_o", None if o.bias is None else o.bias.detach().clone(), persistent=False
        )
        self._qk_norm = hasattr(attn, "q_norm")
        # OLMoE normalises q and k over the full projection width (all heads at once), before
        # the per-head reshape; the fast stream has only its heads' channels, so it normalises
        # those with their rows of the norm's weight (an approximation LoRA and the MLP
        # train around; exact for k when every KV head is kept).
        self._full_width = self._qk_norm and attn.q_norm.weight.numel() != d
        if self._full_width:
            q_cols = torch.tensor([h * d + j for h in q_heads for j in range(d)])
            k_cols = torch.tensor([h * d + j for h in kv_heads for j in range(d)])
            self.register_buffer("qn_w", attn.q_norm.weight.detach()[q_cols].clone(),
                                 persistent=False)  # fmt: skip
            self.register_buffer("kn_w", attn.k_norm.weight.detach()[k_cols].clone(),
                                 persistent=False)  # fmt: skip
            self._norm_eps = attn.q_norm.variance_epsilon
        self._clip = getattr(config, "clip_qkv", None)
        self._qkv_split = [heads * d, len(kv_heads) * d, len(kv_heads) * d]
        weight = o.weight
        kw = dict(dtype=weight.dtype, device=weight.device)
        qd = heads * d
        self.q_a = nn.Parameter(_kaiming(rank, hidden, **kw))
        self.q_b = nn.Parameter(torch.zeros(qd, rank, **kw))
        self.o_a = nn.Parameter(_kaiming(rank, qd, **kw))
        self.o_b = nn.Parameter(torch.zeros(hidden, rank, **kw))
        self.gate = nn.Parameter(torch.zeros(hidden, **kw))
        self.down = nn.Parameter(_kaiming(rank, hidden, **kw))
        self.up = nn.Parameter(torch.zeros(hidden, rank, **kw))

    def extra_repr(self) -> str:
        return f"layer={self.index}, q_heads={self.q_heads}, rank={self.down.shape[0]}"

    def forward(
        self,
        p: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        position_ids: torch.Tensor,
        cache,
        scratch: FastScratch | None = None,
        *,
        ahead: bool = False,
    ) -> torch.Tensor:
        # Training keeps LoRA and the gate apart, so that they get gradients; inference runs
        # the merged weights (4 products a layer instead of 8).
        training = torch.is_grad_enabled() and self.gate.requires_grad
        ops = _TrainingOps(self) if training else _MergedOps(self)
        return self.step(p, position_embeddings, position_ids, cache, scratch, ops, ahead=ahead)

    def _olmoe_qkv(self, qkv: torch.Tensor, rms) -> torch.Tensor:
        """OLMoE's order on the projections: full-width q/k norms (``rms``: the ops'), then
        ``clip_qkv``."""
        q, k, v = qkv.split(self._qkv_split, dim=-1)
        if self._full_width:
            q, k = rms(q, self.qn_w, self._norm_eps), rms(k, self.kn_w, self._norm_eps)
        if self._clip is not None:
            q, k, v = (t.clamp(-self._clip, self._clip) for t in (q, k, v))
        return torch.cat([q, k, v], dim=-1)

    def step(
        self, p, position_embeddings, position_ids, cache, scratch, ops, *, ahead: bool = False
    ) -> torch.Tensor:
        """Eq. 2 for one layer with ``ops`` doing the products and norms (the eager ones, or
        ``KernelAcceleratedLayer``'s): p [B, S, H] at positions position_ids [*, S] -> [B, S, H].

        ``ahead`` (one row per sequence, no scratch): the layer runs before slow layer i has
        written position t (the offload's m2r2 prefetch runs the whole stream up front), so
        every cached slow key is one of positions < t; by default a one-row call runs after it
        and skips the cache's last key (its own position's)."""
        x = ops.norm_in(p)
        B, S, _ = x.shape
        qkv = ops.qkv(x)  # [B, S, (h_q + 2 h_kv) D]
        if self._full_width or self._clip is not None:
            qkv = self._olmoe_qkv(qkv, ops.rms)
        qkv = qkv.reshape(B, S, -1, self.head_dim)  # [B, S, h_q + 2 h_kv, D]
        nq, nk = self._qkv_split[0] // self.head_dim, self._qkv_split[1] // self.head_dim
        v = qkv[:, :, nq + nk :].transpose(1, 2)  # [B, h_kv, S, D]
        cos, sin = position_embeddings
        if self._qk_norm or cos.shape[-1] != self.head_dim:  # q/k norms, partial rotary
            q, k = qkv[:, :, :nq], qkv[:, :, nq : nq + nk]
            if self._qk_norm and not self._full_width:  # per-head norms
                attn = self.host.self_attn
                q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
            q, k = ops.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, h, S, D]
        else:  # HF's rotary on q and k at once: half the operations of a draft's rotary
            qk = qkv[:, :, : nq + nk]
            qk = qk * cos.unsqueeze(2) + _rotate_half(qk) * sin.unsqueeze(2)
            q, k = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2)
        if isinstance(scratch, FastState):  # a traced draft: the scratch as tensors
            keys, values, mask = self._traced_draft(q, k, v, position_ids, scratch)
            return self._attend(p, q, keys, values, mask, ops)
        # Slow keys/values of layer i, read in place (the fast stream writes no cache).
        n = cache.lengths[self.cache_layer]
        slow_k = cache.keys[self.cache_layer][:, self.kv_index, :n]  # [B?, h_kv, n, D]
        slow_v = cache.values[self.cache_layer][:, self.kv_index, :n]
        if slow_k.shape[0] != B:
            slow_k, slow_v = slow_k.expand(B, -1, -1, -1), slow_v.expand(B, -1, -1, -1)
        assert not ahead or (scratch is None and S == 1), "ahead: one row, no scratch"
        if scratch is None and S == 1 and (ahead or self.window is None):
            # One row (a decode step: the offload's m2r2 prefetch): beside the slow layers, the
            # slow layer has written its key at t = n - 1, so "slow columns < t" are the first
            # n - 1; ahead of them, all n. No mask but a sliding window's.
            seen = n if ahead else n - 1
            keys = torch.cat([slow_k[:, :, :seen], k], dim=2)
            values = torch.cat([slow_v[:, :, :seen], v], dim=2)
            mask = None
            if self.window is not None and seen + 1 > self.window:  # t - w < s <= t
                mask = (torch.arange(seen + 1, device=q.device) > seen - self.window)[None]
        elif scratch is None or isinstance(scratch, ChainScratch):
            # Parallel rows (full graph, training): the slow layer has written every row's key;
            # row t sees slow columns < t and its own fast column only; at step j of a training
            # chain, slow columns < t - j and the earlier steps' fast columns (ChainScratch).
            earlier = [] if scratch is None else scratch.kv.setdefault(self.cache_layer, [])
            keys = torch.cat([slow_k, *(e[0] for e in earlier), k], dim=2)
            values = torch.cat([slow_v, *(e[1] for e in earlier), v], dim=2)
            mask = self._parallel_mask(position_ids, n, S, q.device, len(earlier))
            if scratch is not None:
                earlier.append((k, v))
        else:
            # Drafting, one row at t = n + len(earlier drafts): slow keys < n (verified), then
            # the round's earlier fast keys, then its own.
            if S != 1:
                raise ValueError(f"drafting runs one token at a time, got {S}")
            earlier = scratch.kv.setdefault(self.cache_layer, [])
            if self.fast_keys is not None:
                slow_k, slow_v = self._top_keys(q, slow_k, slow_v, scratch, len(earlier))
            keys = torch.cat([slow_k, *(e[0] for e in earlier), k], dim=2)
            values = torch.cat([slow_v, *(e[1] for e in earlier), v], dim=2)
            earlier.append((k, v))
            mask = None
            length = keys.shape[2]
            if self.window is not None and length > self.window and self.fast_keys is None:
                mask = (torch.arange(length, device=q.device) >= length - self.window)[None]
        return self._attend(p, q, keys, values, mask, ops)

    def _attend(self, p, q, keys, values, mask, ops) -> torch.Tensor:
        """The fast attention of q [B, h_q, S, D] over ``keys``/``values`` [B, h_kv, L, D]
        under ``mask``, its output projection and the rank-r MLP: p [B, S, H] -> p'."""
        B, S = p.shape[0], p.shape[1]
        if self.expand is not None:
            keys, values = keys[:, self.expand], values[:, self.expand]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=self.gqa
        )
        p = p + ops.out(out.transpose(1, 2).reshape(B, S, -1))  # [B, S, h*D] -> [B, S, H]
        return p + ops.low_rank_mlp(p)

    def _traced_draft(self, q, k, v, position_ids, state: FastState):
        """Drafting's keys, values and mask with the scratch as tensors (:class:`FastState`):
        the drafting branch of :meth:`step` over whole buffers, with no length read on the
        host. One row at t, the round's draft m + 1: slow slots < t - m (verified before the
        round), the round's m earlier fast keys, its own; under a sliding window only
        positions > t - window. Masked slots weigh exactly zero, so this is the eager draft up
        to summation order."""
        if q.shape[2] != 1:
            raise ValueError(f"drafting runs one token at a time, got {q.shape[2]}")
        slow_k, slow_v = state.slow[self.cache_layer]  # [B, H_kv, L, D]
        slow_k, slow_v = slow_k[:, self.kv_index], slow_v[:, self.kv_index]  # [B, h_kv, L, D]
        past_k, past_v = state.past[self.cache_layer]  # [B, h_kv, m, D]
        fast_k = torch.cat([past_k, k.to(past_k.dtype)], dim=2)  # [B, h_kv, m + 1, D]
        fast_v = torch.cat([past_v, v.to(past_v.dtype)], dim=2)
        state.present[self.cache_layer] = (fast_k, fast_v)
        m = past_k.shape[2]
        t = position_ids.reshape(q.shape[0], -1)[:, -1:]  # [B, 1]: the draft's position
        slots = torch.arange(slow_k.shape[2], device=q.device)[None]  # [1, L]
        slow = slots < t - m  # [B, L]
        fast = torch.ones(1, m + 1, dtype=torch.bool, device=q.device)  # [1, m + 1]
        if self.window is not None:  # positions t - m + j of the fast keys, slots s
            slow = slow & (slots > t - self.window)
            if self.fast_keys is None:  # (with fast_keys the eager draft windows no fast key)
                fast = fast & (torch.arange(m + 1, device=q.device)[None] > m - self.window)
        keys = torch.cat([slow_k, fast_k], dim=2)
        values = torch.cat([slow_v, fast_v], dim=2)
        if self.fast_keys is not None:  # [B, h_q, L]: per query head, the round's choice
            slow = self._traced_top_keys(q, slow_k, slots, t - m, slow, state)
            fast = fast[:, None].expand(slow.shape[0], slow.shape[1], -1)  # [B, h_q, m + 1]
            return keys, values, torch.cat([slow, fast], dim=-1)[:, :, None, :]
        mask = torch.cat([slow, fast.expand(slow.shape[0], -1)], dim=1)  # [B, L + m + 1]
        return keys, values, mask[:, None, None, :]

    def _traced_top_keys(self, q, slow_k, slots, start, visible, state: FastState):
        """:meth:`_top_keys` with the round's choice as a tensor (``state.top``, [B, h_kv, k]
        slots): the slow slots each query head reads, [B, h_q, L].

        The round's first draft (m = 0, an ONNX ``If`` on the scratch's length) ranks the slow
        keys visible to it by its attention pooled over each KV head's query heads and keeps
        the k best; later drafts take the choice they are given. With at most k visible at the
        first draft nothing is chosen: every draft reads the keys ``visible`` to it (the eager
        path's window sliding with the drafts)."""
        k = self.fast_keys
        m = state.past[self.cache_layer][0].shape[2]
        first = slots < start  # [B, L]: visible to the round's first draft (at t = start)
        if self.window is not None:
            first = first & (slots > start - self.window)
        every = first.sum(dim=-1, keepdim=True) <= k  # [B, 1]: nothing to choose

        def rank(q, slow_k, first, given):
            keys = slow_k[:, self.q_to_kv]  # [B, h_q, L, D]
            scores = (q @ keys.transpose(-1, -2)).float()[:, :, 0] * self.scaling  # [B, h_q, L]
            hidden = ~first[:, None]
            w = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
            w = w.masked_fill(hidden, 0.0)  # (no key visible: NaN rows, and every is true)
            group = F.one_hot(self.q_to_kv, slow_k.shape[1]).to(w.dtype)  # [h_q, h_kv]
            pooled = torch.einsum("bql,qk->bkl", w, group)  # [B, h_kv, L]
            pad = pooled.new_zeros(*pooled.shape[:2], k)  # k columns to choose from, always
            top = torch.cat([pooled, pad], dim=-1).topk(k, dim=-1).indices
            return top.sort(dim=-1).values

        def keep(q, slow_k, first, given):
            return given.clone()

        given = state.top[self.cache_layer]  # [B, h_kv, k]
        top = torch.cond(m == 0, rank, keep, (q, slow_k, first, given))
        state.top_present[self.cache_layer] = top
        # [B, h_kv, L]: the chosen slots (compared, not scattered: a ScatterElements here
        # would read as a cache write to the export's rewrites)
        chosen = (slots[:, None, :, None] == top[:, :, None, :]).any(dim=-1)
        every = every[:, None]  # (logical ops: onnxruntime's Where takes no booleans)
        slow = (every & visible[:, None]) | (~every & chosen)  # [B, h_kv, L]
        return slow[:, self.q_to_kv]  # [B, h_q, L]

    def _top_keys(self, q, slow_k, slow_v, scratch: FastScratch, drafted: int):
        """Sec. 2.5: the draft reads only ``fast_keys`` slow keys per KV head, those the round's
        first draft attends to most (softmax weights summed over the group's query heads).

        The paper ranks keys by the slow stream's attention, which the drafting stage does not
        have: its slow layers run in the verify pass (fused kernels that return no weights),
        and the slow state of the newest token is not computed until then. The first draft's
        fast query at that token (p^i ~ h^i, what eq. 4 trains for) stands in for the slow
        query: one read of every key a round, then g - 1 drafts over k keys. With at most
        ``fast_keys`` visible slow keys all are read. A sliding-window layer ranks the keys in
        its window at the first draft."""
        chosen = scratch.top.get(self.cache_layer)  # fixed for the round once chosen
        if chosen is None:
            n = slow_k.shape[2]
            lo = 0
            if self.window is not None:  # visible to this draft: s >= n + drafted + 1 - w
                lo = max(0, n + drafted + 1 - self.window)
            if n - lo <= self.fast_keys:
                return slow_k[:, :, lo:], slow_v[:, :, lo:]
            keys = slow_k[:, :, lo:][:, self.q_to_kv]  # [B, h_q, n - lo, D]
            w = torch.softmax((q @ keys.transpose(-1, -2)).float() * self.scaling, dim=-1)
            pooled = w.new_zeros(w.shape[0], slow_k.shape[1], w.shape[-1])  # [B, h_kv, n-lo]
            pooled.index_add_(1, self.q_to_kv, w[:, :, 0])
            top = pooled.topk(self.fast_keys, dim=-1).indices.sort(dim=-1).values + lo
            idx = top[..., None].expand(-1, -1, -1, slow_k.shape[-1])
            chosen = (top, slow_k.gather(2, idx), slow_v.gather(2, idx))
            scratch.top[self.cache_layer] = chosen
        return chosen[1], chosen[2]

    def _merged(self) -> tuple:
        """Inference weights with LoRA and the gate folded in: ``[q + B_q A_q | k | v]`` as one
        projection and ``diag(gate) (o + B_o A_o)`` (4 products a layer instead of 8). Cached
        until a parameter changes (in-place optimizer steps bump their versions)."""
        params = (self.q_a, self.q_b, self.o_a, self.o_b, self.gate)
        key = tuple(p._version for p in params) + tuple(id(p) for p in params)
        if getattr(self, "_merged_key", None) != key:
            with torch.no_grad():
                w_q = self.w_q + self.q_b @ self.q_a
                w_qkv = torch.cat([w_q, self.w_k, self.w_v])
                biases = (self.b_q, self.b_k, self.b_v)
                b_qkv = None
                if any(b is not None for b in biases):
                    rows = (self.w_q, self.w_k, self.w_v)
                    b_qkv = torch.cat([b if b is not None else w.new_zeros(w.shape[0])
                                       for b, w in zip(biases, rows, strict=True)])  # fmt: skip
                w_o = self.gate[:, None] * (self.w_o + self.o_b @ self.o_a)
                b_o = None if self.b_o is None else self.gate * self.b_o
            self._merged_weights = (w_qkv, b_qkv, w_o, b_o)
            self._merged_key = key
        return self._merged_weights

    def _parallel_mask(self, position_ids, n: int, S: int, device, step: int = 0) -> torch.Tensor:
        """[S, n + (step + 1) S]: row t (draft ``step`` of the round starting at t - step) sees
        slow columns < t - step, then for each chain step m <= step the fast column
        t - step + m (m = step: its own)."""
        q_pos = position_ids.reshape(-1, S)[0][:, None].to(device)  # [S, 1]
        k_pos = torch.arange(n, device=device)[None]  # [1, n]
        slow = k_pos < q_pos - step
        if self.window is not None:
            slow &= k_pos > q_pos - self.window  # its own position counts inside the window
        fast = [torch.eye(S, dtype=torch.bool, device=device).roll(m - step, dims=1).tril()
                for m in range(step + 1)]  # fmt: skip
        if self.window is not None and step >= self.window:  # columns out of the window
            fast = [f & (step - m < self.window) for m, f in enumerate(fast)]
        return torch.cat([slow, *fast], dim=1)


class _TrainingOps:
    """The products of one accelerated layer with LoRA and the gate apart (they train)."""

    def __init__(self, layer: AcceleratedLayer) -> None:
        self.m = layer
        self.rope = layer._rope  # HF's apply_rotary_pos_emb

    def rms(self, x, weight, eps):  # OLMoE's full-width q/k norms
        return _rms(x, weight, eps)

    def norm_in(self, p):
        return self.m.host.input_layernorm.forward(p)

    def qkv(self, x):
        m = self.m
        q = F.linear(x, m.w_q, m.b_q) + F.linear(F.linear(x, m.q_a), m.q_b)
        return torch.cat([q, F.linear(x, m.w_k, m.b_k), F.linear(x, m.w_v, m.b_v)], dim=-1)

    def out(self, o):
        m = self.m
        return m.gate * (F.linear(o, m.w_o, m.b_o) + F.linear(F.linear(o, m.o_a), m.o_b))

    def low_rank_mlp(self, p):  # M_i
        m = self.m
        h = m.host.post_attention_layernorm.forward(p)
        return F.linear(F.silu(F.linear(h, m.down)), m.up)


class _MergedOps(_TrainingOps):
    """Inference: LoRA and the gate folded into the sliced weights (``_merged``)."""

    def __init__(self, layer: AcceleratedLayer) -> None:
        super().__init__(layer)
        self.w = layer._merged()

    def qkv(self, x):
        return F.linear(x, self.w[0], self.w[1])

    def out(self, o):
        return F.linear(o, self.w[2], self.w[3])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half`` (every Llama-family model's): [-x2, x1] of the last dim's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim with ``weight`` (HF's: in float32, then cast)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _kaiming(rows: int, cols: int, **kw) -> torch.Tensor:
    w = torch.empty(rows, cols, **kw)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))  # nn.Linear's (and LoRA's) default
    return w


def _qkv_weights(attn: nn.Module, nh: int, nkv: int, d: int):
    if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, [q | k | v] rows
        w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
        cuts = [0, nh * d, nh * d + nkv * d, nh * d + 2 * nkv * d]
        slices = [
            (w[a:z], None if b is None else b[a:z]) for a, z in zip(cuts, cuts[1:], strict=False)
        ]
        return (*slices[0], *slices[1], *slices[2])
    return (
        attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
        attn.v_proj.weight, attn.v_proj.bias,
    )  # fmt: skip


class ARLARouter(nn.Module):
    """ARLA (sec. 2.3.1, Fig. 4): should the token exit at this gate?

    Attention across the accelerated states of the gate's interval (the reset state and every
    fast layer's output, each through the model's frozen final norm) in a ``latent``-dim space:
    the query from the gate's state, one head, then ``Linear(latent -> 1)`` and a sigmoid. A
    score >= the threshold exits."""

    def __init__(self, norm: nn.Module, hidden: int, latent: int = 64, **kw) -> None:
        super().__init__()
        object.__setattr__(self, "norm", norm)  # the host's final norm: shared, frozen
        self.q = nn.Linear(hidden, latent, **kw)
        self.k = nn.Linear(hidden, latent, **kw)
        self.v = nn.Linear(hidden, latent, **kw)
        self.out = nn.Linear(latent, 1, **kw)

    def forward(self, states: list[torch.Tensor]) -> torch.Tensor:
        # states: L x [B, S, H] (reset first, the gate's state last) -> score [B, S] in (0, 1)
        x = self.norm.forward(torch.stack(states, dim=-2))  # [B, S, L, H]
        q = self.q(x[..., -1:, :])  # [B, S, 1, d]
        a = F.scaled_dot_product_attention(q, self.k(x), self.v(x))  # [B, S, 1, d]
        return torch.sigmoid(self.out(a)).reshape(x.shape[:-2])

    def logit(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The pre-sigmoid score [B, S] (for BCE with logits in training)."""
        x = self.norm.forward(torch.stack(states, dim=-2))
        a = F.scaled_dot_product_attention(self.q(x[..., -1:, :]), self.k(x), self.v(x))
        return self.out(a).reshape(x.shape[:-2])


class Accelerator(nn.Module):
    """Every accelerated layer of a model (``layers["i"]``), the gates they serve, and an ARLA
    router per gate (``routers["E"]``) where the recipe exits early."""

    def __init__(
        self,
        layers: dict[int, AcceleratedLayer],
        *,
        gates: tuple[int, ...],
        num_layers: int,
        routers: dict[int, ARLARouter] | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})
        self.routers = nn.ModuleDict({str(g): r for g, r in (routers or {}).items()})
        self.gates = tuple(gates)
        self.num_layers = num_layers

    @property
    def intervals(self) -> list[tuple[int, int]]:
        edges = (0, *self.gates)
        return list(zip(edges, edges[1:], strict=False))

    @property
    def rates(self) -> list[float]:
        return rates(self.gates, self.num_layers)

    def stream(
        self, reset: torch.Tensor, start: int, end: int, rope, position_ids, cache, scratch=None
    ) -> torch.Tensor:
        """The fast stream from the reset state at E_j = start through layers start..end-1."""
        p = reset
        for i in range(start, end):
            p = self.layers[str(i)](p, rope, position_ids, cache, scratch)
        return p
