"""The modules the ``offload-experts`` pass inserts, and the runtime they call into.

The pass (``passes.offload``) rewrites the graph: each MoE layer's ``experts`` node calls an
``OffloadedExperts``, each prefetch node a ``NextGatePrefetch`` (or, for ``prefetch="m2r2"``,
the ``passes.m2r2_stream.M2R2Prefetcher`` that holds several). A pass only rewrites graphs, so
these modules are inserted *unbound*: they hold what the graph gives them (a layer index, a
norm and a router) but not the expert-offload runtime (slot pools, a slow tier on disk or in
host memory, reader threads), which ``leapfx.runtime.offload.build_offload`` builds once the
passes have run and binds to every ``OffloadModule`` of the graph (``rewrite.apply`` does both).
A module called before it is bound raises RuntimeError saying so.

What an offload runtime provides to them (``leapfx.runtime.offload.ExpertOffload``):
``run(layer, experts, hidden, top_k_index, top_k_weights)``, ``prefetch(layer, scores,
union=)``, ``candidates(scores)``, ``queue_prefetches(predictions, tokens=)``, ``top_k`` and
``kernels``.

Example::

    >>> gm = PassPipeline([OffloadExperts(prefetch="next_gate")])(capture(moe_model))
    >>> runtime = build_offload(gm, OffloadOptions(slots=0.5))  # binds the modules above
    >>> gm.leapfx_offload.experts_0.runtime is runtime
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
                "with leapfx.runtime.offload.build_offload(graph_module, options) after the "
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
