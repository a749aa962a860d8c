"""Resident memory and load time, for the bench's ``--json`` (``load`` of each row).

>>> model, load = timed_load(lambda: load_model("smollm2"))
>>> sorted(load)
['resident_bytes', 'seconds']
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def resident_bytes() -> int | None:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def timed_load(load: Callable[[], T]) -> tuple[T, dict]:
    """``load()``, its wall time in seconds and the resident memory it added (None where the
    platform does not say)."""
    before = resident_bytes()
    start = time.perf_counter()
    out = load()
    seconds = time.perf_counter() - start
    after = resident_bytes()
    grown = None if before is None or after is None else after - before
    return out, {"seconds": seconds, "resident_bytes": grown}
