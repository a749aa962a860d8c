"""MoE expert offload: the modules the ``offload-experts`` pass inserts, and what they call.

The pass (``leapfx.passes.offload``) rewrites the graph: each MoE layer's ``experts`` node calls an
``OffloadedExperts``, each prefetch node a ``NextGatePrefetch`` (or, for ``prefetch="m2r2"``,
the ``M2R2Prefetcher`` (below) that holds several). A pass only rewrites graphs, so
these modules are inserted *unbound*: they hold what the graph gives them (a layer index, a
norm and a router) but not the expert-offload runtime (slot pools, a slow tier on disk or in
host memory, reader threads), which ``leapfx.offload.build_offload`` builds once the
passes have run and binds to every ``OffloadModule`` of the graph (``rewrite.apply`` does both).
A module called before it is bound raises RuntimeError saying so.

What an offload runtime provides to them (``leapfx.offload.ExpertOffload``):
``run(layer, experts, hidden, top_k_index, top_k_weights)``, ``prefetch(layer, scores,
union=)``, ``candidates(scores)``, ``queue_prefetches(predictions, tokens=)``, ``top_k`` and
``kernels``.

Example::

    >>> gm = PassPipeline([OffloadExperts(prefetch="next_gate")])(capture(moe_model))
    >>> runtime = build_offload(gm, OffloadOptions(slots=0.5))  # binds the modules above
    >>> gm.leapfx_offload.experts_0.runtime is runtime
    True

M2R2Prefetcher: the ``m2r2`` prefetch policy's fast stream, run before the slow pass.

M2R2 (sec. 2.3.3) predicts the experts of MoE layers 2i+2 and 2i+3 from the rate-2 fast state
p^{i+1} ~ h^{2i+2}. Fast layer i of token t reads slow layer i's keys of positions < t only
(eq. 2), and all of those are in the cache before the slow pass of t starts: so a decode step
can run the whole fast stream first, from the token's embedding, and know every prediction at
once (m2r2.md sec. 5, the optional point). The loads are then started layer by layer:
layer L's once the MoE layer ``OffloadOptions.prefetch_lead`` (3) layers before it has placed
its own experts (``ExpertOffload.queue_prefetches``), so that they do not queue ahead of an
earlier layer's on-demand reads, as they did when all of a step's started before layer 0.
Per decode step (one row per sequence)::

    p = embedding                                         # p^0 = h^0 (the reset)
    for i in 0..F-1:                                      # F: up to the last layer predicting
        p = fast_i(p, ahead=True)                         # slow keys 0..n-1 (n = t) + its own
        for L in targets[i]:                              # 2i+2, 2i+3: MoE layers < N
            ids[L] = top_k(router_L(norm_L(p)))
    runtime.queue_prefetches([(L, ids[L]) for L = 2, 3, ...])  # loads start layer by layer

With the CPU kernels on (``SpeculativeModel.use_cpu_kernels``: ``ExpertOffload.kernels``), one
row, float32 and a model the op covers, all of it is one ``leapfx_cpu::m2r2_predict`` call
(``leapfx.kernels.cpu_m2r2``) and one ``.tolist()``: on the reference MoE model the torch stream
was ~100 small torch calls. Otherwise the fast layers (``AcceleratedLayer``, ``ahead=True``)
and a ``NextGatePrefetch`` per target, op by op: the same math, and the predictions equal up to
float32 summation order (a test holds the op's scores to 1e-5 and its experts to torch's). A
call of several positions (a prefill) predicts nothing: its rows' slow keys are not in the
cache before the slow pass writes them, and the first decode step predicts right after.

Example::

    >>> sm = rewrite.apply(moe_model, "autoregressive", cpu_kernels=True,
    ...                    offload=OffloadOptions(slots=0.25, prefetch="m2r2", m2r2_parts=dir))
    >>> sm.graph_module.leapfx_offload.m2r2_stream.targets      # for 12 layers
    [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_m2r2
from ..kernels.cpu_m2r2 import pack_predict
from ..options import check_int
from .kernel_layers import rms_params
from .m2r2 import AcceleratedLayer
from .m2r2_kernels import fused_op_layers, op_dims, pack_fast_layers, rope_table


class OffloadModule(nn.Module):
    """A module that calls into an expert-offload runtime bound after the pass that inserted it
    (``bind``; None until then)."""

    def __init__(self, runtime: Any = None) -> None:
        super().__init__()
        self._runtime = runtime

    @property
    def runtime(self) -> Any:
        runtime = self._runtime
        if runtime is None:
            raise RuntimeError(
                f"{type(self).__name__}: no expert-offload runtime is bound to it; build one "
                "with leapfx.offload.build_offload(graph_module, options) after the "
                "offload-experts pass (rewrite.apply(..., offload=OffloadOptions(...)) does)"
            )
        return runtime

    def bind(self, runtime: Any) -> None:
        """Call into ``runtime`` (an ``ExpertOffload``) from now on."""
        self._runtime = runtime


class OffloadedExperts(OffloadModule):
    """An ``experts`` node's module over an ExpertOffload (the HF module is kept for its code)."""

    def __init__(self, runtime: Any, layer: int, module: nn.Module) -> None:
        super().__init__(runtime)
        self.layer = layer
        # A plain attribute, not a submodule: the offloaded graph must not hold the experts.
        self.__dict__["experts"] = module

    def forward(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        return self.runtime.run(self.layer, self.experts, hidden, top_k_index, top_k_weights)


class NextGatePrefetch(OffloadModule):
    """Prefetch for MoE layer ``target``: its router applied to an earlier hidden state.

    ``target``'s post-attention norm and router turn ``hidden`` [B, S, H] into the routing
    ``target`` would pick if ``hidden`` were its input. Each policy feeds it another state:

    - ``next_gate``: the residual stream after the previous MoE layer's attention (a next-layer
      gate, as in Pre-gated MoE and mixtral-offloading's speculative loading, untrained);
    - ``m2r2``: the accelerated residual p^{i+1} ~ h^{2i+2} (M2R2 sec. 2.3.3, as
      ``leapfx.runtime.expert_prediction.predict_experts``), run before the slow pass by
      ``m2r2_stream.M2R2Prefetcher`` (which calls it where the fused op does not apply);
    - ``verify_union`` (``union=True``): a draft's exit state, for every layer the verify pass
      runs above the exit; the predictions of a round's drafts add up until the verify pass.
    """

    def __init__(
        self,
        runtime: Any,
        target: int,
        norm: nn.Module,
        router: nn.Module,
        *,
        union: bool = False,
    ):
        super().__init__(runtime)
        self.target = target
        self.norm = norm
        self.router = router
        self.union = union
        self._folded: tuple[tuple, torch.Tensor] | None = None  # (weights' versions, W * g)

    def _router_over_norm_weight(self) -> torch.Tensor | None:
        """The router's weight times the RMSNorm's (``W * g``), or None for another norm.

        RMSNorm scales a row by a positive number and then by ``g``: for one token the
        router's ranking of ``norm(h)`` is its ranking of ``g * h``, which needs neither the
        norm's reduction nor a softmax (on the reference MoE model at a quarter of the slots,
        next_gate went from 0.94x to 0.99x of on-demand loading, the same experts predicted)."""
        g = getattr(self.norm, "weight", None)
        w = self.router.weight
        if (
            not type(self.norm).__name__.endswith("RMSNorm")
            or "Gemma" in type(self.norm).__name__  # scales by 1 + g
            or g is None
            or g.shape != w.shape[-1:]
        ):
            return None
        key = (w._version, g._version, w.data_ptr(), g.data_ptr())
        if self._folded is None or self._folded[0] != key:
            with torch.no_grad():
                self._folded = (key, w * g.to(w.dtype))
        return self._folded[1]

    def forward(self, hidden: torch.Tensor) -> None:
        self.runtime.prefetch(self.target, self.scores(hidden), union=self.union)

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, E] scores of ``target``'s experts for ``hidden`` [B, S, H]: the router's
        probabilities, or for one token any scores with their ranking."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        folded = self._router_over_norm_weight() if flat.shape[0] == 1 else None
        if folded is not None:  # one token: scores with the ranking of the router's softmax
            return F.linear(flat.to(folded.dtype), folded)
        logits = F.linear(self.norm(hidden).reshape(flat.shape), self.router.weight)  # [T, E]
        return torch.softmax(logits.float(), dim=-1)


