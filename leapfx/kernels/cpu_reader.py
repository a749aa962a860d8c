"""The disk tier's reader as a C++ extension: expert reads on threads that never take the GIL.

``Reader(delay_ns, workers, spin_ns, idle_spin_ns, cpu)`` (the extension's class) owns
``workers`` threads (``std::thread``, on CPU ``cpu`` unless it is -1) and two queues of reads,
demand ahead of prefetch. A job is data, a list of reads, each ``(layer, expert, fd, file
offset, expected bytes, convert, [(destination pointer, bytes), ...])``, and each read is one
``preadv`` straight into the slot's memory (``convert`` 1 or 2: a record of float16 or
bfloat16 values, read into the thread's own buffer and widened to float32 into the slot);
the reads of a job run side by side, up to
``workers`` in flight (the project's VM reads a 192 KiB expert with ``O_DIRECT`` at 1.0-1.7
GB/s one at a time and 1.3-2.9 GB/s eight at a time, depending on the hour: its disk does not
always run reads side by side; ``examples/disk_reads.py`` measures a disk). A ``submit`` wakes
one worker at most, and a worker that takes a read with more queued wakes the next. A ``wait``
spins up to ``spin_ns`` before it sleeps; an idle worker polls for reads up to
``idle_spin_ns`` before it sleeps.
``cpu_reader.cpp`` says how a job is spelled and what each method does. The offload
runtime's ``NativeEngine`` drives it.

Why: a Python worker thread doing the same reads made every torch call of the computing thread
~1.5x slower while it prefetched (each torch op releases the GIL and hands it to the waiting
worker, a context switch each time), so prefetching cost more than it saved.

=================================  ==============================================================
call                               what
=================================  ==============================================================
``reader.submit(demand, spec)``    queue a job, return its ticket (an int)
``reader.run(spec)``               the job now (the calling thread reads the first read, idle
                                   workers the others); a done ticket
``reader.done(ticket)``            a poll
``reader.wait(ticket)``            block until done
``reader.take(ticket)``            ``(bytes, error or "", [start, end] ns per read)``, once
=================================  ==============================================================

``wait``, ``run`` and ``close`` release the GIL, so they block only their own thread, and
the workers never touch a Python object. A pybind11 module, not a torch custom class: a call
through ``torch.classes`` cost about 2 us more (``cpu_reader.cpp``). Built like
:mod:`leapfx.kernels.cpu`'s kernels (its own extension, first use).
"""

from __future__ import annotations

import functools
from pathlib import Path

from . import cpu

SOURCE = Path(__file__).with_name("cpu_reader.cpp")


@functools.cache
def _module():
    """The built extension module (built on the first call), or None where it cannot be
    built (one warning)."""
    module = cpu.load_extension(
        "reader", SOURCE, "the offload runtime reads on a Python thread", python_module=True
    )
    return module or None


def available() -> bool:
    """True once the extension's ``Reader`` is built and loaded (built on the first call);
    False, with one warning, where it cannot be built."""
    return _module() is not None


WORKERS = 4  # reads in flight: the local disk's throughput barely grows past 4 (~2.1 GB/s at 8)


SPIN_S = 5e-3  # how long ``wait`` spins before it sleeps (a read takes ~0.1-0.3 ms)


def reader(
    delay_s: float = 0.0,
    workers: int = WORKERS,
    spin_s: float = SPIN_S,
    idle_spin_s: float = 0.0,
    cpu: int = -1,
):
    """A new ``leapfx_cpu.Reader`` with ``workers`` reading threads whose ``wait`` spins up to
    ``spin_s`` before it sleeps (``delay_s``: a sleep before every read, for tests). One idle
    worker at a time polls for reads up to ``idle_spin_s`` before it sleeps; ``cpu`` >= 0 runs
    the workers on that CPU (``cpu_reader.cpp`` says why both).

    >>> r = reader(); t = r.submit(False, []); r.wait(t)
    >>> r.take(t)
    (0, '', [])
    """
    assert available(), "cpu_reader.available() is False"
    return _module().Reader(
        int(delay_s * 1e9), int(workers), int(spin_s * 1e9), int(idle_spin_s * 1e9), int(cpu)
    )
