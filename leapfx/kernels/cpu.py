"""Small-M float32 matrix products for CPU decoding, as C++ custom ops (``leapfx_cpu::*``).

A decode step multiplies one row and a verify pass ``d + 1`` rows by every weight matrix. On a
CPU, MKL's products cost about linearly in the rows at these sizes: on a 2-core x86 CPU a
5 x 192 by 192 x 512 product takes ~35 us against ~11 us for one row, so a verify pass costs far
more than the one step that the speculative-decoding speedup formula charges for it. The kernels
in ``cpu_gemm.cpp`` read each weight once for up to six rows (~15 us for those five rows, ~11
for one, on a 2-core AMD EPYC), and compute each row with the same operations whatever the
number of rows. Over more rows (a batch's step or verify, a prefill) they run six at a time
over a few column blocks whose weights stay in the core's cache, so the weights still come from
memory once (SmolLM2's 49,152 x 576 head over 16 rows: 8.7 ms, against 13.9 reading it once
per six rows). On a 2-core Intel Xeon with AVX-512 (one thread, warm weights, a 192 x 1024
weight) they take 8.8 us for one row against MKL's 14.4, and 18.7 us for five against 22.6;
there the AVX-512 registers and several column blocks at once for few rows matter, and a
non-temporal prefetch had made every product 2.5-4x slower (see ``cpu_gemm.cpp``).

=============================  ==================================================================
op                             signature
=============================  ==================================================================
``leapfx_cpu::small_mm``       ``(x [..., K] float32, wp, n) -> [..., n]``: ``x @ W.T`` for the
                               ``[n, K]`` weight ``W`` packed as ``wp = pack_weight(W)``
``leapfx_cpu::gated_mlp``      ``(x [..., K], pack_weight(cat([gate, up])), 2I,
                               pack_weight(down), K) -> [..., K]``:
                               ``down(silu(x @ gate.T) * (x @ up.T))`` in one call
=============================  ==================================================================

The extension is built on first use with the machine's C++ compiler (``-O3 -march=native``;
about half a minute, then cached by ``torch.utils.cpp_extension`` under a name that includes
this CPU's model, so a cache shared between different machines does not reuse a build made for
another CPU). :func:`available` says whether it built; when it cannot, callers fall back to
``torch.matmul``. A machine without the build's tools (a C++ compiler, ninja) gets one warning
naming what is missing, for all of leapfx's kernel extensions together (:func:`missing_tools`);
a build that fails otherwise is logged once per extension.

Both ops have fake implementations, so ``torch.compile(fullgraph=True)`` keeps each as one
node; with Inductor's C++ wrapper each is one dispatcher call.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemm.cpp")
VEC_HEADER = Path(__file__).with_name("cpu_vec.h")  # register types, dot, RMSNorm
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast")
# at::parallel_for is inline OpenMP code in ATen's headers (torch's CPU build uses OpenMP);
# compiled without -fopenmp, every parallel_for of the kernels runs on one thread. Linked
# against libgomp.so.1, which is torch's own already-loaded copy: one OpenMP runtime. A
# compiler without OpenMP builds the kernels without it (single-threaded, still correct).
OPENMP = "-fopenmp"


def _cpu_tag() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                model += line
    except OSError:
        pass
    return hashlib.sha256(model.encode()).hexdigest()[:10]


@functools.cache
def available() -> bool:
    """True once the ``leapfx_cpu`` ops are built and registered (built on the first call)."""
    return load_ops("gemm", "small_mm", "using torch.matmul", _register_fakes)


def load_ops(stem: str, op: str, fallback: str, register_fakes: Callable[[], None]) -> bool:
    """What every op extension's ``available()`` does: True at once where ``leapfx_cpu::<op>``
    is registered already; else build and load ``cpu_<stem>.cpp`` (beside this module; see
    :func:`load_extension`, with the vector header ``cpu_vec.h``), then ``register_fakes()``
    (the ops' fake implementations, for ``torch.compile``). False where it cannot be built
    (``fallback``: what callers do then, for the warning)."""
    if hasattr(torch.ops, "leapfx_cpu") and hasattr(torch.ops.leapfx_cpu, op):
        return True
    source = Path(__file__).with_name(f"cpu_{stem}.cpp")
    if not load_extension(stem, source, fallback, (VEC_HEADER,)):
        return False
    register_fakes()
    return True


def load_extension(
    stem: str, source: Path, fallback: str, headers: tuple[Path, ...] = (), *,
    python_module: bool = False,
) -> bool | types.ModuleType:  # fmt: skip
    """Build (first use only) and load ``source`` as the extension ``leapfx_cpu_<stem>``.

    Each source is its own extension, so that a build of one does not invalidate the
    other's. ``headers``: the local headers ``source`` includes; torch rebuilds when a source
    changes but does not look at headers, so their contents go into the extension's name.
    ``python_module``: ``source`` defines a pybind11 module (``PYBIND11_MODULE``), returned;
    otherwise it registers torch ops, and True is returned. False when it cannot be built:
    without a compiler or ninja (and no cached build) with the one warning of
    :func:`missing_tools` for every extension; after a build error with a warning naming
    ``fallback``, what callers do instead.
    """
    try:
        from torch.utils import cpp_extension

        name = f"leapfx_cpu_{stem}_{_cpu_tag()}"
        if headers:
            digest = hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()
            name += f"_{digest[:8]}"
        if not _built(name) and missing_tools() is not None:  # a cached build needs no tools
            _warn_missing_tools(missing_tools())
            return False
        if not _built(name):  # the one slow step: say so (cached afterwards)
            print("leapfx: building the CPU kernels (first use only, ~1 min)...", file=sys.stderr)
        serial = f"{name}_serial"
        kind = {"python_module": python_module}
        if _built(serial) and not _built(name):  # OpenMP failed on this machine before
            module = _build(cpp_extension, serial, source, openmp=False, **kind)
        else:
            try:
                module = _build(cpp_extension, name, source, openmp=True, **kind)
            except Exception as exc:
                log.info("leapfx CPU kernels (%s) without OpenMP: %s", source.name, exc)
                module = _build(cpp_extension, serial, source, openmp=False, **kind)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("leapfx CPU kernels (%s) unavailable (%s): %s", source.name, fallback, first)
        return False
    return module if python_module else True


@functools.cache
def missing_tools() -> str | None:
    """What this machine lacks to build the kernels, in words, or None: a C++ compiler
    (``$CXX``, else ``c++``, as ``torch.utils.cpp_extension`` uses) or ninja."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "no ninja (pip install ninja)"
    return None


@functools.cache  # one warning, whichever extension asks first
def _warn_missing_tools(missing: str) -> None:
    log.warning(
        "leapfx CPU kernels unavailable: %s; leapfx runs torch's path instead (torch.matmul, "
        "SDPA): same tokens, slower on a CPU", missing,
    )  # fmt: skip


def resolve(
    setting: bool | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    option: str = "cpu_kernels",
    on: str = "True",
    allowed: str = "False or None",
) -> bool:
    """Whether to use the kernels for a model on ``device`` in ``dtype``.

    ``setting`` None: where they apply (float32 on a CPU) and build; True: required
    (ValueError naming ``option``, spelled ``on``, when they cannot be used); False: never.
    """
    if setting is False:
        return False
    fits = device.type == "cpu" and dtype == torch.float32
    if setting is None:
        return fits and available()
    if not fits:
        raise ValueError(
            f"{option}: {on} needs a CPU model in float32; this one is on {device} in {dtype} "
            f"(allowed there: {allowed})"
        )
    if not available():
        raise ValueError(
            f"{option}: {on} but the leapfx_cpu kernels did not build here (see the warning "
            f"above; allowed: {allowed}, which fall back to torch.matmul)"
        )
    return True


# A build here takes about a minute; torch's lock file older than this was left by a build that
# was killed (Ctrl-C, OOM), and torch would wait on it forever.
STALE_LOCK_S = 900.0


def _build(cpp_extension, name: str, source: Path, *, openmp: bool, python_module: bool = False):
    _clear_stale_lock(name)
    return cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=[*FLAGS, OPENMP] if openmp else list(FLAGS),
        extra_ldflags=[OPENMP] if openmp else [],
        is_python_module=python_module,
        verbose=False,
    )


