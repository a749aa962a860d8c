"""M2R2's draft stage as a pure function of tensors: its per-round scratch in and out.

The eager ``draft`` stage (``passes.fast_partition``) runs the fast stream on one token and
keeps the round's earlier drafts' fast keys/values in a ``FastScratch``, a Python object,
and reads the slow keys of the verified positions up to the cache's fill length, a host
integer. Neither crosses an ONNX boundary. :class:`FastDraftStage` wraps the stage so that
both are tensors (``modules.m2r2.FastState``):

- ``input_ids``, ``position_ids`` ``[batch, 1]``: the draft's token and position t;
- ``fast_past.{i}.key`` / ``.value`` ``[batch, h_kv, drafted, head_dim]`` for each fast layer's
  cache slot ``i``: the round's earlier drafts' fast keys/values (``drafted`` = 0 at the
  round's first draft); the scratch;
- ``past_key_values.{i}.key`` / ``.value``: the slow cache buffers of those slots, read only
  (the stage writes no cache slot: no ``present.{i}.*``);
- out: ``logits``, ``hidden`` (the fast state at the gate) and ``fast_present.{i}.key`` /
  ``.value`` ``[batch, h_kv, drafted + 1, head_dim]``: the scratch with this draft's key/value
  appended, which the round's next draft takes as its ``fast_past``.

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
from ..modules.m2r2 import AcceleratedLayer, FastState

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


class FastDraftStage(nn.Module):
    """The draft ``stage`` with tensor-only inputs and outputs (see the module docstring):
    ``forward(input_ids, position_ids, *fast_pasts, *slow_pasts)`` ->
    ``(logits, hidden, *fast_presents)``, each slot's key then value."""

    def __init__(self, stage: fx.GraphModule) -> None:
        super().__init__()
        self.stage = stage
        self.slots = [m.cache_layer for m in fast_layers(stage)]

    def forward(self, input_ids, position_ids, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.slots)

        def pairs(offset: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
            return {s: (flat[offset + 2 * j], flat[offset + 2 * j + 1]) for j, s in
                    enumerate(self.slots)}  # fmt: skip

        state = FastState(slow=pairs(2 * n), past=pairs(0))
        out = self.stage(input_ids=input_ids, position_ids=position_ids, cache=None, scratch=state)
        presents = [t for s in self.slots for t in state.present[s]]
        return out["logits"], out["hidden"], *presents


def signature(stage: fx.GraphModule) -> StageSignature:
    """The draft stage's inputs and outputs: the scratch of each fast layer's slot in and out,
    that slot's slow buffers read and none written."""
    slots = [m.cache_layer for m in fast_layers(stage)]
    scratch_in = [n for s in slots for n in fast_past_names(s)]
    return StageSignature(
        tensor_inputs=["input_ids", "position_ids", *scratch_in],
        outputs=["logits", "hidden", *(n for s in slots for n in fast_present_names(s))],
        cache_layers=slots,
        groups={},
        cache_writes=[],
    )


def scratch_spec(stage: fx.GraphModule) -> dict[str, Any]:
    """The manifest's description of the draft stage's scratch (a consumer builds the round's
    first, zero-length one from it)."""
    layers = fast_layers(stage)
    slots = [m.cache_layer for m in layers]
    return {
        "slots": slots,
        "num_kv_heads": [len(m.kv_heads) for m in layers],
        "head_dim": [m.head_dim for m in layers],
        "inputs": [n for s in slots for n in fast_past_names(s)],
        "outputs": [n for s in slots for n in fast_present_names(s)],
        "rule": (
            "a round's first draft feeds fast_past.{i}.* of length 0 ([batch, kv_heads, 0, "
            "head_dim]); each later draft of the round feeds the fast_present.{i}.* the draft "
            "before returned (length m: the drafts so far). A draft at position t reads the "
            "slow slots < t - m, so the cache must hold the verified positions below the "
            "round's first; nothing of the cache is written"
        ),
    }


def fast_draft_export(
    sm: SpeculativeModel, stage: fx.GraphModule
) -> tuple[FastDraftStage, tuple[torch.Tensor, ...], tuple[dict[int, Any], ...], StageSignature]:
    """(module, example args, dynamic shapes, signature) for ``torch.onnx.export`` of the
    draft ``stage``."""
    module = FastDraftStage(stage)
    module.training = False  # the wrapper's own flag only: .eval() would reach the user's model
    for m in fast_layers(stage):
        m._merged()  # the merged weights cached from the real parameters, not traced
    sig = signature(stage)
    param = next(sm.hf_model.parameters())
    gen = example_generator()
    b, m, past = _EXAMPLE["batch"], _EXAMPLE["drafted"], _EXAMPLE["past"]
    ids = torch.randint(0, sm.config.vocab_size, (b, 1), generator=gen).to(param.device)
    positions = torch.full((b, 1), past + m, device=param.device)
    kv = kv_shapes(sm)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(param.device, param.dtype)

    layers = fast_layers(stage)
    fast = [randn(b, len(x.kv_heads), m, x.head_dim) for x in layers for _ in range(2)]
    slow = [
        randn(b, kv[s][0], _EXAMPLE["max_cache_len"], kv[s][1])
        for s in sig.cache_layers
        for _ in range(2)
    ]
    batch = torch.export.Dim("batch")
    drafted = torch.export.Dim("drafted", min=0)
    cache_len = torch.export.Dim("max_cache_len")
    flat = (*({0: batch, 2: drafted} for _ in fast), *({0: batch, 2: cache_len} for _ in slow))
    shapes = ({0: batch}, {0: batch}, flat)  # forward's *flat takes one entry
    return module, (ids, positions, *fast, *slow), shapes, sig
