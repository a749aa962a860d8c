"""Transfer engines: run expert copies beside compute, behind one interface.

``submit(job, demand=, after=)`` queues ``job`` (a ``ReadJob``: copies into fast-tier slots;
calling it runs them and returns the bytes moved) and returns a ticket; ``wait(ticket)`` makes
compute wait for it and returns the host seconds that took (the stall); ``done(ticket)``
polls; ``record_free()`` marks the point in compute after which a slot's old contents are no
longer read (``after=``, a list, of the next job that overwrites the slot). On-demand jobs go
before queued prefetches.

- ``ThreadEngine`` (CPU): a worker thread is the copy engine for prefetches, a
  ``concurrent.futures.Future`` is the ticket. On-demand reads run on the caller's thread by
  default (``inline_demand``): compute waits for them anyway, and handing one to a worker costs
  two GIL handoffs, each a scheduling latency on a busy CPU. Compute runs on the caller's thread
  and is synchronous, so a slot is free once ``release`` returns: ``record_free`` has nothing to
  record. Disk reads and tensor copies release the GIL, so the worker's reads overlap the caller's
  matmuls.
- ``NativeEngine`` (CPU, disk tier): C++ reader threads (``leapfx.kernels.cpu_reader``) that never
  take the GIL, several reads in flight (demand reads ahead of prefetch reads). On-demand reads go
  to the workers too, and compute spins until they land: a computing thread that blocks in a read
  of its own sleeps, and on the project's 2-core KVM guest it woke late. The gain needs
  ``OffloadOptions.reader_cpu``'s polling worker on the other core (docs/benchmarks.md, "Why the
  defaults"). ``inline_demand=True`` reads them on the caller's thread instead (the caller reads
  one, idle workers the others). A Python worker takes the GIL back after every read and the
  computing thread's torch calls hand it over, a context switch each, which made prefetching cost
  more than it saved. Its jobs are data, not code: a ``ReadJob``'s reads as ``DiskStore``
  describes them (fd, offset, slot addresses; ``direct_read``), one ``preadv`` each. The ticket
  keeps the job's slot views alive until the job is taken; per-read start and end times
  (CLOCK_MONOTONIC, ``time.perf_counter``'s clock on Linux) reach the trace when it is.
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
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..kernels import cpu_reader

Job = Callable[[], int]


@dataclass
class ReadJob:
    """One transfer job: load ``reads`` (expert, gate_up slot view, down slot view) of ``layer``
    from ``store``. Python engines call it; ``NativeEngine`` takes its reads as data.
    ``trace``: where the reads' (lane, layer, expert, start s, end s) spans go, if anywhere."""

    store: Any  # a DiskStore or HostStore
    layer: int
    reads: list[tuple[int, torch.Tensor, torch.Tensor]]
    lane: str  # "demand" or "prefetch"
    trace: list | None = None

    def __call__(self) -> int:
        moved = 0
        for expert, gate_up, down in self.reads:
            start = time.perf_counter()
            moved += self.store.read_into(self.layer, expert, gate_up, down)
            if self.trace is not None:
                self.trace.append((self.lane, self.layer, expert, start, time.perf_counter()))
        return moved

    def spec(self) -> list[int] | None:
        """The reads flattened for ``leapfx_cpu.Reader`` (``cpu_reader.cpp`` spells it out),
        or None if one of them cannot go straight into its slot."""
        out: list[int] = []
        for expert, gate_up, down in self.reads:
            read = self.store.direct_read(self.layer, expert, gate_up, down)
            if read is None:
                return None
            out += [self.layer, expert, read.fd, read.offset, read.nbytes, read.convert,
                    len(read.buffers)]  # fmt: skip
            for address, nbytes in read.buffers:
                out += [address, nbytes]
        return out

    def record(self, times_ns: list[int]) -> None:
        """Trace the reads that ran, from their [start, end, ...] monotonic nanoseconds."""
        if self.trace is None:
            return
        # A failed job timed the reads up to the failing one: strict=False.
        ran = zip(self.reads, times_ns[::2], times_ns[1::2], strict=False)
        for (expert, _, _), start, end in ran:
            self.trace.append((self.lane, self.layer, expert, start * 1e-9, end * 1e-9))


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


