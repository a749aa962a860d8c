"""Transfer engines: run expert copies beside compute, behind one interface.

``submit(job, demand=, after=)`` queues ``job()`` (a copy into a fast-tier slot, returning the
bytes it moved) and returns a ticket; ``wait(ticket)`` makes compute wait for it and returns
the host seconds that took (the stall); ``done(ticket)`` polls; ``record_free()`` marks the
point in compute after which a slot's old contents are no longer read (``after=`` of the next
job that overwrites the slot). On-demand jobs go before queued prefetches.

- ``ThreadEngine`` (CPU): one worker thread is the copy engine, a priority queue orders the
  jobs (demand first, then first come), a ``concurrent.futures.Future`` is the ticket. Compute
  runs on the caller's thread and is synchronous, so a slot is free once ``release`` returns:
  ``record_free`` has nothing to record. Disk reads and tensor copies release the GIL, so the
  worker's reads overlap the caller's matmuls.
- ``CudaEngine``: copies on side streams (a high-priority stream for demand, a low-priority one
  for prefetch), a ``torch.cuda.Event`` per job as the ticket (the slot's ready event), waited
  on by the compute stream without a host sync. ``record_free`` records an event on the compute
  stream after the layer's experts ran; a job that overwrites that slot first makes its copy
  stream wait for it (the write-after-read hazard). Host stall is not measurable without a
  sync, so ``wait`` returns 0.0 there (use a profiler's timeline).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

Job = Callable[[], int]


class TransferEngine(Protocol):
    def submit(self, job: Job, *, demand: bool, after: Any = None) -> Any: ...

    def wait(self, ticket: Any) -> float: ...

    def done(self, ticket: Any) -> bool: ...

    def record_free(self) -> Any: ...

    def close(self) -> None: ...


class _Busy:
    seconds = 0.0  # worker time spent in jobs (the copy engine's busy share)


def _work(jobs: queue.PriorityQueue, delay: float, busy: _Busy) -> None:
    # A function of the queue, not a method: the thread must not keep the engine alive, so that
    # an engine nobody references is collected and its __del__ stops the thread.
    while True:
        _, _, job, future = jobs.get()
        if job is None:
            return
        if not future.set_running_or_notify_cancel():
            continue
        start = time.perf_counter()
        try:
            if delay:
                time.sleep(delay)
            future.set_result(job())
        except BaseException as err:  # handed to the waiting thread, which re-raises it
            future.set_exception(err)
        finally:
            busy.seconds += time.perf_counter() - start


class ThreadEngine:
    """A worker thread with a priority queue of copy jobs; tickets are futures.

    ``delay_s`` sleeps before every job: tests use it so that a compute that forgets to wait
    reads a poisoned slot every time instead of sometimes.
    """

    def __init__(self, *, delay_s: float = 0.0) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._busy = _Busy()
        self._thread = threading.Thread(
            target=_work, args=(self._queue, delay_s, self._busy), name="leapfx-offload",
            daemon=True,
        )  # fmt: skip
        self._thread.start()

    @property
    def busy_seconds(self) -> float:
        return self._busy.seconds

    def submit(self, job: Job, *, demand: bool, after: Any = None) -> Future:
        future: Future = Future()
        self._queue.put((0 if demand else 1, next(self._order), job, future))
        return future

    def wait(self, ticket: Future) -> float:
        if ticket.done():
            ticket.result()  # re-raises a failed copy
            return 0.0
        start = time.perf_counter()
        ticket.result()
        return time.perf_counter() - start

    def done(self, ticket: Future) -> bool:
        return ticket.done()

    def record_free(self) -> None:
        return None

    def close(self) -> None:
        """Stop the worker after the jobs already queued."""
        if self._thread.is_alive():
            self._queue.put((2, next(self._order), None, None))
            self._thread.join()

    def __del__(self) -> None:
        self._queue.put((2, next(self._order), None, None))


class CudaEngine:
    """Copy streams + events on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Lower numbers are higher priorities; -1 is valid on every CUDA device.
        self.demand_stream = torch.cuda.Stream(device, priority=-1)
        self.prefetch_stream = torch.cuda.Stream(device, priority=0)
        self.busy_seconds = 0.0  # not measured on CUDA (see the module docstring)

    def submit(self, job: Job, *, demand: bool, after: Any = None) -> torch.cuda.Event:
        stream = self.demand_stream if demand else self.prefetch_stream
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)  # the slot's last reader has finished
            job()
            ready = torch.cuda.Event()
            ready.record(stream)
        return ready

    def wait(self, ticket: torch.cuda.Event) -> float:
        torch.cuda.current_stream(self.device).wait_event(ticket)
        return 0.0

    def done(self, ticket: torch.cuda.Event) -> bool:
        return ticket.query()

    def record_free(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def close(self) -> None:
        self.demand_stream.synchronize()
        self.prefetch_stream.synchronize()
