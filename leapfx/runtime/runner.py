"""StageRunner: calls stage executors with positions and masks over the shared KV cache.

A stage executor (``leapfx.runtime.executor.StageExecutor``) is any callable taking the stage's
named inputs and returning a dict of tensors: an eager GraphModule, a compiled graph or an ONNX
session. Schedules talk to a StageRunner and never know which backend runs a stage.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import executor
from .cache import StaticKVCache
from .executor import StageExecutor
from .masks import masks_for

__all__ = ["PREFILL", "AttentionLayout", "StageExecutor", "StageRunner"]

# The key a prompt's call is timed under; such a call reads the last position's logits only.
PREFILL = "prefill"


@dataclass(frozen=True)
class AttentionLayout:
    """What masks a model needs: HF attention implementation, per-layer kinds, sliding window."""

    impl: str
    kinds: tuple[str, ...]
    window: int | None
    dtype: torch.dtype
    device: torch.device


class StageRunner:
    """Runs named stages; ``start`` arguments are absolute positions of the first token."""

    def __init__(
        self, stages: Mapping[str, StageExecutor], cache: StaticKVCache, layout: AttentionLayout
    ) -> None:
        self.stages = stages
        self.cache = cache
        self.layout = layout
        # Host wall time per stage name, for cost ratios (bench --sweep). On a GPU these are
        # launch times, not kernel times, unless the caller synchronises. A decode's first
        # call (the prompt, at position 0) counts as "prefill", whichever stage runs it, so
        # that "full" / "draft" / "verify" time decode steps only.
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._arange = torch.arange(getattr(cache, "max_len", 0), device=layout.device)

    def keep(self, rows: list[int]) -> None:
        """Its one sequence goes on (``rows`` [0]) or has ended ([]): nothing moves
        (``rounds.Decode`` calls this as a batch's runner keeps its live rows)."""
        if rows not in ([], [0]):
            raise ValueError(f"rows: {rows} of a one-sequence runner; allowed: [] or [0]")

    def call(self, name: str, key: str | None = None, **inputs) -> dict[str, torch.Tensor]:
        """Stage ``name`` on ``inputs`` as given (the caller builds positions and masks);
        its wall time counts under ``key`` (default ``name``) in ``seconds``. A ``PREFILL``
        call (a prompt) runs the stage's copy whose logits are the last position's only,
        where it has one (``executor.prefill_stage``)."""
        stage = self.stages[name]
        if key == PREFILL:
            stage = executor.prefill_stage(stage)
        start = time.perf_counter()
        out = stage(**inputs)
        self.seconds[key or name] += time.perf_counter() - start
        return out

    def _positions(self, start: int, length: int) -> torch.Tensor:
        # position_ids: [1, S], a view of one arange over the cache (a fresh arange costs
        # several times a slice in a decode loop); a fresh one past its end
        end = start + length
        if end > self._arange.shape[0]:
            return torch.arange(start, end, device=self.layout.device)[None]
        return self._arange[None, start:end]

    def _masks(self, name: str, start: int, length: int) -> dict[str, torch.Tensor | None] | None:
        stage = self.stages[name]
        if executor.builds_masks(stage):
            return None  # a compiled graph or ONNX session computes its masks from positions
        lay = self.layout
        free = executor.mask_free(stage)
        if free is not None and free(start, length):
            # every mask reader of the stage attends these rows without one (kernel stages:
            # compiled._mask_free); a verify pass's two masks cost ~30 us to build
            return dict.fromkeys(lay.kinds)
        # additive: one mask serves every layer of the stage, so SDPA's per-call conversion of
        # a boolean mask is done once here (same values, same results).
        return masks_for(
            lay.impl, list(lay.kinds), start, length,
            window=lay.window, dtype=lay.dtype, device=lay.device, additive=True,
        )  # fmt: skip

    def chunk(
        self,
        name: str,
        input_ids: torch.Tensor,
        start: int,
        *,
        key: str | None = None,
        **extra: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Run stage ``name`` on ``input_ids`` [1, S] at positions start..start+S-1.

        ``extra``: the stage's other inputs (e.g. the EAGLE head's ``hidden``); ``key``: the
        name its time is counted under in ``seconds`` (default ``name``; "prefill" at 0).
        At ``start`` 0 (a prompt) the ``logits`` are the last position's only, [1, 1, V], where
        the stage allows (``executor.prefill_stage``): a prefill reads no other row."""
        n = input_ids.shape[1]
        return self.call(
            name,
            key=PREFILL if start == 0 else key,
            input_ids=input_ids,
            position_ids=self._positions(start, n),
            masks=self._masks(name, start, n),
            cache=self.cache,
            **extra,
        )

    def full(self, input_ids: torch.Tensor, start: int, key: str | None = None) -> torch.Tensor:
        """All layers on ``input_ids`` [1, S] at positions start..; returns logits [1, S, V],
        or [1, 1, V] (the last position's) for a prompt (``start`` 0) where the stage allows it
        (``executor.prefill_stage``).

        ``key`` names the call in ``seconds`` (M2R2's verify pass is a ``full`` call)."""
        return self.chunk("full", input_ids, start, key=key)["logits"]

    def rows(
        self, name: str, start: int, length: int, *, masks: bool = True, **inputs
    ) -> dict[str, torch.Tensor]:
        """Stage ``name`` on ``length`` rows at positions start..start+length-1 (their
        position_ids, their masks where ``masks``, and the cache added to ``inputs``)."""
        extra = {"masks": self._masks(name, start, length)} if masks else {}
        return self.call(
            name, position_ids=self._positions(start, length), cache=self.cache, **extra, **inputs
        )

    def fast_draft(self, input_ids: torch.Tensor, start: int, scratch) -> torch.Tensor:
        """M2R2's fast stream on one token [1, 1] at ``start``; returns logits [1, 1, V].

        Reads the cache's slow keys and extends ``scratch`` (a ``FastScratch``); writes no
        cache layer."""
        return self.call(
            "draft",
            input_ids=input_ids,
            position_ids=self._positions(start, 1),
            cache=self.cache,
            scratch=scratch,
        )["logits"]

    def draft(self, input_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers < E and the exit head; returns (exit logits [1, S, V], exit hidden [1, S, H])."""
        out = self.chunk("draft", input_ids, start)
        return out["logits"], out["hidden"]

    def chain_length(self) -> int:
        """Greedy drafts one ``draft_chain`` call makes (0: the stages have no chain)."""
        return executor.chain_length(self.stages.get("draft_chain"))

    def draft_chain(self, input_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``chain_length()`` greedy draft steps in one call, from token ``input_ids`` [1, 1] at
        ``start``: what as many ``draft`` calls would give, each fed the argmax of the one
        before. Returns (draft tokens [1, D], their exit hidden states [1, D, H]); the cache's
        lower layers are written at start..start+D-1. Timed as "draft"."""
        out = self.call(
            "draft_chain", key="draft", input_ids=input_ids,
            position_ids=self._positions(start, 1), masks=None, cache=self.cache,
        )  # fmt: skip
        return out["tokens"], out["hidden"]

    def verify(
        self, input_ids: torch.Tensor, exit_hidden: torch.Tensor, hidden_start: int
    ) -> torch.Tensor:
        """Verify remainder.

        ``exit_hidden`` [1, c, H] are cached exit hidden states of positions hidden_start..;
        ``input_ids`` [1, m] are the next m tokens, not yet through the lower layers. Returns
        the full model's logits for all c + m positions: [1, c + m, V].
        """
        c, m = exit_hidden.shape[1], input_ids.shape[1]
        new_start = hidden_start + c
        out = self.call(
            "verify",
            input_ids=input_ids,
            position_ids=self._positions(new_start, m),
            masks=self._masks("verify", new_start, m),
            exit_hidden=exit_hidden,
            remainder_position_ids=self._positions(hidden_start, c + m),
            remainder_masks=self._masks("verify", hidden_start, c + m),
            cache=self.cache,
        )
        return out["logits"]
