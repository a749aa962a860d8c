"""Slow tiers: where every expert lives while it is not in a fast-tier slot.

An expert of a transformers-5 MoE layer is two contiguous slices, ``gate_up_proj[e]``
``[2I, H]`` and ``down_proj[e]`` ``[H, I]``; a store copies both into a slot's two views.

- ``DiskStore`` (the CPU's slow tier): every expert of every offloaded layer in one file, one
  record per expert (gate_up, then down, each padded to 4 KiB), read with ``O_DIRECT`` so that
  the page cache does not turn the disk into a second RAM tier. Filesystems that refuse
  ``O_DIRECT`` (tmpfs) fall back to buffered reads with a warning. The file is written to a
  temporary name, then renamed (under a progress bar from 1 GiB on, where stderr is a
  terminal). A file at a given path is kept, with a manifest (``<path>.json``) where the experts
  came from a checkpoint (``checkpoint.CheckpointExperts``: its files' sizes and modification
  times, the keys, the dtypes); the next store of the same experts reads it as it is. Where a
  record needs no padding and the slot's two views are block-aligned (``aligned_pool`` makes
  them so), one ``preadv`` reads the record straight into them: no bounce buffer, no copies,
  one GIL release and reacquire on the reading thread (a read through the bounce buffer takes
  the GIL a dozen times, each a handoff with the computing thread, whose torch calls release
  it too).
- ``HostStore``: the experts in host memory; pinned copies when the fast tier is on a GPU (the
  copy engine reads pinned memory at full speed, pageable at a third), or the model's own
  tensors on a CPU (a fast store for tests: no copy is made).

``read_into`` runs on the transfer engine (a worker thread on a CPU, a copy stream on CUDA).
``direct_read`` describes the same direct read as data (file descriptor, offset, destination
addresses) for a reader that runs outside Python (``NativeEngine``); None where the read needs
the bounce buffer or there is no file (``HostStore``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ..files import write_atomic, write_text_atomic

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the logical block size
PROGRESS_BYTES = 1 << 30  # a disk tier this large is written under a progress bar


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aligned_pool(shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` filled with ``fill`` whose storage starts on an
    ``ALIGN`` boundary (torch's allocator aligns to 64 bytes), so that a slot ``pool[s]`` whose
    size is a multiple of ``ALIGN`` is a valid ``O_DIRECT`` target."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    pool = raw[skip : skip + nbytes].view(dtype).view(shape)
    return pool.fill_(fill)


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0 and _nbytes(t) % ALIGN == 0


# DirectRead.convert: 0, the record as it is; 1 or 2, float16 or bfloat16 widened to float32
CONVERT = {None: 0, torch.float16: 1, torch.bfloat16: 2}
# The file dtypes a DiskStore may narrow float32 experts to (OffloadOptions.slow_dtype)
NARROW = (torch.float16, torch.bfloat16)


class DirectRead(NamedTuple):
    """One expert's record read straight into a slot: ``preadv(fd, buffers, offset)`` must
    return ``nbytes``. ``buffers``: (address, bytes) of the slot's gate_up and down views,
    valid while those tensors live. ``convert`` (``CONVERT``): 0, the bytes as they are; 1 or
    2, a record of float16 or bfloat16 values read through a buffer and widened to float32
    into the views (each view takes bytes / 2 of the record, in order)."""

    fd: int
    offset: int
    nbytes: int
    buffers: tuple[tuple[int, int], ...]
    convert: int = 0


def narrowest_exact(layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.dtype | None:
    """The first of ``NARROW`` that holds every one of ``layers``' float32 experts exactly
    (a float16 checkpoint computed in float32, say), or None. Checked an expert at a time (the
    experts may be ``CheckpointExperts`` read from a checkpoint)."""
    pairs = list(layers.values())
    if any(t.dtype != torch.float32 for pair in pairs for t in pair):
        return None
    candidates = list(NARROW)
    for pair in pairs:
        for t in pair:
            candidates = [d for d in candidates if _holds(t, d)]
            if not candidates:
                return None
    return candidates[0]


def _holds(t, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds every expert of ``t`` exactly: known without reading for
    experts a checkpoint stores in ``dtype`` (``CheckpointExperts.stored_dtype``), else checked
    an expert at a time."""
    if getattr(t, "stored_dtype", None) == dtype:
        return True
    return all(_exact(t[e], dtype) for e in range(t.shape[0]))


