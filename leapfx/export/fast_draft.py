"""M2R2's draft stage as a pure function of tensors: its per-round scratch in and out.

The eager ``draft`` stage (``passes.fast_partition``) runs the fast stream on one token and
keeps the round's earlier drafts' fast keys/values in a ``FastScratch``, a Python object,
and reads the slow keys of the verified positions up to the cache's fill length, a host
integer. Neither crosses an ONNX boundary. :class:`FastDraftStage` wraps the stage so that
both are tensors (``modules.m2r2_scratch.FastState``):

- ``input_ids``, ``position_ids`` ``[batch, 1]``: the draft's token and position t;
- ``fast_past.{i}.key`` / ``.value`` ``[batch, h_kv, drafted, head_dim]`` for each fast layer's
  cache slot ``i``: the round's earlier drafts' fast keys/values (``drafted`` = 0 at the
  round's first draft); the scratch. With ``fast_keys`` k also ``fast_past.{i}.top``
  ``[batch, h_kv, k]`` int64: the slow slots the round reads, as its first draft chose them
  (that draft is fed zeros and chooses: an ONNX ``If`` on ``drafted``);
- ``past_key_values.{i}.key`` / ``.value``: the slow cache buffers of those slots, read only
  (the stage writes no cache slot: no ``present.{i}.*``);
- out: ``logits``, ``hidden`` (the fast state at the gate) and ``fast_present.{i}.key`` /
  ``.value`` ``[batch, h_kv, drafted + 1, head_dim]``: the scratch with this draft's key/value
  appended (and ``fast_present.{i}.top``, the round's choice), which the round's next draft
  takes as its ``fast_past``.

So the round's start is t - drafted, and the slow slots from there on (stale keys of rejected
drafts, or nothing yet) are masked in the graph: the caller passes tensors from call to call
and keeps no length. ``export_onnx`` exports such a stage with :func:`fast_draft_export`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn

from ..lower.stage_signature import (
    StageSignature,
    example_generator,
    fast_past_names,
    fast_present_names,
    kv_shapes,
)
from ..modules.m2r2 import AcceleratedLayer
from ..modules.m2r2_scratch import FastState

if TYPE_CHECKING:
    from ..runtime.model import SpeculativeModel

# Example sizes for tracing: >= 2 and distinct (torch.export specialises 0 and 1; the
# exported graph takes a zero-length scratch all the same).
_EXAMPLE = {"batch": 2, "drafted": 2, "past": 5, "max_cache_len": 16}


def takes_scratch(stage: fx.GraphModule) -> bool:
    """Whether ``stage`` is a fast-stream draft (it takes a ``scratch``)."""
    return any(n.op == "placeholder" and n.name == "scratch" for n in stage.graph.nodes)


def fast_layers(stage: fx.GraphModule) -> list[AcceleratedLayer]:
    """The fast layers ``stage`` runs, in order."""
    return [m for m in stage.modules() if isinstance(m, AcceleratedLayer)]


def _names(layers: list[AcceleratedLayer], out: bool = False) -> list[str]:
    """Each fast layer's scratch inputs (``out``: outputs): key, value[, top]."""
    names = fast_present_names if out else fast_past_names
    return [n for m in layers for n in names(m.cache_layer, m.fast_keys is not None)]


