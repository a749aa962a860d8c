"""How fast does the disk tier read experts? The native reader, 1..N experts at once.

    python examples/disk_reads.py                       # 192 KiB experts, a temp file in /tmp
    python examples/disk_reads.py --expert-kib 384 --dir /data --repeats 300

Writes a file of random experts (``--experts`` records of ``--expert-kib`` KiB) in ``--dir``,
then times jobs of k expert reads (k = 1, 2, 3, 4, 6, 8 at random offsets) submitted to
``leapfx_cpu.Reader`` as the offload runtime's disk tier does (O_DIRECT, straight into aligned
slots, on-demand reads, the reading threads on the last CPU with one polling between reads
where a CPU is free for them). It prints the median time from submit to done per job size and
the throughput it implies. The file is removed at the end. On a disk whose reads do not run side
by side, k experts take k times as long as one: then the bytes a prefetch policy moves per
token, wasted ones included, cost as much as on-demand reads do.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

from leapfx.kernels import cpu_reader
from leapfx.offload.runtime import IDLE_SPIN_S, reader_cpu
from leapfx.offload.store import ALIGN, aligned_pool

SIZES = (1, 2, 3, 4, 6, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--expert-kib", type=int, default=192, help="bytes per expert / 1024")
    parser.add_argument("--experts", type=int, default=1200, help="experts in the file")
    parser.add_argument("--repeats", type=int, default=150, help="jobs timed per job size")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file goes")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads, as the decoding would use (the readers get a CPU they leave free)",
    )  # fmt: skip
    args = parser.parse_args()
    record = args.expert_kib * 1024
    if args.expert_kib < 4 or record % ALIGN:
        parser.error(f"--expert-kib: {args.expert_kib} is invalid; allowed: a multiple of 4")
    if args.experts < max(SIZES):
        parser.error(f"--experts: {args.experts} is invalid; allowed: >= {max(SIZES)}")
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} is invalid; allowed: >= 1")
    if args.threads < 1:
        parser.error(f"--threads: {args.threads} is invalid; allowed: >= 1")
    torch.set_num_threads(args.threads)
    if not cpu_reader.available():
        sys.exit("the leapfx_cpu reader extension did not build (see the warning above)")
    fd, path = tempfile.mkstemp(prefix="leapfx-disk-reads-", dir=args.dir)
    try:
        chunk = os.urandom(record)
        for _ in range(args.experts):
            os.write(fd, chunk)
        os.fsync(fd)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        _time(fd, record, args)
    finally:
        os.close(fd)
        os.unlink(path)


def _time(fd: int, record: int, args: argparse.Namespace) -> None:
    slots = aligned_pool((max(SIZES), record // 4), torch.float32, 0.0)
    base = slots.data_ptr()
    cpu = reader_cpu("auto")
    reader = cpu_reader.reader(idle_spin_s=IDLE_SPIN_S if cpu is not None else 0.0,
                               cpu=-1 if cpu is None else cpu)  # fmt: skip
    rng = random.Random(0)
    print(f"{record // 1024} KiB experts, O_DIRECT, reading threads on CPU "
          f"{'any' if cpu is None else cpu}; median of {args.repeats} jobs")  # fmt: skip
    print(f"{'experts':>8s}{'us/job':>10s}{'GB/s':>8s}")
    try:
        for k in SIZES:
            took = []
            for _ in range(args.repeats):
                spec = []
                for j in range(k):  # [layer, expert, fd, offset, bytes, convert, n, ptr, bytes]
                    offset = rng.randrange(args.experts) * record
                    spec += [0, j, fd, offset, record, 0, 1, base + j * record, record]
                time.sleep(5e-4)  # a decode step's gap between reads
                start = time.perf_counter()
                ticket = reader.submit(True, spec)
                reader.wait(ticket)
                took.append(time.perf_counter() - start)
                moved, error, _ = reader.take(ticket)
                if error:
                    sys.exit(error)
            median = statistics.median(took)
            print(f"{k:8d}{median * 1e6:10.0f}{k * record / median / 1e9:8.2f}")
    finally:
        reader.close()


if __name__ == "__main__":
    main()