def predicted_layers(layer: int, num_layers: int) -> list[int]:
    """The layers whose experts are predicted while ``layer`` (i) runs: 2i+2 and 2i+3 (< N)."""
    check_int("layer", layer, 0, num_layers - 1)
    return [target for target in (2 * layer + 2, 2 * layer + 3) if target < num_layers]


class M2R2Prefetcher(OffloadModule):
    """``forward(embedding [B, S, H], rope, position_ids, cache) -> None``: the fast stream of
    ``layers`` (fast layers 0..F-1, held, not registered: the graph's ``m2r2_accelerator`` owns
    them) ahead of the slow pass, and a prefetch per ``predictors`` entry ``(i, predictor)``:
    the predictor's MoE layer from fast layer i's output, in order of the layer. ``runtime``:
    the ``ExpertOffload`` it prefetches into, or None until ``build_offload`` binds it (and
    its predictors)."""

    def __init__(
        self,
        runtime: Any,
        layers: list[AcceleratedLayer],
        predictors: list[tuple[int, NextGatePrefetch]],
        rotary: nn.Module,
    ) -> None:
        super().__init__(runtime)
        object.__setattr__(self, "layers", list(layers))
        object.__setattr__(self, "rotary", rotary)  # the host's: the op's rotary table
        self.sources = [i for i, _ in predictors]
        self.predictors = nn.ModuleList([p for _, p in predictors])
        self.targets = [p.target for p in self.predictors]
        self._by_source = [[p for i, p in predictors if i == j] for j in range(len(layers))]
        self._kernel: _KernelPredict | None | bool = False  # False: not yet looked at

    def extra_repr(self) -> str:
        return f"fast_layers={len(self.layers)}, targets={self.targets}"

    def forward(self, embedding: torch.Tensor, rope, position_ids, cache) -> None:
        if embedding.shape[1] != 1 or not self.layers:
            self.runtime.queue_prefetches([])  # a prefill: nothing predicted (see above)
            return
        kernel = self._kernel_for(embedding, cache)
        if kernel is not None:
            ids = kernel(embedding, position_ids, cache)
            # Host sync: the predictions decide which transfers start (once a step).
            self.runtime.queue_prefetches(list(zip(self.targets, ids.tolist(), strict=True)))
            return
        predictions = []
        p = embedding  # p^0 = h^0
        for layer, predictors in zip(self.layers, self._by_source, strict=True):
            p = layer(p, rope, position_ids, cache, ahead=True)  # [B, 1, H]
            for predictor in predictors:  # top-k (a host sync each)
                ranked = self.runtime.candidates(predictor.scores(p))
                predictions.append((predictor.target, ranked))
        self.runtime.queue_prefetches(predictions, tokens=embedding.shape[0])

    def _kernel_for(self, embedding: torch.Tensor, cache) -> _KernelPredict | None:
        """The op's caller where it runs this call (kernels on, one float32 row, a covered
        model), else None."""
        if not self.runtime.kernels:
            return None
        if self._kernel is False:
            self._kernel = _KernelPredict.build(self)
        keys = getattr(cache, "keys", None)
        if (
            self._kernel is None
            or embedding.dtype != torch.float32
            or embedding.shape[0] != 1
            or not isinstance(keys, list)
            or keys[self._kernel.cache_layers[0]].shape[0] != 1  # one sequence: the op reads row 0
            or (torch.is_grad_enabled() and self.layers[0].gate.requires_grad)
        ):
            return None
        return self._kernel