def _exact(t: torch.Tensor, dtype: torch.dtype) -> bool:
    with torch.no_grad():
        return bool(torch.equal(t.detach().to(dtype).to(t.dtype), t.detach()))


def _held(t) -> torch.Tensor:
    """A [E, ...] tensor of ``t``'s experts: ``t`` itself, or a ``CheckpointExperts`` read."""
    return t.detach() if isinstance(t, torch.Tensor) else t.materialize()


class HostStore:
    """Experts in host memory (pinned when ``pin``); ``read_into`` is one copy per slice."""

    kind = "host"

    def __init__(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]], *, pin: bool):
        # layers: layer -> (gate_up_proj [E, 2I, H], down_proj [E, H, I])
        self.layers = {
            i: tuple(_held(t).cpu().pin_memory() if pin else _held(t) for t in pair)
            for i, pair in layers.items()
        }
        self.pinned = pin
        first_gate_up, first_down = next(iter(self.layers.values()))
        self.expert_bytes = _nbytes(first_gate_up[0]) + _nbytes(first_down[0])

    def read_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        src_gate_up, src_down = self.layers[layer]
        gate_up.copy_(src_gate_up[expert], non_blocking=self.pinned)
        down.copy_(src_down[expert], non_blocking=self.pinned)
        return _nbytes(gate_up) + _nbytes(down)

    def direct_read(self, layer: int, expert: int, gate_up, down) -> DirectRead | None:
        return None  # host memory: nothing to read from a file

    def close(self) -> None:
        self.layers = {}