class _Ticket:
    """A NativeEngine job: the reader's ticket, the job (its views keep the slots' memory
    alive) until taken, then the outcome."""

    __slots__ = ("error", "id", "inline_s", "job")

    def __init__(self, ticket: int, job: ReadJob, inline_s: float = 0.0) -> None:
        self.id, self.job, self.inline_s, self.error = ticket, job, inline_s, ""


class NativeEngine:
    """``leapfx_cpu.Reader``'s C++ workers as copy engines (``ThreadEngine``'s demand-first
    order, without the GIL): ``workers`` reads in flight at most, a job's reads side by side.
    Runs ``ReadJob``s whose every read goes straight into its slot (``DiskStore.direct_read``);
    ``delay_s`` sleeps before every read. ``cpu`` >= 0 runs the workers on that CPU, where one
    idle worker polls for reads up to ``idle_spin_s`` before it sleeps."""

    def __init__(
        self, *, delay_s: float = 0.0, inline_demand: bool = False,
        workers: int = cpu_reader.WORKERS, spin_s: float = cpu_reader.SPIN_S,
        idle_spin_s: float = 0.0, cpu: int = -1,
    ) -> None:  # fmt: skip
        if not cpu_reader.available():
            raise RuntimeError("NativeEngine: the leapfx_cpu reader did not build (see above)")
        self.inline_demand = inline_demand
        self._reader = cpu_reader.reader(delay_s, workers, spin_s, idle_spin_s, cpu)
        self._inflight: dict[int, _Ticket] = {}  # not taken yet: their views must stay alive

    @property
    def busy_seconds(self) -> float:
        return self._reader.busy_seconds()

    def submit(self, job: Job, *, demand: bool, after: list | None = None) -> _Ticket:
        spec = job.spec() if isinstance(job, ReadJob) else None
        if spec is None:
            raise TypeError(
                "NativeEngine runs ReadJobs whose reads go straight into their slots (a "
                "DiskStore with aligned, unpadded slots); use ThreadEngine for other jobs"
            )
        if demand and self.inline_demand:
            start = time.perf_counter()
            ticket = _Ticket(self._reader.run(spec), job)
            # Compute waited for this read as it ran: the first ``wait`` reports it as stall.
            ticket.inline_s = time.perf_counter() - start
        else:
            ticket = _Ticket(self._reader.submit(demand, spec), job)
        self._inflight[ticket.id] = ticket
        return ticket

    def _take(self, ticket: _Ticket) -> None:
        moved, ticket.error, times = self._reader.take(ticket.id)
        ticket.job.record(times)
        ticket.job = None
        del self._inflight[ticket.id]

    def wait(self, ticket: _Ticket) -> float:
        stalled, ticket.inline_s = ticket.inline_s, 0.0
        if ticket.job is not None:
            if not self._reader.done(ticket.id):
                start = time.perf_counter()
                self._reader.wait(ticket.id)  # the GIL is released while it blocks
                stalled = time.perf_counter() - start
            self._take(ticket)
        if ticket.error:
            raise OSError(f"offload: transfer failed: {ticket.error}")
        return stalled

    def done(self, ticket: _Ticket) -> bool:
        return ticket.job is None or self._reader.done(ticket.id)

    def record_free(self) -> None:
        return None  # compute is synchronous on the caller's thread (as with ThreadEngine)

    def close(self) -> None:
        """Stop the workers after the jobs already queued."""
        self._reader.close()
        for ticket in list(self._inflight.values()):
            self._take(ticket)

    def __del__(self) -> None:
        # Join the workers before the jobs' views (the slots' memory) can be freed.
        reader = getattr(self, "_reader", None)
        if reader is None:
            return
        try:
            reader.close()
        except ImportError:
            # Interpreter shutdown: torch can no longer call methods. The Reader's destructor
            # joins the workers instead; it runs first, as ``_reader`` was set before
            # ``_inflight``, and an instance's attributes are released in that order.
            pass


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
