"""StageRunner: calls stage executors with positions and masks over the shared KV cache, for one
sequence or a batch's rows.

A stage executor (``leapfx.runtime.executor.StageExecutor``) is any callable taking the stage's
named inputs and returning a dict of tensors: an eager GraphModule, a compiled graph or an ONNX
session. Schedules and drafters talk to a StageRunner and never know which backend runs a stage.

Rows. The runner's cache says where its rows sit, and so what a call's ``start`` is:

- a cache whose rows share one fill length (``cache.StaticKVCache``: a single sequence, B = 1,
  on any backend; ONNX Runtime's ``OrtKVCache`` too): ``start`` is an int, the first position
  of every row; positions are a view of one arange over the cache, masks are HF's
  (``masks.masks_for``);
- a ragged cache (``rows.RowKVCache``, ``ragged``: a batch, rows leaving and joining between
  rounds): ``start`` is a list, ``start[b]`` row b's first cache column; row b is left-padded by
  ``pads[b]``, its position is its column less its padding, and its masks hide its padding and
  every column past its own end (``masks.row_masks``).

Every call (``chunk``, ``full``, ``draft``, ``rows``, ``verify``, ``prefill``) takes either, as
its cache has it; ``keep``, ``alone`` and ``join`` follow a ragged batch's rows, ``prefill`` runs
a batch's padded prompts a row at a time where that is cheaper. The single sequence's extras
(``fast_draft``: M2R2's fast stream; ``draft_chain``: d greedy drafts in one call) take an int.

One sequence's start stays an int rather than a one-row list: its calls (the hot path of every
decode) then build no list and no tensor for positions, and its cache keeps an int a layer
(``rows`` says why the two caches stay two). Which kind a runner is, ``ragged``, is its cache's,
read once.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping

import torch

from . import executor
from .cache import StaticKVCache
from .executor import StageExecutor
from .masks import AttentionLayout, masks_for, row_masks

__all__ = [
    "PREFILL",
    "ROW_PREFILL_PADDING",
    "AttentionLayout",
    "StageExecutor",
    "StageRunner",
    "Start",
]

# The key a prompt's call is timed under; such a call reads the last position's logits only.
PREFILL = "prefill"

# StageRunner.prefill: on a CPU, a batch's prompts whose padding is at least this share of the
# batch's columns are prefilled a row at a time (a call's cost follows its rows there, so padding
# is pure waste, and a row's call costs little more than its share of the padded one).
ROW_PREFILL_PADDING = 0.1

# A call's first position: an int (every row's, a cache of one fill length) or one a row (a
# ragged cache's columns).
Start = int | list[int]


class StageRunner:
    """Runs named stages; ``start`` arguments are the first token's position (one sequence) or
    each row's first cache column (a ragged cache's rows, left-padded by ``pads``)."""

    def __init__(
        self,
        stages: Mapping[str, StageExecutor],
        cache: StaticKVCache,
        layout: AttentionLayout,
        pads: list[int] | None = None,
    ) -> None:
        self.stages = stages
        self.cache = cache
        self.layout = layout
        # Whether each row sits at its own cache columns (a batch's RowKVCache): then ``start``
        # arguments are lists and ``pads`` each row's left padding.
        self.ragged = bool(getattr(cache, "ragged", False))
        if self.ragged:
            self.pads = [0] * cache.batch_size if pads is None else list(pads)
            cache.first = list(self.pads)
        elif pads is not None and any(pads):
            raise ValueError(
                f"pads: {pads} over a cache whose rows share one length; allowed: no padding, "
                "or a ragged cache (rows.RowKVCache)"
            )
        else:
            self.pads = [0]
        # Host wall time per stage name, for cost ratios (bench --sweep). On a GPU these are
        # launch times, not kernel times, unless the caller synchronises. A decode's first
        # call (the prompt, at position 0) counts as "prefill", whichever stage runs it, so
        # that "full" / "draft" / "verify" time decode steps only.
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._arange = torch.arange(getattr(cache, "max_len", 0), device=layout.device)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current rows), in that order (``rounds.Decode``
        calls this when rows finish). A cache of one fill length holds one sequence: it goes on
        (``rows`` [0]) or has ended ([]), and nothing moves."""
        if self.ragged:
            self.cache.keep(rows)
            self.pads = [self.pads[r] for r in rows]
        elif rows not in ([], [0]):
            raise ValueError(f"rows: {rows} of a one-sequence runner; allowed: [] or [0]")

    def alone(self) -> StageRunner:
        """A runner of one row over an empty ragged cache shaped as this one's (a row that
        joins a batch, prefilled alone: ``rounds.Decode.admit``)."""
        return StageRunner(self.stages, self.cache.blank(1), self.layout, [0])

    def join(self, other: StageRunner) -> None:
        """Append ``other``'s rows (its ragged cache's and pads) after this runner's."""
        self.cache.join(other.cache)
        self.pads = self.pads + other.pads

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

    def _positions(self, start: Start, length: int) -> torch.Tensor:
        if self.ragged:  # [B, S]: each row's columns less its padding
            device = self.layout.device
            cols = torch.tensor(start, device=device)[:, None] + torch.arange(length, device=device)
            return (cols - torch.tensor(self.pads, device=device)[:, None]).clamp(min=0)
        # position_ids: [1, S], a view of one arange over the cache (a fresh arange costs
        # several times a slice in a decode loop); a fresh one past its end
        end = start + length
        if end > self._arange.shape[0]:
            return torch.arange(start, end, device=self.layout.device)[None]
        return self._arange[None, start:end]

    def _masks(
        self, name: str, start: Start, length: int, pads: list[int] | None = None
    ) -> dict[str, torch.Tensor | None] | None:
        """The masks of stage ``name`` for ``length`` queries a row from ``start`` (``pads``:
        the rows' padding where not the runner's, a row prefilled alone)."""
        stage = self.stages[name]
        if executor.builds_masks(stage):
            return None  # a compiled graph or ONNX session computes its masks from positions
        lay = self.layout
        free = executor.mask_free(stage)
        if free is not None and (self.ragged or free(start, length)):
            # every mask reader of the stage attends these rows without one (kernel stages:
            # compiled._mask_free; a ragged batch's rows through leapfx_cpu::attention_rows,
            # over each row's span); a verify pass's two masks cost ~30 us to build
            return dict.fromkeys(lay.kinds)
        if self.ragged:
            return row_masks(lay, start, self.pads if pads is None else pads, length)
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
        start: Start,
        *,
        key: str | None = None,
        **extra: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """Run stage ``name`` on ``input_ids`` [B, S] at positions start..start+S-1 (a ragged
        cache's row b at columns start[b]..).

        ``extra``: the stage's other inputs (e.g. the EAGLE head's ``hidden``); ``key``: the
        name its time is counted under in ``seconds`` (default ``name``; "prefill" at 0).
        At ``start`` 0 (a prompt) the ``logits`` are the last position's only, [1, 1, V], where
        the stage allows (``executor.prefill_stage``): a prefill reads no other row. (A ragged
        batch's prompts: :meth:`prefill`.)"""
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

    def full(self, input_ids: torch.Tensor, start: Start, key: str | None = None) -> torch.Tensor:
        """All layers on ``input_ids`` [B, S] at positions start..; returns logits [B, S, V],
        or [1, 1, V] (the last position's) for a prompt (``start`` 0) where the stage allows it
        (``executor.prefill_stage``).

        ``key`` names the call in ``seconds`` (M2R2's verify pass is a ``full`` call)."""
        return self.chunk("full", input_ids, start, key=key)["logits"]

    def prefill(
        self, name: str, prompt: torch.Tensor, *, alone: bool = False, **extra: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Stage ``name``'s outputs over the prompts ``prompt`` [B, S] from column 0 (a ragged
        cache's rows left-padded by ``pads``), each output's last position at least
        ([B, 1, ...]; ``logits`` [B, 1 or S, V]).

        On a CPU, where a call's cost follows its rows, a batch whose padding is at least
        ``ROW_PREFILL_PADDING`` of its columns (any padding with ``alone``: a stage whose
        state runs across positions, EAGLE's shifted hidden states, would read the padding's)
        runs a call a row over that row's own tokens (no compute on padding; every output
        [B, 1, ...]); otherwise, and for a compiled stage (whose graphs take the whole cache,
        not a row's view of it), one call over the padded batch. ``extra``: the stage's other
        inputs, [B, ...] (a call a row takes row b's)."""
        B, S = prompt.shape
        if not self.ragged:
            return self.chunk(name, prompt, 0, **extra)
        padding = sum(self.pads) / (B * S)
        compiled = executor.builds_masks(self.stages[name])
        by_row = padding > 0 if alone else padding >= ROW_PREFILL_PADDING
        if B == 1 or prompt.device.type != "cpu" or not by_row or compiled:
            return self.chunk(name, prompt, [0] * B, key=PREFILL, **extra)
        cache, outs = self.cache, []
        written = [list(layer) for layer in cache.rows]
        for b, pad in enumerate(self.pads):
            view = cache.row_view(b)
            n = S - pad
            out = self.call(
                name,
                key=PREFILL,
                input_ids=prompt[b : b + 1, pad:],
                position_ids=torch.arange(n, device=prompt.device)[None],
                masks=self._masks(name, [pad], n, [pad]),  # the view: row b alone
                cache=view,
                **{k: v[b : b + 1] for k, v in extra.items()},
            )
            outs.append({k: v[:, -1:] for k, v in out.items()})
            for layer, rows in enumerate(view.rows):
                if rows[0] != pad:  # the stage wrote this layer
                    written[layer][b] = rows[0]
        cache.rows = written
        cache.lengths = [max(layer) for layer in written]
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    def rows(
        self, name: str, start: Start, length: int, *, masks: bool = True, **inputs
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

    def draft(
        self, input_ids: torch.Tensor, start: Start
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft stage (layers < E and the exit head; a batch's layer-skipped stage);
        returns (exit logits [B, S, V], exit hidden [B, S, H], or None where the stage gives
        none)."""
        out = self.chunk("draft", input_ids, start)
        return out["logits"], out.get("hidden")

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
        self, input_ids: torch.Tensor, exit_hidden: torch.Tensor, hidden_start: Start
    ) -> torch.Tensor:
        """Verify remainder (``passes.partition``'s split verify).

        ``exit_hidden`` [B, c, H] are the exit hidden states the draft stage computed at
        positions hidden_start.. (a ragged cache's row b at columns hidden_start[b]..);
        ``input_ids`` [B, m] are the next m tokens, not yet through the lower layers. Returns
        the full model's logits for all c + m positions: [B, c + m, V]. The cache's lower
        layers must hold the c positions the draft wrote, the upper ones end at hidden_start.
        """
        c, m = exit_hidden.shape[1], input_ids.shape[1]
        new_start = [s + c for s in hidden_start] if self.ragged else hidden_start + c
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