class DiskStore:
    """Experts in one file on disk, read with O_DIRECT where the filesystem allows it."""

    kind = "disk"

    def __init__(
        self,
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]],
        path: str | os.PathLike | None = None,
        *,
        direct_io: bool = True,
        file_dtype: torch.dtype | str | None = None,
    ) -> None:
        first_gate_up, first_down = next(iter(layers.values()))
        self._shapes = (tuple(first_gate_up.shape[1:]), tuple(first_down.shape[1:]))
        self.dtype = first_gate_up.dtype  # the slots' (compute) dtype
        # The file's dtype: the experts' own, or one of NARROW that holds them exactly
        # (half the bytes to read; widened back to float32 as they are read); "auto": the
        # first of NARROW that does (checked there), else the experts' own.
        checked = file_dtype == "auto"
        if checked:
            file_dtype = narrowest_exact(layers)
        self.file_dtype = file_dtype or self.dtype
        if self.file_dtype != self.dtype and not checked:
            if self.dtype != torch.float32 or self.file_dtype not in NARROW:
                raise ValueError(
                    f"slow_dtype: {self.file_dtype} under {self.dtype} experts is invalid; "
                    "allowed: float16 or bfloat16 under float32 experts, or None"
                )
            for i, pair in layers.items():
                if not all(_holds(t, self.file_dtype) for t in pair):
                    raise ValueError(
                        f"slow_dtype: {self.file_dtype} does not hold the experts of layer {i} "
                        "exactly (narrowing would change the model's outputs); allowed: None, "
                        "'auto' (narrow only where exact), or a dtype that holds them exactly"
                    )
        wide, narrow = self.dtype.itemsize, self.file_dtype.itemsize
        self._slot_sizes = tuple(math.prod(t.shape[1:]) * wide for t in (first_gate_up, first_down))
        self._sizes = tuple(size // wide * narrow for size in self._slot_sizes)  # in the file
        self.expert_bytes = sum(self._sizes)  # what reading one expert moves
        self.record = _padded(self._sizes[0]) + _padded(self._sizes[1])
        self._owned = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix="leapfx-experts-", suffix=".bin")
            os.close(fd)
        self.path = os.fspath(path)
        self._offsets: dict[tuple[int, int], int] = {}
        for i, (gate_up, _) in sorted(layers.items()):
            for e in range(gate_up.shape[0]):
                self._offsets[(i, e)] = len(self._offsets) * self.record
        # A given path is reused when its manifest says it was written from the same checkpoint
        # files (experts that know their ``fingerprint``: load_offloaded) in the same layout.
        manifest = None if self._owned else self._manifest(layers)
        self.reused = manifest is not None and self._written(manifest)
        if self.reused:
            log.info("offload: reusing the disk tier %s (written from the same checkpoint)",
                     self.path)  # fmt: skip
        else:
            with contextlib.suppress(FileNotFoundError):  # first: it describes the old file
                os.unlink(self.manifest_path)
            self._write(layers)
            if manifest is not None:
                write_text_atomic(self.manifest_path, json.dumps(manifest))
        self.direct = False
        self._fd = self._open(direct_io)
        self._local = threading.local()  # one aligned bounce buffer per reading thread
        # Records without padding can be read straight into aligned slots (``_targets``).
        self._unpadded = all(size % ALIGN == 0 for size in self._sizes)
        self._iovecs: dict[tuple[int, int], list[memoryview]] = {}

    @property
    def manifest_path(self) -> str:
        return f"{self.path}.json"

    def _manifest(self, layers: dict[int, tuple]) -> dict | None:
        """What the file holds, for experts that say where they come from; else None."""
        if not all(hasattr(t, "fingerprint") for pair in layers.values() for t in pair):
            return None
        return {
            "format": 1,
            "file_dtype": str(self.file_dtype),
            "dtype": str(self.dtype),
            "record": self.record,
            "sizes": list(self._sizes),
            "layers": {str(i): [t.fingerprint() for t in pair] for i, pair in layers.items()},
            "bytes": len(self._offsets) * self.record,
        }

    def _written(self, manifest: dict) -> bool:
        """Whether ``path`` holds what ``manifest`` describes (its manifest equal, its size)."""
        try:
            with open(self.manifest_path) as f:
                old = json.load(f)
            return old == manifest and os.path.getsize(self.path) == manifest["bytes"]
        except (OSError, ValueError):
            return False

    def _write(self, layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        total = len(self._offsets) * self.record
        bar = None
        if total >= PROGRESS_BYTES:
            bar = tqdm(
                total=total, unit="B", unit_scale=True, desc="offload: disk tier", disable=None
            )  # fmt: skip (None: no bar where stderr is no terminal)

        def fill(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                for _, (gate_up, down) in sorted(layers.items()):
                    for e in range(gate_up.shape[0]):
                        for part in (gate_up[e], down[e]):
                            part = part.detach().to(self.file_dtype).contiguous().cpu()
                            raw = part.view(torch.uint8).numpy().tobytes()
                            f.write(raw + bytes(_padded(len(raw)) - len(raw)))
                        if bar is not None:
                            bar.update(self.record)
                f.flush()
                os.fsync(f.fileno())

        try:
            write_atomic(self.path, fill)
        finally:
            if bar is not None:
                bar.close()

    def _open(self, direct_io: bool) -> int:
        flag = getattr(os, "O_DIRECT", 0)
        if direct_io and flag:
            fd = None
            try:
                fd = os.open(self.path, os.O_RDONLY | flag)
                os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)  # some filesystems refuse only reads
                self.direct = True
                return fd
            except OSError as err:
                if fd is not None:
                    os.close(fd)
                warnings.warn(
                    f"offload: O_DIRECT is refused for {self.path} ({err.strerror}); the disk "
                    "tier reads through the page cache, which may make it as fast as RAM",
                    stacklevel=3,
                )
        elif direct_io:
            warnings.warn("offload: this platform has no O_DIRECT; buffered reads", stacklevel=3)
        return os.open(self.path, os.O_RDONLY)

    def _buffer(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, self.record)  # page-aligned
        return buf

    def direct_refusal(self, gate_up: torch.Tensor, down: torch.Tensor) -> str | None:
        """Why a direct read cannot fill the slot views ``gate_up``, ``down``; None if it can."""
        if not self._unpadded:
            return (
                f"the expert slices ({self._sizes[0]} and {self._sizes[1]} bytes) are not "
                f"multiples of {ALIGN} bytes, so records are padded and read through a buffer"
            )
        if not all(t.device.type == "cpu" and t.dtype == self.dtype for t in (gate_up, down)):
            return f"the slots are not CPU tensors of the experts' dtype {self.dtype}"
        if self.file_dtype != self.dtype:  # widened from a bounce buffer: any contiguous slot
            if not (gate_up.is_contiguous() and down.is_contiguous()):
                return "the slots are not contiguous"
        elif not (_aligned(gate_up) and _aligned(down)):
            return f"the slots are not contiguous and {ALIGN}-byte aligned"
        if (_nbytes(gate_up), _nbytes(down)) != self._slot_sizes:
            return "the slots' sizes differ from the file's expert slices"
        return None

    def _targets(self, gate_up: torch.Tensor, down: torch.Tensor) -> list[memoryview] | None:
        """The slot's two views as ``preadv`` buffers, or None where a direct read cannot fill
        them (padded records, unaligned or non-CPU views, a dtype other than the file's)."""
        if self.file_dtype != self.dtype:  # read through the bounce buffer, then widened
            return None
        key = (gate_up.data_ptr(), down.data_ptr())
        views = self._iovecs.get(key)
        if views is None:
            if self.direct_refusal(gate_up, down) is not None:
                return None
            # Byte views of the tensors' memory (they stay valid while the pool lives: the
            # runtime's pools outlive the store's reads).
            views = [memoryview(t.view(torch.uint8).numpy()) for t in (gate_up, down)]
            self._iovecs[key] = views
        return views

    def direct_read(
        self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor
    ) -> DirectRead | None:
        """``read_into``'s read as data for a reader outside Python (into the slot, or for a
        narrowed file through that reader's buffer, widened into the slot); None where it
        cannot (padded records, slots it cannot fill)."""
        offset = self._offsets[(layer, expert)]
        sizes = self._slot_sizes
        buffers = ((gate_up.data_ptr(), sizes[0]), (down.data_ptr(), sizes[1]))
        if self.file_dtype != self.dtype:
            if self.direct_refusal(gate_up, down) is not None:
                return None
            return DirectRead(self._fd, offset, self.record, buffers, CONVERT[self.file_dtype])
        if self._targets(gate_up, down) is None:
            return None
        return DirectRead(self._fd, offset, self.record, buffers)

    def read_into(self, layer: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        offset = self._offsets[(layer, expert)]
        targets = self._targets(gate_up, down)
        if targets is not None:  # one syscall into the slot itself
            n = os.preadv(self._fd, targets, offset)
            assert n == self.record, f"short read of expert {expert} of layer {layer}"
            return sum(self._sizes)
        buf = self._buffer()
        n = os.preadv(self._fd, [buf], offset)
        assert n == self.record, f"short read of expert {expert} of layer {layer}"
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        start = 0
        for dst, size, shape in zip((gate_up, down), self._sizes, self._shapes, strict=True):
            src = raw[start : start + size].view(self.file_dtype).view(shape)
            dst.copy_(src)  # widens a narrowed file's values (exactly)
            start += _padded(size)
        return sum(self._sizes)  # expert bytes moved (the padding is read, not counted)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self._owned and os.path.exists(self.path):
                os.unlink(self.path)

    def __del__(self) -> None:  # best effort: the temp file must not outlive the model
        try:
            self.close()
        except (OSError, AttributeError):
            pass