class _KernelPredict:
    """``leapfx_cpu::m2r2_predict`` over a prefetcher's layers and routers: ``(embedding,
    position_ids, cache) -> ids [targets, top_k]``. The weights are packed again whenever a
    trained part, a norm or a router changes (parameter versions, as ``_merged``)."""

    def __init__(self, owner: M2R2Prefetcher) -> None:
        self.owner = owner
        layers = owner.layers
        first = layers[0]
        self.cache_layers = [m.cache_layer for m in layers]
        self.inv_freq, self.rope_scale = rope_table(owner.rotary, first.head_dim)
        self.hidden = first.w_o.shape[0]
        self.qk = [0, 0]
        if first._full_width:  # OLMoE: each over the layer's kept q (k) channels at once
            self.qk = [len(first.q_heads) * first.head_dim, len(first.kv_heads) * first.head_dim]
        elif first._qk_norm:  # per head (Qwen3)
            self.qk = [first.head_dim, first.head_dim]
        clip = first._clip
        self.clip = math.inf if clip is None else float(clip)
        self.experts = owner.predictors[0].router.weight.shape[0]
        self.top_k = min(owner.runtime.top_k, self.experts)
        self._watched = [t for t in self._inputs() if isinstance(t, torch.Tensor)]
        self._key: tuple | None = None

    @classmethod
    def build(cls, owner: M2R2Prefetcher) -> _KernelPredict | None:
        """The caller where the op computes what the torch path does, else None (the op did
        not build, or the model has what it does not cover)."""
        if not owner.predictors or not _covered(owner) or not cpu_m2r2.available():
            return None
        return cls(owner)

    def _inputs(self) -> list:
        """What the packed weights are made of (their versions key the packing)."""
        out = []
        for m in self.owner.layers:
            host = m.host
            out += [m.q_a, m.q_b, m.o_a, m.o_b, m.gate, m.down, m.up,
                    host.input_layernorm.weight, host.post_attention_layernorm.weight]  # fmt: skip
            if m._qk_norm and not m._full_width:
                out += [host.self_attn.q_norm.weight, host.self_attn.k_norm.weight]
        for p in self.owner.predictors:
            out += [p.router.weight, p.norm.weight]
        return out

    def _pack(self) -> None:
        layers = self.owner.layers
        packed, eps, offsets = pack_fast_layers(layers, self.hidden)
        norms, qk_eps = [], []
        for m in layers:
            if m._full_width:
                norms += [m.qn_w, m.kn_w]
                qk_eps += [m._norm_eps, m._norm_eps]
            elif m._qk_norm:
                attn = m.host.self_attn
                for norm, heads in ((attn.q_norm, len(m.q_heads)), (attn.k_norm, len(m.kv_heads))):
                    w, e, off = rms_params(norm)
                    norms.append((w.detach() + off).repeat(heads))
                    qk_eps.append(e)
            else:
                qk_eps += [0.0, 0.0]
        eps.append(1e-6)  # the final norm's slot: unread
        offsets.append(0.0)
        routers = [p._router_over_norm_weight() for p in self.owner.predictors]
        with torch.no_grad():
            self.weights = pack_predict(packed, self.inv_freq, norms, routers)
        self.dims = op_dims(layers, self.hidden)
        self.params = [self.rope_scale, float(layers[0].scaling), *eps, *offsets]
        self.qk_params = [self.clip, *qk_eps]

    def predict(self, embedding, position_ids, cache) -> tuple[torch.Tensor, ...]:
        """The op's ``(ids [T, top_k], scores [T, E], states [F + 1, H])`` for this step."""
        key = tuple(t._version for t in self._watched)
        if key != self._key:
            self._pack()
            self._key = key
        keys, values = cache.keys, cache.values
        kv = [t for s in self.cache_layers for t in (keys[s], values[s])]
        lengths = [cache.lengths[s] for s in self.cache_layers]  # not yet written: all of < t
        return torch.ops.leapfx_cpu.m2r2_predict.default(
            embedding.contiguous(), position_ids.contiguous(), self.weights, self.dims,
            self.params, kv, lengths, self.qk, self.qk_params, self.owner.sources,
            self.experts, self.top_k,
        )  # fmt: skip

    def __call__(self, embedding, position_ids, cache) -> torch.Tensor:
        return self.predict(embedding, position_ids, cache)[0]


def _covered(owner: M2R2Prefetcher) -> bool:
    """Whether the op computes what the torch path does for ``owner``: plain float32 CPU fast
    layers alike in heads (q/k norms and clip_qkv included, no sliding window, no fast_keys),
    RMSNorms, HF's default rotary, routers that fold into their norms' weights, one expert
    count."""
    layers = owner.layers
    first = layers[0]
    same = ("q_heads", "kv_heads", "head_dim", "scaling", "_qk_norm", "_full_width", "_clip")
    if not fused_op_layers(layers, same):
        return False
    for m in layers:
        if m.window is not None or m.fast_keys is not None:
            return False
        if m._full_width and m._norm_eps != first._norm_eps:
            return False
        if m._qk_norm and not m._full_width:
            attn = m.host.self_attn
            if m._clip is not None:  # the op clamps after the norms; per-head: before
                return False
            if rms_params(attn.q_norm) is None or rms_params(attn.k_norm) is None:
                return False
    routers = [p._router_over_norm_weight() for p in owner.predictors]
    if any(r is None or r.dtype != torch.float32 for r in routers):
        return False
    if len({r.shape for r in routers}) != 1:
        return False
    return rope_table(owner.rotary, first.head_dim) is not None
