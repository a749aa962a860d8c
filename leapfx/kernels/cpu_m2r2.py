"""M2R2's ARLA exit gate as one C++ custom op for CPU decoding: ``leapfx_cpu::m2r2_gate``.

A gate of ``m2r2_exit`` (``passes.fast_partition.exit_stages``' ``gate_j``) runs for every
decoded token at every gate it reaches: the fast stream of one row through the interval's
accelerated layers, the ARLA router and the final norm + LM head. On the reference model that
is ~0.5M multiply-adds spread over ~90 torch dispatches, ~0.5 ms on a 2-core CPU: as much as
the four slow layers a token skips when it exits, which kept the exit from paying. The op does
the same arithmetic in one call (``cpu_m2r2.cpp`` says what, step by step);
``modules.m2r2_kernels.KernelGate`` puts it in the gate stages. ``m2r2``'s draft stage is the same
fast stream from a token's embedding, reading the round's earlier drafts' keys too:
``leapfx_cpu::m2r2_draft`` (``KernelDraft``). The expert-offload runtime's ``m2r2`` prefetch
runs it once more per decode step, from the embedding before any slow layer, and ranks the
experts of the MoE layers it predicts: ``leapfx_cpu::m2r2_predict``
(``modules.moe.M2R2Prefetcher``); it also covers q/k norms and ``clip_qkv``
(OLMoE), which the other two leave to the torch path.

=============================  ==================================================================
op                             signature
=============================  ==================================================================
``leapfx_cpu::m2r2_gate``      ``(hidden [1, 1, H], position_ids, weights (pack_gate), dims,
                               params, cache [keys, values per layer], lengths [per layer])
                               -> (score [1, 1], logits [1, 1, V])``
``leapfx_cpu::m2r2_draft``     ``(embedding [1, 1, H], position_ids, weights (pack_gate, no
                               router), dims, params, cache, lengths, earlier [L, 2, m, h_kv,
                               D]) -> (logits [1, 1, V], hidden [1, 1, H], kv [L, 2, h_kv,
                               D])``: a draft of ``m2r2`` (sec. 2.3.2), reading the round's
                               earlier drafts' fast keys after the slow ones, returning its own
``leapfx_cpu::m2r2_predict``   ``(embedding [1, 1, H], position_ids, weights (pack_predict),
                               dims (d = V = 0), params, cache, lengths [per layer], qk [gq,
                               gk], qk_params [clip, eps per layer], sources [T], experts,
                               top_k) -> (ids [T, top_k] int64, scores [T, E], states [L + 1,
                               H])``: the fast stream from p^0 = h^0 reading slow keys
                               ``< lengths`` (run before the slow pass writes t), then for
                               target j the top_k of ``(router * norm weight) p^{sources[j]+1}``
=============================  ==================================================================

float32 only, one row. The numbers equal the torch gate's up to summation order (tests hold
them to 1e-5). Every weight travels in one packed tensor (:func:`pack_gate`): a list of ~45
tensors costs the dispatcher ~5 us a call, a tenth of the op. Built like
:mod:`leapfx.kernels.cpu`'s kernels (its own extension, first use).
"""

from __future__ import annotations

import functools

import torch

from . import cpu


@functools.cache
def available() -> bool:
    """True once ``leapfx_cpu::m2r2_gate`` is built and registered (built on the first call)."""
    return cpu.load_ops("m2r2", "m2r2_gate", "using the torch gate", _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("leapfx_cpu::m2r2_gate")
    def _fake(hidden, position_ids, weights, dims, params, cache, lengths):
        return hidden.new_empty((1, 1)), hidden.new_empty((1, 1, dims[7]))

    @torch.library.register_fake("leapfx_cpu::m2r2_predict")
    def _fake_predict(hidden, position_ids, weights, dims, params, cache, lengths, qk,
                      qk_params, sources, experts, top_k):  # fmt: skip
        ids = hidden.new_empty((len(sources), top_k), dtype=torch.int64)
        scores = hidden.new_empty((len(sources), experts))
        return ids, scores, hidden.new_empty((dims[0] + 1, dims[1]))

    @torch.library.register_fake("leapfx_cpu::m2r2_draft")
    def _fake_draft(hidden, position_ids, weights, dims, params, cache, lengths, earlier):
        out = (hidden.new_empty((1, 1, dims[7])), hidden.new_empty((1, 1, dims[1])))
        return (*out, hidden.new_empty((dims[0], 2, dims[4], dims[2])))


def pack_gate(
    layers: list[list], router: list, head: tuple, inv_freq: torch.Tensor
) -> torch.Tensor:
    """The op's weights as one float32 tensor: per layer ``[w_qkv, b_qkv, w_o, b_o, down, up,
    ln_in, ln_post]``, then the router's ``[final norm, q_w, q_b, k_w, k_b, v_w, v_b, out_w,
    out_b]``, the head's ``[weight, bias]`` and the rotary's ``inv_freq``; an absent bias as
    zeros (adding 0 changes no value).

    >>> pack_gate([], [torch.ones(2)], (torch.ones(3, 2), None), torch.ones(1)).shape
    torch.Size([12])
    """
    w, b = head
    parts = [*(t for layer in layers for t in layer), *router, w,
             torch.zeros(w.shape[0]) if b is None else b, inv_freq]  # fmt: skip
    return torch.cat([t.detach().reshape(-1).float() for t in parts]).contiguous()


def pack_predict(
    layers: list[list], inv_freq: torch.Tensor, qk_norms: list[torch.Tensor],
    routers: list[torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """``leapfx_cpu::m2r2_predict``'s weights: :func:`pack_gate`'s layout for ``layers`` with
    no router and no head (the final norm's slot holds ones, unread), then ``qk_norms`` (per
    layer q's then k's weight, offsets folded in; empty: no q/k norms), then ``routers`` (each
    ``[E, H]``: a target's router weight times its norm weight).

    >>> pack_predict([], torch.ones(1), [], [torch.ones(3, 2)]).shape   # H = 2, E = 3
    torch.Size([9])
    """
    hidden = routers[0].shape[1]
    base = pack_gate(layers, [torch.ones(hidden)], (torch.zeros(0, hidden), None), inv_freq)
    rest = [t.detach().reshape(-1).float() for t in (*qk_norms, *routers)]
    return torch.cat([base, *rest]).contiguous()
