"""The stage-executor protocol: what every backend's stage provides to the ``StageRunner``.

A stage executor is called with the stage's named inputs (``input_ids``, ``position_ids``,
``masks``, ``cache``, and whatever else the stage's cut names) and returns a dict of tensors.
The eager stages are the GraphModules themselves; ``leapfx.lower`` wraps compiled graphs
(``inductor.py``: ``CompiledStage``, ``CompiledChain``), eager kernel chains (``cpu_kernels.py``:
``EagerChain``) and onnxruntime sessions (``ort_stages.py``: ``OrtStage``, ``OrtChainStage``,
``SplitVerify``). Schedules never see which. ``Lower`` is the shape of ``leapfx.lower.lower``,
which a ``SpeculativeModel`` is handed (lowering sits a floor above the runtime).

Three things an executor may declare beyond the call, each with a default that an eager
GraphModule gets without declaring anything:

===================  =====================================  =====================================
attribute            meaning                                default
===================  =====================================  =====================================
``builds_masks``     it computes its masks from the          False: the runner builds them
                     positions itself (a compiled graph,
                     an ONNX session): the runner passes
                     none
``mask_free``        ``(start, length) -> bool``: rows       None: every call gets masks
                     ``start..start+length-1`` of one
                     sequence read no mask (kernel stages)
``chain_length``     a ``draft_chain``'s greedy drafts a     0: not a chain
                     call makes
===================  =====================================  =====================================

Read them through :func:`builds_masks`, :func:`mask_free` and :func:`chain_length`, not with
``getattr`` at each reader.

:func:`prefill_stage` gives the copy of an eager ``full`` stage whose LM head reads the last
position only (``passes.last_logits``), made once per stage: a prompt's prefill needs no
other row of logits. Other backends run the stage as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import fx

from ..passes.last_logits import head_at_last


@runtime_checkable
class StageExecutor(Protocol):
    """A stage on some backend: ``executor(**inputs) -> {name: tensor}``.

    >>> out = executor(input_ids=ids, position_ids=pos, masks=masks, cache=cache)
    >>> out["logits"].shape      # [B, S, V]
    """

    def __call__(self, **inputs: Any) -> Mapping[str, torch.Tensor]: ...


@runtime_checkable
class ChainExecutor(StageExecutor, Protocol):
    """A ``draft_chain``: ``chain_length`` greedy draft steps in one call (see
    ``StageRunner.draft_chain``); it builds no masks (one-token steps)."""

    builds_masks: bool
    chain_length: int


def builds_masks(executor: object) -> bool:
    """Whether ``executor`` computes its own masks from positions (the runner passes none)."""
    return bool(getattr(executor, "builds_masks", False))


def mask_free(executor: object) -> Callable[[int, int], bool] | None:
    """``executor``'s ``(start, length) -> bool`` test for rows that read no mask, or None."""
    return getattr(executor, "mask_free", None)


def chain_length(executor: object | None) -> int:
    """The greedy drafts one call of ``executor`` (a ``draft_chain``) makes; 0 for None or a
    stage that is not a chain."""
    return int(getattr(executor, "chain_length", 0) or 0)


# stage -> its last-position-head copy (or None where it has none), made once per stage
_PREFILL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prefill_stage(executor: object) -> object:
    """The copy of ``executor`` whose ``logits`` are the last position's only ([B, 1, V]) where
    it is an eager GraphModule with a plain LM head, else ``executor`` itself."""
    if not isinstance(executor, fx.GraphModule):
        return executor
    if executor not in _PREFILL:
        variant = head_at_last(executor)
        if variant is not None:
            for name in ("builds_masks", "mask_free"):  # what the executor declared
                if hasattr(executor, name):
                    setattr(variant, name, getattr(executor, name))
        _PREFILL[executor] = variant
    return _PREFILL[executor] or executor


class Lower(Protocol):
    """``leapfx.lower.lower``: lowers ``sm``'s stages to ``backend`` and returns the model
    (``SpeculativeModel.compile`` and ``use_cpu_kernels`` call it).

    >>> lower(sm, "inductor", verify_shapes="padded")
    """

    def __call__(self, sm: Any, backend: str, **options: Any) -> Any: ...
