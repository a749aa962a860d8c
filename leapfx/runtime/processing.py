"""HF logits processors and stopping criteria inside a schedule, and the sequence they read.

``generate`` builds one :class:`Processing` per call from the effective generation config with
transformers' own machinery (``leapfx.runtime.generation``): the ``LogitsProcessorList`` HF
``generate`` would run (penalties, n-gram and word bans, min lengths, forced and suppressed
tokens, and with ``do_sample`` the warpers), and the stopping criteria leapfx does not check
natively (stop strings, ``max_time``, the caller's). A schedule applies the list where HF
would, as HF's assisted decoding does (``_assisted_decoding``):

- to the full model's logits at each verified position, with that position's prefix (the
  emitted tokens and the drafts before it): the target distribution of a speculative round is
  then exactly what plain decoding under the same processors samples from, so a speculative
  decode stays equal to plain decoding;
- to the draft's logits where a drafter samples (its q is the processed distribution);
- to the exit's logits in lossy recipes.

A processor is arbitrary Python over a prefix tensor: applying it needs the logits on the host
side of a loop over positions, which costs a host sync per round on a GPU. So ``active`` is
False when the list holds only the warpers that ``sampling.warp_logits`` replays on the device
(temperature, top-k, top-p), and the schedules keep their device-side fast path then.

Sequence: ``ids`` [1, n + emitted] grows as ``Output.extend`` emits tokens; a row's prefix is
``ids`` followed by the drafts before it.
"""

from __future__ import annotations

import torch

# HF's warpers that ``sampling.warp_logits`` replays with the same ops (same order, same skip
# rules): a list of these alone is the fast path's.
REPLAYED_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")


class Processing:
    """The processors and stopping criteria of one generate call over a growing sequence.

    Args:
        prompt: [1, n] token ids (on the decode's device).
        processors: HF ``LogitsProcessorList`` for this call (warpers included when sampling).
        stopping: HF ``StoppingCriteriaList`` of the criteria leapfx does not check natively.
        record: keep every emitted token's logits (``output_scores`` / ``output_logits``).
        criteria_scores: hand the stopping criteria the processed scores so far, as HF does
            under ``return_dict_in_generate`` with ``output_scores`` (None otherwise).

    >>> from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor
    >>> p = Processing(torch.tensor([[1, 2]]), LogitsProcessorList(
    ...     [RepetitionPenaltyLogitsProcessor(2.0)]), [])
    >>> p.scores(torch.ones(1, 4)).tolist()
    [[1.0, 0.5, 0.5, 1.0]]
    """

    def __init__(
        self,
        prompt: torch.Tensor,
        processors,
        stopping,
        *,
        record: bool = False,
        criteria_scores: bool = False,
    ):
        self.ids = prompt.to(torch.long)  # [1, n + emitted]; HF's processors index with it
        self.processors = processors
        self.stopping = stopping
        self.record = record
        self.active = any(type(p).__name__ not in REPLAYED_WARPERS for p in processors)
        self.logits: list[torch.Tensor] = []  # [1, V] per emitted token, when recording
        self.criteria_scores = criteria_scores
        self.processed: list[torch.Tensor] = []  # [1, V] processed, for the criteria

    def extend(self, token: int, logits: torch.Tensor | None) -> bool:
        """Append one emitted token (its logits row [1, V] when the schedule has it); True when
        a stopping criterion fires on the sequence it ends."""
        if self.stopping and self.criteria_scores:
            assert logits is not None, "a schedule emitted a token without its logits"
            self.processed.append(self.scores(logits))  # over the prefix before the token
        new = torch.tensor([[token]], dtype=self.ids.dtype, device=self.ids.device)
        self.ids = torch.cat([self.ids, new], dim=1)
        if self.record:
            assert logits is not None, "a schedule emitted a token without its logits"
            self.logits.append(logits.to(torch.float32, copy=True))
        if self.stopping:
            # HF hands its criteria the processed scores so far when it keeps them
            # (return_dict_in_generate with output_scores), else None
            scores = tuple(self.processed) if self.criteria_scores else None
            return bool(self.stopping(self.ids, scores).any())  # host sync: a criterion
        return False

    def prefix(self, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The sequence [1, t] a row reads: emitted tokens, then ``drafts`` [1, i] if given."""
        if drafts is None or drafts.shape[1] == 0:
            return self.ids
        return torch.cat([self.ids, drafts.to(self.ids.dtype)], dim=1)

    def scores(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """HF's processed scores [1, V] (float32) of the next token after ``prefix(drafts)``."""
        # a copy, as HF's generate takes one: some processors write into the scores
        return self.processors(self.prefix(drafts), logits.to(torch.float32, copy=True))

    def rows(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """Processed scores [1, d+1, V] of a verify's target ``logits`` [1, d+1, V]: row i
        reads the prefix with drafts [1, d] up to i (HF's ``_assisted_decoding`` loop)."""
        # One processor pass per row, each over its own prefix: a host loop (a sync per round
        # on a GPU), taken only when a processor beyond the replayed warpers is active.
        out = [self.scores(logits[:, i], drafts[:, :i]) for i in range(logits.shape[1])]
        return torch.stack(out, dim=1)

    def replay(self, prompt_len: int) -> tuple[torch.Tensor, ...]:
        """``output_scores``: the processed scores of every emitted token, each [1, V], as HF's
        ``generate`` returns them (each over the prefix before that token)."""
        return tuple(
            self.processors(self.ids[:, : prompt_len + i], row.clone())
            for i, row in enumerate(self.logits)
        )
