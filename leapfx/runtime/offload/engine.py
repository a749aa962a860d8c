"""Transfer engines: run expert copies beside compute, behind one interface.

``submit(job, demand=, after=)`` queues ``job()`` (copies into fast-tier slots, returning the
bytes it moved) and returns a ticket; ``wait(ticket)`` makes compute wait for it and returns
the host seconds that took (the stall); ``done(ticket)`` polls; ``record_free()`` marks the
point in compute after which a slot's old contents are no longer read (``after=``, a list, of
the next job that overwrites the slot). On-demand jobs go before queued prefetches.

- ``ThreadEngine`` (CPU): a worker thread is the copy engine for prefetches, a
  ``concurrent.futures.Future`` is the ticket. On-demand reads run on the caller's thread by
  default (``inline_demand``): compute waits for them anyway, and handing one to a worker costs
  two GIL handoffs, each a scheduling latency on a busy CPU (measured on the project's loaded
  2-core machine: 2.4 ms of stall per token with a demand worker, 0 inline, the reads being the
  same). Compute runs on the caller's thread and is synchronous, so a slot is free once
  ``release`` returns: ``record_free`` has nothing to record. Disk reads and tensor copies
  release the GIL, so the worker's reads overlap the caller's matmuls.
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
    def submit(self, job: Job, *, demand: bool, after: list | None = None) -> Any: ...

    def wait(self, ticket: Any) -> float: ...

    def done(self, ticket: Any) -> bool: ...

    def record_free(self) -> Any: ...

    def close(self) -> None: ...


class _Busy:
    """Worker time spent in jobs, summed over the workers (the copy engine's busy time)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.lock = threading.Lock()


def _work(jobs: queue.PriorityQueue, delay: float, busy: _Busy) -> None:
    # A function of the queue, not a method: the thread must not keep the engine alive, so that
    # an engine nobody references is collected and its __del__ stops the thread.
    while True:
        _, _, job, future = jobs.get()
        if job is None:
            return
        if future.set_running_or_notify_cancel():
            _run(job, future, delay, busy)


def _run(job: Job, future: Future, delay: float, busy: _Busy) -> None:
    start = time.perf_counter()
    try:
        if delay:
            time.sleep(delay)
        future.set_result(job())
    except BaseException as err:  # handed to the waiting thread, which re-raises it
        future.set_exception(err)
    finally:
        with busy.lock:
            busy.seconds += time.perf_counter() - start


class ThreadEngine:
    """Worker threads as copy engines; tickets are futures.

    Two workers, like the CUDA engine's two streams: one runs on-demand jobs, the other
    prefetches, so that a demanded expert never waits behind a prefetch already being read (a
    single worker made next-gate prefetch stall on its own speculation; the disk serves both
    reads at once). Each takes its jobs first come, first served. With ``inline_demand`` (the
    default) on-demand jobs run in ``submit`` on the caller's thread instead and the ticket
    is already done.

    ``delay_s`` sleeps before every job: tests use it so that a compute that forgets to wait
    reads a poisoned slot every time instead of sometimes.
    """

    def __init__(self, *, delay_s: float = 0.0, inline_demand: bool = True) -> None:
        self.inline_demand = inline_demand
        self._delay = delay_s
        self._order = itertools.count()
        self._busy = _Busy()
        self._queues = {True: queue.PriorityQueue(), False: queue.PriorityQueue()}
        self._threads = [
            threading.Thread(
                target=_work,
                args=(q, delay_s, self._busy),
                daemon=True,
                name=f"leapfx-offload-{'demand' if demand else 'prefetch'}",
            )
            for demand, q in self._queues.items()
        ]
        for thread in self._threads:
            thread.start()

    @property
    def busy_seconds(self) -> float:
        return self._busy.seconds

    def submit(self, job: Job, *, demand: bool, after: list | None = None) -> Future:
        future: Future = Future()
        if demand and self.inline_demand:
            start = time.perf_counter()
            future.set_running_or_notify_cancel()
            _run(job, future, self._delay, self._busy)
            # Compute waited for this read as it ran: ``wait`` reports it as the stall.
            future.inline_s = time.perf_counter() - start
            return future
        self._queues[demand].put((0, next(self._order), job, future))
        return future

    def wait(self, ticket: Future) -> float:
        if ticket.done():
            ticket.result()  # re-raises a failed copy
            return getattr(ticket, "inline_s", 0.0)
        start = time.perf_counter()
        ticket.result()
        return time.perf_counter() - start

    def done(self, ticket: Future) -> bool:
        return ticket.done()

    def record_free(self) -> None:
        return None

    def _stop(self) -> None:
        for q in self._queues.values():
            q.put((1, next(self._order), None, None))

    def close(self) -> None:
        """Stop the workers after the jobs already queued."""
        if any(t.is_alive() for t in self._threads):
            self._stop()
            for thread in self._threads:
                thread.join()

    def __del__(self) -> None:
        self._stop()


class CudaEngine:
    """Copy streams + events on one CUDA device."""

    def __init__(self, device: torch.device, *, delay_s: float = 0.0) -> None:
        self.device = device
        # Tests: a spin kernel of about ``delay_s`` (at <= 2 GHz) before every job on its copy
        # stream, so that a compute which does not wait for its ticket reads the slot before
        # the copy lands, every time.
        self._delay_cycles = int(delay_s * 2e9)
        # Lower numbers are higher priorities; -1 is valid on every CUDA device.
        self.demand_stream = torch.cuda.Stream(device, priority=-1)
        self.prefetch_stream = torch.cuda.Stream(device, priority=0)
        self.busy_seconds = 0.0  # not measured on CUDA (see the module docstring)

    def submit(self, job: Job, *, demand: bool, after: list | None = None) -> torch.cuda.Event:
        stream = self.demand_stream if demand else self.prefetch_stream
        with torch.cuda.stream(stream):
            for event in after or ():
                stream.wait_event(event)  # the slots' last readers have finished
            if self._delay_cycles:
                torch.cuda._sleep(self._delay_cycles)
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
