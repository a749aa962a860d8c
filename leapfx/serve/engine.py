"""The server's decode loop: one thread runs a model's batch a round at a time, and requests
join it between rounds (continuous batching).

A request (:class:`Job`) is a prompt, a :class:`~leapfx.runtime.schedules.DecodeRequest` (its
own budget, EOS, sampling and generator) and where its tokens go. :class:`Engine` keeps one
:class:`~leapfx.runtime.batch.BatchDecode` of the model: before every round it lets the waiting
jobs in (up to ``max_batch`` rows; each prefilled alone and joined to the batch's cache) and
takes out the cancelled ones (a client that left); then one round drafts, verifies and accepts
for every row at once, each row at its own pace, and each row's new tokens go to its job as
the round emits them. A row leaves when it finishes. Greedy rows are the tokens the row would
get alone: nothing in a round depends on what else shares it.

Faults: a job whose prefill fails, or whose listener raises, fails alone (its row leaves after
the round); a round that raises fails the rows of that round (each job hears the error) and
the engine starts a fresh batch, so the next requests are served. ``stop()`` lets the jobs in
flight finish and refuses new ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..runtime.schedules import DecodeRequest

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests wait than the engine's ``max_queue``."""


class Stopping(Exception):
    """The engine is stopping: it takes no new request."""


@dataclass
class Job:
    """One request: ``prompt`` [1, n] token ids and its ``request``; ``on_tokens(list)`` hears
    each group of new tokens, ``on_end(error)`` once, when it finished (``error`` None) or
    failed. Both are called on the engine's thread."""

    prompt: torch.Tensor
    request: DecodeRequest
    on_tokens: Callable[[list[int]], None]
    on_end: Callable[[BaseException | None], None]
    index: int = -1
    admitted: float = 0.0  # time.perf_counter() when its row joined the batch
    drafted: int = 0
    kept: int = 0
    tokens: list[int] = field(default_factory=list)
    failed: BaseException | None = None  # its own fault (a listener that raised)


class _Streamer:
    """HF's streamer protocol for one row: the prompt first (dropped), then its tokens."""

    def __init__(self, job: Job) -> None:
        self.job, self.prompt_seen = job, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        tokens = value.reshape(-1).tolist()
        self.job.tokens.extend(tokens)
        if self.job.failed is not None:
            return
        try:
            self.job.on_tokens(tokens)
        except Exception as error:  # noqa: BLE001 - one request's fault fails it alone
            log.exception("request %d: its listener failed; the request is dropped", self.job.index)
            self.job.failed = error

    def end(self) -> None:
        pass  # the engine ends the job once the round is over (with its acceptance)


class Engine:
    """Continuous batching over ``sm`` (a SpeculativeModel whose recipe batches).

    Args:
        sm: the model.
        max_batch: rows decoded together at most; more requests wait for a row to leave.
        max_queue: requests waiting at most; past it ``submit`` raises :class:`QueueFull`.
        max_len: positions a row may use (prompt, new tokens and the recipe's lookahead): the
            length of the batch's cache.
    """

    def __init__(self, sm: Any, *, max_batch: int = 8, max_queue: int = 64, max_len: int = 2048):
        for name, value, low in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                                 ("max_len", max_len, 2)):  # fmt: skip
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {value!r} is invalid; allowed: an int >= {low}")
        self.sm, self.max_batch, self.max_queue, self.max_len = sm, max_batch, max_queue, max_len
        self.lookahead = sm.recipe.lookahead
        self._decode = self._fresh()  # checks that the recipe and backend batch
        self._waiting: deque[Job] = deque()
        self._cancelled: set[int] = set()
        self._live: dict[int, Job] = {}
        self._next = 0
        self._stopping = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.rounds = 0

    def _fresh(self):
        """An empty batch of the model: its cache grows with the rows (to ``max_len``)."""
        return self.sm.batch_decode(self.max_len, grow=True)

    # -- the caller's side (any thread) --------------------------------------------------

    def room(self, prompt_len: int) -> int:
        """New tokens a row with a ``prompt_len``-token prompt may ask for."""
        return self.max_len - prompt_len - self.lookahead

    def submit(self, job: Job) -> int:
        """Queue ``job``; its index (for :meth:`cancel`)."""
        with self._cond:
            if self._stopping:
                raise Stopping("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue)")
            job.index = self._next
            self._next += 1
            self._waiting.append(job)
            self._cond.notify()
        return job.index

    def cancel(self, index: int) -> None:
        """Drop the request ``index`` (waiting or decoding) before the next round."""
        with self._cond:
            self._cancelled.add(index)
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        """Rows decoding, requests waiting, rounds run."""
        with self._cond:
            return {"rows": len(self._live), "waiting": len(self._waiting), "rounds": self.rounds}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leapfx-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new request; let those waiting and decoding finish (at most ``timeout``)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine's thread --------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not (self._waiting or self._live or self._cancelled or self._stopping):
                    self._cond.wait()
                if self._stopping and not self._waiting and not self._live:
                    return
                cancelled, self._cancelled = self._cancelled, set()
                kept = deque(j for j in self._waiting if j.index not in cancelled)
                dropped = [j for j in self._waiting if j.index in cancelled]
                self._waiting = kept
                joining = []
                while self._waiting and len(self._live) + len(joining) < self.max_batch:
                    joining.append(self._waiting.popleft())
            for job in dropped:
                self._end(job, None)
            with torch.inference_mode():
                for index in cancelled & self._live.keys():
                    self._decode.cancel(index)
                for job in joining:
                    self._admit(job)
                self._finish_rows()
                if self._decode.rows:
                    self._round()

    def _admit(self, job: Job) -> None:
        request = replace(job.request, streamer=_Streamer(job))
        with self._cond:
            self._live[job.index] = job
        job.admitted = time.perf_counter()
        try:
            self._decode.admit(job.prompt, request, job.index)
        except Exception as error:  # noqa: BLE001 - one request's fault fails that request
            log.exception("request %d: prefill failed", job.index)
            self._rows_lost([job.index])
            self._decode = self._fresh() if self._broken() else self._decode
            self._end(job, error)

    def _broken(self) -> bool:
        """Whether the batch's rows and cache disagree (a call failed half-way)."""
        decode = self._decode
        return decode.runner.cache.batch_size != len(decode.rows)

    def _round(self) -> None:
        try:
            self._decode.round()
            self.rounds += 1
        except Exception as error:  # noqa: BLE001 - the round's rows fail, the server goes on
            log.exception("a decode round failed; failing its %d rows", len(self._decode.rows))
            lost = [row.index for row in self._decode.rows]
            self._decode = self._fresh()
            for index in lost:
                job = self._rows_lost([index])
                if job is not None:
                    self._end(job, error)
            return
        self._finish_rows()

    def _finish_rows(self) -> None:
        decode = self._decode
        for row in list(decode.rows):
            job = self._live.get(row.index)
            if job is not None and job.failed is not None:
                decode.cancel(row.index)
        for index in list(decode.finished):
            decode.finished.pop(index)
            drafted, kept = decode.acceptance.pop(index, (0, 0))
            job = self._rows_lost([index])
            if job is not None:
                job.drafted, job.kept = drafted, kept
                self._end(job, job.failed)

    def _rows_lost(self, indices: list[int]) -> Job | None:
        job = None
        with self._cond:
            for index in indices:
                job = self._live.pop(index, None)
        return job

    def _end(self, job: Job, error: BaseException | None) -> None:
        try:
            job.on_end(error)
        except Exception:  # noqa: BLE001 - a listener's fault is not the engine's
            log.exception("request %d: on_end failed", job.index)