class FastDraftStage(nn.Module):
    """The draft ``stage`` with tensor-only inputs and outputs (see the module docstring):
    ``forward(input_ids, position_ids, *scratch, *slow_pasts)`` ->
    ``(logits, hidden, *scratch_out)``, each fast layer's key, value and (``fast_keys``) top;
    the slow pasts each slot's key then value."""

    def __init__(self, stage: fx.GraphModule) -> None:
        super().__init__()
        self.stage = stage
        self.layers = [(m.cache_layer, m.fast_keys is not None) for m in fast_layers(stage)]

    def forward(self, input_ids, position_ids, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = FastState(slow={}, past={})
        it = iter(flat)
        for slot, top in self.layers:
            state.past[slot] = (next(it), next(it))
            if top:
                state.top[slot] = next(it)
        for slot, _ in self.layers:
            state.slow[slot] = (next(it), next(it))
        out = self.stage(input_ids=input_ids, position_ids=position_ids, cache=None, scratch=state)
        scratch = []
        for slot, top in self.layers:
            scratch += [*state.present[slot], *([state.top_present[slot]] if top else [])]
        return out["logits"], out["hidden"], *scratch


def signature(stage: fx.GraphModule) -> StageSignature:
    """The draft stage's inputs and outputs: the scratch of each fast layer's slot in and out,
    that slot's slow buffers read and none written."""
    layers = fast_layers(stage)
    return StageSignature(
        tensor_inputs=["input_ids", "position_ids", *_names(layers)],
        outputs=["logits", "hidden", *_names(layers, out=True)],
        cache_layers=[m.cache_layer for m in layers],
        groups={},
        cache_writes=[],
    )


def scratch_spec(stage: fx.GraphModule, dtype: str) -> dict[str, Any]:
    """The manifest's description of the draft stage's scratch: its inputs and outputs in
    order, and what the round's first draft is fed (``first``: each input's shape after the
    batch axis and its dtype)."""
    layers = fast_layers(stage)
    first: dict[str, dict[str, Any]] = {}
    for m in layers:
        key, value, *top = fast_past_names(m.cache_layer, m.fast_keys is not None)
        for name in (key, value):
            first[name] = {"shape": [len(m.kv_heads), 0, m.head_dim], "dtype": dtype}
        for name in top:
            first[name] = {"shape": [len(m.kv_heads), m.fast_keys], "dtype": "int64"}
    return {
        "slots": [m.cache_layer for m in layers],
        "inputs": _names(layers),
        "outputs": _names(layers, out=True),
        "first": first,
        "rule": (
            "a round's first draft feeds each input as 'first' says (zeros; fast_past.{i}.key "
            "and .value of length 0); each later draft of the round feeds the outputs the "
            "draft before returned, in order (fast_present.{i}.* -> fast_past.{i}.*). A draft "
            "at position t with m drafts before it in the round reads the slow slots < t - m, "
            "so the cache must hold the verified positions below the round's first; nothing "
            "of the cache is written"
        ),
    }


def fast_draft_export(
    sm: SpeculativeModel, stage: fx.GraphModule
) -> tuple[FastDraftStage, tuple[torch.Tensor, ...], tuple[Any, ...], StageSignature]:
    """(module, example args, dynamic shapes, signature) for ``torch.onnx.export`` of the
    draft ``stage``."""
    module = FastDraftStage(stage)
    module.training = False  # the wrapper's own flag only: .eval() would reach the user's model
    layers = fast_layers(stage)
    for m in layers:
        m._merged()  # the merged weights cached from the real parameters, not traced
    sig = signature(stage)
    param = next(sm.hf_model.parameters())
    gen = example_generator()
    b, drafted, past = _EXAMPLE["batch"], _EXAMPLE["drafted"], _EXAMPLE["past"]
    length = _EXAMPLE["max_cache_len"]
    ids = torch.randint(0, sm.config.vocab_size, (b, 1), generator=gen).to(param.device)
    positions = torch.full((b, 1), past + drafted, device=param.device)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(param.device, param.dtype)

    batch = torch.export.Dim("batch")
    m_dim = torch.export.Dim("drafted", min=0)
    cache_len = torch.export.Dim("max_cache_len")
    args, shapes = [], []
    for m in layers:
        h, d = len(m.kv_heads), m.head_dim
        args += [randn(b, h, drafted, d), randn(b, h, drafted, d)]
        shapes += [{0: batch, 2: m_dim}] * 2
        if m.fast_keys is not None:  # the round's choice: k slots a KV head
            top = torch.randint(0, past, (b, h, m.fast_keys), generator=gen)
            args.append(top.to(param.device))
            shapes.append({0: batch})
    kv = kv_shapes(sm)
    for s in sig.cache_layers:
        args += [randn(b, kv[s][0], length, kv[s][1]) for _ in range(2)]
        shapes += [{0: batch, 2: cache_len}] * 2
    # forward's *flat takes one entry
    return module, (ids, positions, *args), ({0: batch}, {0: batch}, tuple(shapes)), sig