def _built(name: str) -> bool:
    """Whether torch's extension cache already holds a build of ``name`` (best effort)."""
    try:
        from torch.utils import cpp_extension

        folder = cpp_extension._get_build_directory(name, verbose=False)  # private: may change
        return Path(folder, f"{name}.so").is_file()
    except Exception:
        return False


def _clear_stale_lock(name: str, stale_s: float = STALE_LOCK_S) -> None:
    """Remove the build lock of ``name`` that a killed build left (older than ``stale_s``),
    with a warning; a younger one may be another process's build: say what is waited on."""
    try:
        from torch.utils import cpp_extension

        lock = Path(cpp_extension._get_build_directory(name, verbose=False), "lock")  # private
        age = time.time() - lock.stat().st_mtime
    except Exception:  # no lock (the usual case), or torch moved its build directory
        return
    if age > stale_s:
        log.warning("leapfx: removing %s, a lock %.0f s old left by a killed build", lock, age)
        lock.unlink(missing_ok=True)
    else:
        print(
            f"leapfx: waiting for another process's build of {name} (lock {lock}, {age:.0f} s "
            "old); if none is running, delete that file",
            file=sys.stderr,
        )


def _register_fakes() -> None:
    @torch.library.register_fake("leapfx_cpu::small_mm")
    def _small_mm_fake(x: torch.Tensor, wp: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], n))

    @torch.library.register_fake("leapfx_cpu::gated_mlp")
    def _gated_mlp_fake(x, w_gate_up, i2: int, w_down, k_out: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], k_out))

    @torch.library.register_fake("leapfx_cpu::rms_norm")
    def _rms_norm_fake(x, w, eps: float, offset: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("leapfx_cpu::rope")
    def _rope_fake(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("leapfx_cpu::moe_experts")
    def _moe_experts_fake(x, index, weights, gate_up, down) -> torch.Tensor:
        return x.new_empty(x.shape)


BLOCK = 16  # output columns per block of a packed weight


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's ``[N, K]`` weight packed for the kernels: ``[ceil(N/16), K, 16]``.

    Block ``b`` holds output columns ``16b .. 16b+15`` (zeros past ``N``) for every input
    ``k``, so that the kernel reads each block as one sequential stream.

    >>> pack_weight(torch.ones(20, 3)).shape
    torch.Size([2, 3, 16])
    """
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, k)
    padded[:n] = weight.detach()
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def small_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without bias) through the kernel (float32, CPU).

    Packs ``weight`` on every call: for tests and one-off use; modules keep a packed copy.
    """
    if not available():
        return torch.matmul(x, weight.t())
    return torch.ops.leapfx_cpu.small_mm(x, pack_weight(weight), weight.shape[0])


def gated_mlp(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """``down(silu(x @ gate.T) * (x @ up.T))`` from ``[out, in]`` weights (packs per call)."""
    if not available():
        h = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
        return h @ down.t()
    return torch.ops.leapfx_cpu.gated_mlp(
        x, pack_weight(torch.cat([gate, up])), 2 * gate.shape[0], pack_weight(down),
        down.shape[0],
    )  # fmt: skip
