"""ExpertOffload: a fast tier of expert slots per MoE layer over a slow tier holding them all.

What an offloaded ``experts`` node does, per call (``run``)::

    ids   = unique(top_k_index)               # host sync: the router's choice, once per layer
    for wave in waves(ids, num_slots):        # one wave unless a call needs more than the slots
        place + pin each expert of the wave   # hits stay; misses load on demand, first in line
        wait for the wave's slots to be ready # stall: time compute waits for a transfer
        out += experts_forward(slots, slot_index, weights)   # HF's own experts function
        unpin (record the slots' free point)

``experts_forward`` is the HF module's own forward (eager / batched_mm / grouped_mm, whatever
``config._experts_implementation`` selects) called on a stand-in whose ``gate_up_proj`` and
``down_proj`` are the slot pools and whose expert ids are slot ids. Each (token, k) pair meets
the same weights in a group of the same size as in the resident model, and the top-k sum runs in
routing order, so with one wave the output is bitwise the resident model's (the tests check
it). A call that needs more distinct experts than there are slots (a long prefill, a verify
pass) runs in waves, the other waves' entries given the sentinel id and weight 0 (HF's
expert-parallel convention): the per-token sum then adds the waves' partial sums, which for
top_k <= 2 is still exact and otherwise equal up to rounding. (batched_mm computes the
sentinel entries too, from a clamped slot, times weight 0: finite slots give exact zeros; with
``poison`` on, use eager or grouped_mm.)

On a CPU, a call whose experts are all resident (a decode step's usual case) skips placing and
pinning: it waits for any of them still being read, counts them with ``SlotCache.hit`` (what
demand + release would count) and computes; nothing else places experts of the layer before
the synchronous compute returns.

Prefetch (``prefetch``, called by a ``next_gate`` node one MoE layer ahead): the predicted
experts, most probable first, are placed into free or evicted-unpinned slots and loaded at low
priority, within the byte budget of the call: ``prefetch_budget`` bytes per token (over all
MoE layers) / number of MoE layers * tokens in the call. Predictions are scored against the
next demand of that layer (precision, recall).

Past 600 lines on purpose: most of it is one class, :class:`ExpertOffload`, whose demand path,
prefetch, waves, pinning and counters all read and write the same state (each layer's
``SlotCache``, its slot pools, the transfers in flight); split across modules, each piece would
reach into the others' private state. The tiers (``slots``, ``store``) and the transfer engines
(``engine``) are modules of their own.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_reader
from ..modules.kernel_layers import experts_kernel_covers
from ..modules.moe import (  # the modules bound to this runtime, imported from here
    NextGatePrefetch,  # noqa: F401
    OffloadedExperts,  # noqa: F401
)
from ..options import check_bool, check_choice, check_int, check_number, is_int
from ..passes.offload import PREFETCH_POLICIES
from .checkpoint import expert_tensors
from .engine import CudaEngine, NativeEngine, ReadJob, ThreadEngine, TransferEngine
from .reuse import ReuseProbe
from .slots import POLICIES, Placement, SlotCache, SlotStats
from .store import DiskStore, HostStore, aligned_pool

log = logging.getLogger(__name__)

TIERS = ("auto", "disk", "host")
# CPU transfer engines: "native" (C++ reader threads, no GIL; the disk tier with direct reads
# into the slots), "thread" (Python worker threads, any slow tier); "auto": native where it
# applies and builds, else thread. A model on CUDA always uses CudaEngine ("auto" only).
ENGINES = ("auto", "native", "thread")
SLOW_DTYPES = (None, "auto", "float16", "bfloat16")  # OffloadOptions.slow_dtype
# OffloadOptions.prefetch_lead's default: a lead of 3 layers beat 2 and stayed near the best
# lead when reads were made slower (the measurements: docs/benchmarks.md, "a longer prefetch
# lead").
DEFAULT_PREFETCH_LEAD = 3


@dataclass(frozen=True)
class OffloadOptions:
    """How an MoE model's experts are offloaded (``rewrite.apply(..., offload=...)``).

    >>> sm = rewrite.apply(hf_model, "autoregressive",
    ...                    offload=OffloadOptions(slots=0.5, prefetch="next_gate"))
    >>> sm.generate(ids, max_new_tokens=32); sm.last_offload_report.hit_rate
    """

    # Fast-tier slots per MoE layer: a count (1..experts), or a fraction in (0, 1] of the
    # layer's experts, rounded up.
    slots: int | float = 0.5
    # Eviction: "lru", "lfu" or "reuse" (a learned order: needs ``reuse_probe``; see
    # slots.SlotCache and reuse.ReuseProbe).
    policy: str = "lru"
    prefetch: str = "none"  # "none" (on demand only), "next_gate", "m2r2" or "verify_union"
    # prefetch="m2r2": the fast stream's trained parts (``leapfx train-m2r2 --fast-layers N/2``,
    # a rate-2 stream); None: an untrained stream (the identity: it predicts from h^0).
    m2r2_parts: str | os.PathLike | None = None
    # Predictions made for every layer at a step's start (prefetch="m2r2"; the bench's oracle
    # row): layer L's loads start once the MoE layer ``prefetch_lead`` layers before L has
    # placed its own experts (at once where that is before the first MoE layer), so that they
    # do not queue ahead of the early layers' on-demand reads. None: all at the step's start.
    # A slower slow tier wants a longer lead (see DEFAULT_PREFETCH_LEAD).
    prefetch_lead: int | None = DEFAULT_PREFETCH_LEAD
    # Prefetch bytes per token over all MoE layers; None: top_k experts per layer and token
    # (as many bytes as the demand of a perfectly predicted token).
    prefetch_budget: int | None = None
    # Slow tier: "disk" (a file read with O_DIRECT), "host" (host memory, pinned for a GPU);
    # "auto": disk when the model runs on a CPU, host on a GPU.
    tier: str = "auto"
    # The disk tier's file; None: a temporary file, removed at close. A given file is kept,
    # and reused as it is when its manifest (``<path>.json``) says it was written from the
    # same checkpoint files (load_offloaded) in the same layout and dtype; else rewritten.
    path: str | os.PathLike | None = None
    direct_io: bool = True  # False: buffered reads (the page cache then serves repeats)
    # The disk tier's dtype for float32 experts: "float16" or "bfloat16" where it holds every
    # expert exactly (a float16 or bfloat16 checkpoint computed in float32): half the bytes
    # to read, widened back as they are read, decoding unchanged; "auto": the first of the
    # two that holds them exactly, else the experts' own dtype; None: the experts' own dtype.
    slow_dtype: str | None = None
    # Debugging aids for tests: fill a slot with NaN when it is reassigned (a compute that does
    # not wait for its load then reads NaN), and delay every transfer.
    poison: bool = False
    transfer_delay_s: float = 0.0
    engine: str = "auto"  # the CPU transfer engine: "auto", "native" or "thread" (ENGINES)
    # The native engine's reading threads: "auto" runs them on a CPU that torch's threads leave
    # free (the last CPU this process may use, when it may use more than
    # ``torch.get_num_threads()`` at ``rewrite.apply``), where one of them polls for work
    # between reads instead of sleeping; where no CPU is free, they run anywhere and sleep. An
    # int: that CPU, polling. None: anywhere, sleeping (a process that needs every CPU).
    reader_cpu: int | str | None = "auto"
    # torch's intra-op threads while the model decodes (``generate``; restored after) on a CPU:
    # "auto" leaves one CPU to the transfer engine's readers when torch's threads would take
    # every CPU this process may use (then ``torch.get_num_threads()`` is one less, and
    # ``reader_cpu="auto"`` finds that CPU free); an int: that many; None: torch's setting.
    # Compute threads on every core starve the readers, so decoding leaves them a CPU (the
    # measurements: docs/benchmarks.md, "decoding on one thread fewer"). Ignored on CUDA.
    compute_threads: int | str | None = "auto"
    # policy="reuse": the probe's file (``leapfx train-reuse-probe``) or a ReuseProbe.
    reuse_probe: str | os.PathLike | ReuseProbe | None = None

    def validate(self) -> OffloadOptions:
        s = self.slots
        ok_int = is_int(s) and s >= 1
        ok_frac = isinstance(s, float) and 0.0 < s <= 1.0
        if not (ok_int or ok_frac):
            raise ValueError(
                f"slots: {s!r} is invalid; allowed: an integer >= 1 (slots per MoE layer) or "
                "a float in (0, 1] (a fraction of each layer's experts)"
            )
        for name, value, allowed in (
            ("policy", self.policy, POLICIES),
            ("prefetch", self.prefetch, PREFETCH_POLICIES),
            ("tier", self.tier, TIERS),
            ("engine", self.engine, ENGINES),
            ("slow_dtype", self.slow_dtype, SLOW_DTYPES),
        ):
            check_choice(name, value, allowed)
        allowed = "None or an integer >= 0 (bytes per token)"
        check_int("prefetch_budget", self.prefetch_budget, 0, none=True, allowed=allowed)
        parts = self.m2r2_parts
        if parts is not None and not isinstance(parts, (str, os.PathLike)):
            raise ValueError(
                f"m2r2_parts: {parts!r} is invalid; allowed: None or a directory written by "
                "SpeculativeModel.save_parts (str or os.PathLike)"
            )
        if parts is not None and self.prefetch != "m2r2":
            raise ValueError(
                f"m2r2_parts: given with prefetch={self.prefetch!r}; allowed: only with "
                "prefetch='m2r2'"
            )
        allowed = "None (every load at the step's start) or an integer >= 1 (layers ahead of use)"
        check_int("prefetch_lead", self.prefetch_lead, 1, none=True, allowed=allowed)
        probe = self.reuse_probe
        if probe is not None and not isinstance(probe, (str, os.PathLike, ReuseProbe)):
            raise ValueError(
                f"reuse_probe: {probe!r} is invalid; allowed: None, a file written by leapfx "
                "train-reuse-probe (str or os.PathLike), or a ReuseProbe"
            )
        if (probe is None) != (self.policy != "reuse"):
            raise ValueError(
                f"reuse_probe: {'missing' if probe is None else 'given'} with policy="
                f"{self.policy!r}; allowed: a probe exactly when policy='reuse'"
            )
        for name in ("direct_io", "poison"):
            check_bool(name, getattr(self, name))
        c = self.reader_cpu
        allowed_cpus = _allowed_cpus()
        if not (c is None or c == "auto" or (is_int(c) and c in allowed_cpus)):
            raise ValueError(
                f"reader_cpu: {c!r} is invalid; allowed: 'auto', None, or one of the CPUs this "
                f"process may run on ({', '.join(map(str, allowed_cpus)) or 'none known'})"
            )
        t = self.compute_threads
        if t != "auto":
            allowed = "'auto', None (torch's setting), or an integer >= 1"
            check_int("compute_threads", t, 1, none=True, allowed=allowed)
        allowed = "a number >= 0"
        check_number("transfer_delay_s", self.transfer_delay_s, 0, finite=False, allowed=allowed)
        return self

    def num_slots(self, num_experts: int) -> int:
        if isinstance(self.slots, float):
            return max(1, math.ceil(self.slots * num_experts))
        if self.slots > num_experts:
            raise ValueError(
                f"slots: {self.slots} is more than the {num_experts} experts of a layer; "
                f"allowed: 1..{num_experts} or a fraction"
            )
        return self.slots


@dataclass
class OffloadReport:
    """What the offload runtime did during one ``generate`` call (per new token where noted)."""

    new_tokens: int
    hit_rate: float  # demanded experts found resident / demanded
    hit_rate_per_layer: dict[int, float]
    # demanded experts resident and already loaded when their layer asked (a hit whose
    # prefetch was still being read is late: compute waited for it) / demanded. M2R2's point
    # about lead time (sec. 3.3): a prefetch started one layer ahead is often a late hit.
    # None on CUDA, where the host cannot tell whether a copy lands before the compute stream
    # reads the slot.
    ready_rate: float | None
    ready_rate_per_layer: dict[int, float] | None
    prefetch_hit_rate: float  # demanded experts resident thanks to a prefetch / demanded
    bytes_per_token: float  # demand + prefetch bytes moved
    demand_bytes_per_token: float
    prefetch_bytes_per_token: float
    wasted_bytes_per_token: float  # prefetched, evicted before use
    stall_ms_per_token: float  # host time compute waited for transfers
    # the same per MoE layer (what each layer's experts call waited): they sum to the above
    stall_ms_per_token_per_layer: dict[int, float]
    copy_busy_share: float  # copy-engine busy time / wall time of the call (CPU engine)
    prefetch_precision: float | None  # predicted experts that were then demanded / predicted
    prefetch_recall: float | None  # demanded experts that had been predicted / demanded
    seconds: float = 0.0
    engine: str = ""  # the transfer engine's class (NativeEngine, ThreadEngine, CudaEngine)
    slow_dtype: str = ""  # the dtype the slow tier holds the experts in ("float32", ...)
    compute_threads: int = 0  # torch's intra-op threads while it decoded (compute_threads)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Counters:
    demand_bytes: int = 0
    prefetch_bytes: int = 0
    stall_seconds: float = 0.0
    stall_by_layer: dict[int, float] = field(default_factory=dict)
    late_hits: int = 0  # demanded, resident, its load still in flight when the layer asked
    late_by_layer: dict[int, int] = field(default_factory=dict)
    predicted: int = 0
    demanded_scored: int = 0
    true_positives: int = 0
    # per prefetch call: (bytes moved, bytes allowed); the budget test reads it
    prefetch_calls: list[tuple[int, float]] = field(default_factory=list)


class _SlotExperts:
    """Stands for an HF ``<X>Experts`` module over the slot pools (HF's forward reads ``self``)."""

    def __init__(self, module: nn.Module, gate_up: torch.Tensor, down: torch.Tensor, waves: bool):
        self.__dict__["_module"] = module
        self.gate_up_proj = gate_up  # [S, 2I, H]
        self.down_proj = down  # [S, H, I]
        self.num_experts = gate_up.shape[0]  # slot ids; S is the sentinel of other waves
        self._is_expert_parallel = waves  # HF masks sentinel entries out of the sum

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_module"], name)


class ExpertOffload:
    """Slot pools, caches, slow tier and transfer engine for the MoE layers of one model."""

    def __init__(
        self, experts: dict[int, nn.Module], options: OffloadOptions, *, top_k: int
    ) -> None:
        self.options = options.validate()
        self.top_k = top_k  # experts per token: what a prediction picks per token
        self.layers = sorted(experts)
        # the modules' expert tensors, or the checkpoint's (load_offloaded: never in memory)
        pairs = {i: expert_tensors(m) for i, m in experts.items()}
        gate_up, down = pairs[self.layers[0]]
        self.device, self.dtype = gate_up.device, gate_up.dtype
        self.num_experts = gate_up.shape[0]
        self.num_slots = options.num_slots(self.num_experts)
        tier = options.tier
        if tier == "auto":
            tier = "host" if self.device.type == "cuda" else "disk"
        if tier == "disk":
            narrow = options.slow_dtype
            file_dtype = narrow if narrow in (None, "auto") else getattr(torch, narrow)
            self.store = DiskStore(pairs, options.path, direct_io=options.direct_io,
                                   file_dtype=file_dtype)  # fmt: skip
        else:
            if options.slow_dtype not in (None, "auto"):
                raise ValueError(
                    f"slow_dtype: {options.slow_dtype!r} with the {tier!r} tier; allowed: None "
                    "or 'auto' (only the disk tier narrows the experts it holds)"
                )
            self.store = HostStore(pairs, pin=self.device.type == "cuda")
        # What one expert's load moves from the slow tier (the byte counts and budgets).
        self.expert_bytes = self.store.expert_bytes
        make = dict(dtype=self.dtype, device=self.device)
        fill = math.nan if options.poison else 0.0
        s = self.num_slots
        if self.device.type == "cpu":  # block-aligned slots: the disk tier reads into them
            self.gate_up = {i: aligned_pool((s, *gate_up.shape[1:]), self.dtype, fill)
                            for i in self.layers}  # fmt: skip
            self.down = {i: aligned_pool((s, *down.shape[1:]), self.dtype, fill)
                         for i in self.layers}  # fmt: skip
        else:
            self.gate_up = {i: torch.full((s, *gate_up.shape[1:]), fill, **make)
                            for i in self.layers}  # fmt: skip
            self.down = {i: torch.full((s, *down.shape[1:]), fill, **make)
                         for i in self.layers}  # fmt: skip
        self.engine: TransferEngine = self._engine(options)
        self.caches = {i: SlotCache(s, options.policy) for i in self.layers}
        # policy "reuse": per layer the probe's (weight [E, H], bias [E]), scoring each call's
        # last token before its experts are placed
        self._probe: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if options.reuse_probe is not None:
            probe = options.reuse_probe
            if not isinstance(probe, ReuseProbe):
                probe = ReuseProbe.load(probe)
            probe.check(self.layers, self.num_experts, gate_up.shape[-1])
            self._probe = {i: tuple(t.to(self.device, self.dtype) for t in probe.for_layer(i))
                           for i in self.layers}  # fmt: skip
        # Layers whose experts leapfx_cpu::moe_experts computes over the slots once
        # ``kernels`` is on (SpeculativeModel.use_cpu_kernels); the others run HF's code.

        self._kernel_layers = {i for i, m in experts.items() if experts_kernel_covers(m)}
        self.kernels = False
        # A CPU engine: compute is synchronous, a slot is free again once its call returns
        # (a CUDA compute stream reads it later: pins and free events are needed there).
        self._pinless = self.device.type != "cuda"
        self._host_engine = self.device.type != "cuda"  # transfers done is known on the host
        self._pending: dict[tuple[int, int], object] = {}  # (layer, slot) -> ticket
        self._free: dict[tuple[int, int], object] = {}  # (layer, slot) -> free event (CUDA)
        self._predicted: dict[int, set[int]] = {}
        # (layer, candidates) predicted at a step's start, in layer order, each issued when
        # the layer ``options.prefetch_lead`` before it has placed its experts (queue_prefetches)
        self._queued: list[tuple[int, list[int], int]] = []
        self.counters = _Counters()
        self._busy_start = 0.0
        self._threads_before: int | None = None  # torch's threads, while begin changed them
        self._decode_threads = torch.get_num_threads()  # torch's threads in the last decode
        # (lane, layer, expert or None, start s, end s) spans for a timeline plot, when tracing:
        # lanes "compute" (an experts call), "stall" (compute waiting), "demand"/"prefetch"
        # (transfers, timed on the copy engine's thread; CPU engine only).
        self.trace: list[tuple[str, int, int | None, float, float]] | None = None
        log.info(
            "offload: %d MoE layers, %d of %d experts resident per layer (%s, %s tier%s, %s), "
            "%.1f KiB per expert",
            len(self.layers), s, self.num_experts, options.policy, tier,
            " O_DIRECT" if getattr(self.store, "direct", False) else "",
            type(self.engine).__name__, self.expert_bytes / 1024,
        )  # fmt: skip

    def _engine(self, options: OffloadOptions) -> TransferEngine:
        """The transfer engine ``options.engine`` asks for on this device and slow tier."""
        if self.device.type == "cuda":
            if options.engine != "auto":
                raise ValueError(
                    f"engine: {options.engine!r} is a CPU transfer engine and this model is on "
                    f"{self.device}; allowed there: 'auto' (CUDA streams)"
                )
            return CudaEngine(self.device, delay_s=options.transfer_delay_s)
        delay = options.transfer_delay_s
        if options.engine == "thread":
            # A transfer delay tests the waits, which only the workers' tickets have: demands
            # go through a worker too then.
            return ThreadEngine(delay_s=delay, inline_demand=not delay)
        refusal = self._native_refusal()
        if refusal is None:
            cpu = reader_cpu(options.reader_cpu, options.compute_threads)
            return NativeEngine(delay_s=delay, cpu=-1 if cpu is None else cpu,
                                idle_spin_s=0.0 if cpu is None else IDLE_SPIN_S)  # fmt: skip
        if options.engine == "native":
            raise ValueError(
                f"engine: 'native' cannot run here: {refusal}; allowed: 'auto' (falls back to "
                "'thread') or 'thread'"
            )
        _note_fallback(refusal)
        return ThreadEngine(delay_s=delay, inline_demand=not delay)

    def _native_refusal(self) -> str | None:
        """Why the native reader cannot load this model's slots; None if it can."""
        if self.store.kind != "disk":
            return f"the slow tier is {self.store.kind!r}, and the native reader reads the disk"
        first = self.layers[0]
        refusal = self.store.direct_refusal(self.gate_up[first][0], self.down[first][0])
        if refusal is not None:
            return refusal
        if not cpu_reader.available():
            return "the leapfx_cpu reader extension did not build (see the warning above)"
        return None

    def call_tokens(self) -> int:
        """The most tokens one experts call can route whose experts always fit the slots
        (``num_slots // top_k``, at least 2): a verify pass of more may need more distinct
        experts in a layer than it has slots, and then runs in waves, loading some twice."""
        return max(2, self.num_slots // self.top_k)

    # ---- transfers -------------------------------------------------------------------------

    def _issue(self, layer: int, placements: list[Placement], *, demand: bool) -> None:
        """One transfer job loading every placement's expert into its slot: a prefetch call's
        experts go together, so the worker is woken once per call, not once per expert."""
        after, reads = [], []
        assert len({p.slot for p in placements}) == len(placements), "one read per slot a job"
        for p in placements:
            gate_up, down = self.gate_up[layer][p.slot], self.down[layer][p.slot]
            free = self._free.pop((layer, p.slot), None)
            if self.options.poison:
                # The slot is unpinned and idle: nothing reads it now. A compute that forgot to
                # wait for the load below reads NaN (with transfer_delay_s, always).
                gate_up.fill_(math.nan)
                down.fill_(math.nan)
                free = self.engine.record_free() or free
            if free is not None:
                after.append(free)
            reads.append((p.expert, gate_up, down))
        # Data, not a closure: the native engine hands the reads to C++ threads.
        job = ReadJob(self.store, layer, reads, "demand" if demand else "prefetch", self.trace)
        for p in placements:
            self.caches[layer].begin_load(p.slot)
        ticket = self.engine.submit(job, demand=demand, after=after)
        for p in placements:  # one ticket: waiting for any of these slots waits for all
            self._pending[(layer, p.slot)] = ticket
        nbytes = self.expert_bytes * len(placements)
        if demand:
            self.counters.demand_bytes += nbytes
        else:
            self.counters.prefetch_bytes += nbytes

    def _settle(self, layer: int, slot: int) -> None:
        """Make compute wait for the slot's load, if one is in flight."""
        ticket = self._pending.pop((layer, slot), None)
        if ticket is not None:
            start = time.perf_counter()
            stalled = self.engine.wait(ticket)
            c = self.counters
            c.stall_seconds += stalled
            c.stall_by_layer[layer] = c.stall_by_layer.get(layer, 0.0) + stalled
            if self.trace is not None and stalled > 0:
                self.trace.append(("stall", layer, None, start, time.perf_counter()))
            self.caches[layer].end_load(slot)

    def _reap(self, layer: int) -> None:
        """Mark finished loads of ``layer`` idle, so their slots can be evicted again."""
        for key in [k for k in self._pending if k[0] == layer]:
            if self.engine.done(self._pending[key]):
                self._settle(*key)

    # ---- demand ----------------------------------------------------------------------------

    def _acquire(self, layer: int, wave: list[int]) -> list[Placement]:
        cache = self.caches[layer]
        self._reap(layer)
        placements = []
        for expert in wave:
            p = cache.demand_one(expert)
            while p is None:  # every unpinned slot is receiving a prefetch: wait for one
                key = next(k for k in self._pending if k[0] == layer and cache.pins[k[1]] == 0)
                self._settle(*key)
                p = cache.demand_one(expert)
            placements.append(p)
        misses = [p for p in placements if p.load]
        if misses:  # one job: the native engine reads a layer's missing experts side by side
            self._issue(layer, misses, demand=True)
        for p in placements:  # loaded on demand now, or by a prefetch still in flight
            self._settle(layer, p.slot)
        return placements

    def _release(self, layer: int, placements: list[Placement]) -> None:
        self.caches[layer].release([p.expert for p in placements])
        free = self.engine.record_free()
        if free is not None:
            for p in placements:
                self._free[(layer, p.slot)] = free

    def _score(self, layer: int, ids: list[int]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is None:
            return
        c = self.counters
        c.predicted += len(predicted)
        c.demanded_scored += len(ids)
        c.true_positives += len(predicted.intersection(ids))

    def run(
        self,
        layer: int,
        module: nn.Module,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """``module(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` from the slots."""
        start = time.perf_counter()
        out = self._run(layer, module, hidden, top_k_index, top_k_weights)
        if self.trace is not None:
            self.trace.append(("compute", layer, None, start, time.perf_counter()))
        return out

    def _run(self, layer, module, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        # Host sync: which experts to place is decided on the host (once per MoE layer). The
        # routing as a list: a decode step's two or eight ids cost less in Python than through
        # torch.unique and an index gather (~20 us a layer).
        routed = top_k_index.tolist()
        ids = sorted({e for row in routed for e in row})
        self._score(layer, ids)
        cache = self.caches[layer]
        probe = self._probe.get(layer)
        if probe is not None:  # host sync: the eviction order of this layer, from this token
            cache.scores = F.linear(hidden[-1], *probe).tolist()
        slot_of = cache.slot_of
        in_flight = self._late_hits(layer, ids)
        if self._pinless and all(e in slot_of for e in ids):
            # Every expert resident (a decode step's usual case): nothing to place or evict,
            # so no pins either (compute is synchronous, and nothing else places experts of
            # this layer before it returns). ``cache.hit`` counts as demand + release would.
            for key in in_flight:  # a prefetch still in flight: wait for it, as _acquire does
                self._settle(*key)
            cache.hit(ids)
            self._placed(layer)
            index = torch.tensor([[slot_of[e] for e in row] for row in routed],
                                 device=top_k_index.device)  # fmt: skip
            return self._compute(layer, module, hidden, index, top_k_weights, waves=False)
        s = self.num_slots
        resident = [e for e in ids if e in slot_of]
        order = resident + [e for e in ids if e not in slot_of]  # hits need no wait
        waves = [order[i : i + s] for i in range(0, len(order), s)]
        out = None
        for wave in waves:
            placements = self._acquire(layer, wave)
            self._placed(layer)
            lut = [s] * self.num_experts  # expert -> slot; s: not in this wave (sentinel)
            for p in placements:
                lut[p.expert] = p.slot
            index = torch.tensor([[lut[e] for e in row] for row in routed],
                                 device=top_k_index.device)  # fmt: skip
            part = self._compute(layer, module, hidden, index, top_k_weights, len(waves) > 1)
            out = part if out is None else out + part
            self._release(layer, placements)
        return out

    def _late_hits(self, layer: int, ids: list[int]) -> list[tuple[int, int]]:
        """The (layer, slot) keys of ``ids``' resident experts with a load in flight, each
        counted as a late hit unless its load has landed (checked for all of them before any is
        waited for: one job's reads land together)."""
        pending = self._pending
        if not pending:  # nothing in flight (on-demand loading, between prefetches)
            return []
        slot_of = self.caches[layer].slot_of
        keys = [(layer, slot_of[e]) for e in ids if e in slot_of]
        keys = [k for k in keys if k in pending]
        if keys and self._host_engine:  # CUDA: the host cannot tell (ready_rate is None)
            done = self.engine.done
            late = sum(not done(pending[k]) for k in keys)
            if late:
                c = self.counters
                c.late_hits += late
                c.late_by_layer[layer] = c.late_by_layer.get(layer, 0) + late
        return keys

    def _placed(self, layer: int) -> None:
        """``layer`` has placed its experts and its reads are done: start the queued loads of
        the layers ``options.prefetch_lead`` ahead (queue_prefetches)."""
        if self._queued:  # empty where the lead is None: everything went at the step's start
            self._issue_queued(layer + self.options.prefetch_lead)

    def _compute(self, layer, module, hidden, index, top_k_weights, waves: bool) -> torch.Tensor:
        """The experts of ``index`` (slot ids; ``num_slots``: another wave's) over the slots."""
        if self.kernels and layer in self._kernel_layers:
            # the sentinel is past the pool's end: the op adds nothing for it
            return torch.ops.leapfx_cpu.moe_experts(
                hidden, index, top_k_weights.to(hidden.dtype), self.gate_up[layer],
                self.down[layer],
            )  # fmt: skip
        weights = top_k_weights
        if waves:
            weights = torch.where(index == self.num_slots, torch.zeros_like(weights), weights)
        view = _SlotExperts(module, self.gate_up[layer], self.down[layer], waves)
        return type(module).forward(view, hidden, index, weights)

    # ---- prefetch --------------------------------------------------------------------------

    def budget_per_call(self, tokens: int) -> float:
        """Prefetch bytes one layer's prefetch may move for ``tokens`` tokens."""
        b = self.options.prefetch_budget
        if b is None:
            return float(self.top_k * self.expert_bytes * tokens)
        return b / len(self.layers) * tokens

    def prefetch(self, layer: int, probs: torch.Tensor, *, union: bool = False) -> None:
        """Load the experts ``probs`` [T, E] predicts for ``layer``, most probable first (for
        one token any scores with the same ranking do: only their order is used).

        ``union``: the prediction adds to the ones made since ``layer`` last ran (the verify
        pass of a speculative round needs the union of its tokens' experts) instead of
        replacing them; precision and recall score the union.
        """
        candidates = self.candidates(probs)
        self.prefetch_experts(layer, candidates, tokens=probs.shape[0], union=union)

    def candidates(self, probs: torch.Tensor) -> list[int]:
        """The experts ``probs`` [T, E] predicts, most probable first: each token's top_k."""
        k = min(self.top_k, probs.shape[-1])
        if probs.shape[0] == 1:  # a decode step: topk's order is already by probability
            # Host sync: the prediction decides which transfers to start.
            return torch.topk(probs[0], k).indices.tolist()
        top = torch.topk(probs, k, dim=-1).indices.unique()
        mass = probs.sum(0)[top]
        return top[torch.argsort(mass, descending=True, stable=True)].tolist()

    def queue_prefetches(
        self, predictions: list[tuple[int, list[int]]], *, tokens: int = 1
    ) -> None:
        """A decode step's predictions ``[(layer, candidates), ...]`` for ``tokens`` tokens,
        loaded as ``options.prefetch_lead`` says: layer L's once the MoE layer that many before
        it has placed its experts, at once where that comes before the first MoE layer; all at
        once for None. Replaces what an earlier step left queued."""
        lead = self.options.prefetch_lead
        self._queued = sorted(((layer, c, tokens) for layer, c in predictions),
                              key=lambda item: item[0])  # fmt: skip
        self._issue_queued(None if lead is None else self.layers[0] - 1 + lead)

    def _issue_queued(self, upto: int | None) -> None:
        """``prefetch_experts`` for the queued predictions of layers <= ``upto`` (None: all)."""
        queued = self._queued
        while queued and (upto is None or queued[0][0] <= upto):
            layer, candidates, tokens = queued.pop(0)
            self.prefetch_experts(layer, candidates, tokens=tokens)

    def prefetch_experts(
        self, layer: int, candidates: list[int], *, tokens: int = 1, union: bool = False
    ) -> None:
        """Load ``candidates`` (expert ids of ``layer``, most probable first) ahead of use,
        within the byte budget of a call for ``tokens`` tokens (``prefetch``'s second half, for
        a predictor that ranks the experts itself).

        No load evicts an expert predicted for the layer's next demand (this call's candidates,
        and with ``union`` the round's earlier ones): once those fill the unpinned slots, the
        less probable rest is not loaded. Without that, the drafts of a round that predicted
        more experts than the layer has slots evicted each other's loads, and so did a
        prefill's prediction (every expert its tokens route to): on the MoE reference model at
        half the slots, 12.6% of layerskip's bytes (``verify_union``) and 9.7% of
        ``next_gate``'s, with the same hit rates.
        """
        if union and layer in self._predicted:
            self._predicted[layer].update(candidates)
        else:
            self._predicted[layer] = set(candidates)
        keep = self._predicted[layer]
        allowance = self.budget_per_call(tokens)
        cache = self.caches[layer]
        self._reap(layer)
        moved, loads = 0, []
        for expert in candidates:  # touch the resident ones first (recency)
            if expert in cache.slot_of:
                cache.prefetch(expert)
        for expert in candidates:
            if expert in cache.slot_of:
                continue
            if moved + self.expert_bytes > allowance:
                break
            p = cache.prefetch(expert, keep)
            if p is None:
                break
            # Busy from now on: a later candidate of this call must not take the same slot (the
            # reads of one job run side by side, in no set order).
            cache.begin_load(p.slot)
            loads.append(p)
            moved += self.expert_bytes
        if loads:
            self._issue(layer, loads, demand=False)
        self.counters.prefetch_calls.append((moved, allowance))

    # ---- metrics ---------------------------------------------------------------------------

    def begin(self) -> None:
        """Start counting a new decode (the slots keep their experts: a warm cache), and on a
        CPU set torch's threads as ``options.compute_threads`` says until ``end``."""
        self.end()
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            wanted = decode_threads(self.options.compute_threads)
            if wanted is not None and wanted != threads:
                self._threads_before = threads
                torch.set_num_threads(wanted)
        self.counters = _Counters()
        self._predicted.clear()
        self._queued = []
        for cache in self.caches.values():
            cache.stats = SlotStats()
        self._busy_start = self.engine.busy_seconds
        self._decode_threads = torch.get_num_threads()

    def end(self) -> None:
        """A decode is over: torch's threads back to what they were before ``begin``."""
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def report(self, new_tokens: int, seconds: float) -> OffloadReport:
        c = self.counters
        stats = SlotStats()
        per_layer, ready_per_layer = {}, {}
        for i, cache in self.caches.items():
            stats.add(cache.stats)
            demanded = cache.stats.hits + cache.stats.misses
            per_layer[i] = cache.stats.hits / demanded if demanded else 0.0
            late = c.late_by_layer.get(i, 0)
            ready_per_layer[i] = (cache.stats.hits - late) / demanded if demanded else 0.0
        demanded = stats.hits + stats.misses
        ready = (stats.hits - c.late_hits) / demanded if demanded else 0.0
        n = max(1, new_tokens)
        busy = self.engine.busy_seconds - self._busy_start
        return OffloadReport(
            new_tokens=new_tokens,
            hit_rate=stats.hits / demanded if demanded else 0.0,
            hit_rate_per_layer=per_layer,
            ready_rate=ready if self._host_engine else None,
            ready_rate_per_layer=ready_per_layer if self._host_engine else None,
            prefetch_hit_rate=stats.prefetch_hits / demanded if demanded else 0.0,
            bytes_per_token=(c.demand_bytes + c.prefetch_bytes) / n,
            demand_bytes_per_token=c.demand_bytes / n,
            prefetch_bytes_per_token=c.prefetch_bytes / n,
            wasted_bytes_per_token=stats.wasted_prefetches * self.expert_bytes / n,
            stall_ms_per_token=1000.0 * c.stall_seconds / n,
            stall_ms_per_token_per_layer={
                i: 1000.0 * c.stall_by_layer.get(i, 0.0) / n for i in self.caches
            },
            copy_busy_share=busy / seconds if seconds > 0 else 0.0,
            prefetch_precision=c.true_positives / c.predicted if c.predicted else None,
            prefetch_recall=c.true_positives / c.demanded_scored if c.demanded_scored else None,
            seconds=seconds,
            engine=type(self.engine).__name__,
            slow_dtype=str(getattr(self.store, "file_dtype", self.dtype)).removeprefix("torch."),
            compute_threads=self._decode_threads,
        )

    def slot_stats(self) -> dict[int, SlotStats]:
        return {i: cache.stats for i, cache in self.caches.items()}

    def synchronize(self) -> None:
        """Wait for every transfer in flight (prefetches included)."""
        for key in list(self._pending):
            self._settle(*key)

    def close(self) -> None:
        self.end()
        self.synchronize()
        self.engine.close()
        self.store.close()


IDLE_SPIN_S = 2e-3  # how long an idle reading thread polls for work (a decode step: ~4 ms)


def _allowed_cpus() -> list[int]:
    """The CPUs this process may run on ([] where the platform cannot tell)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def decode_threads(setting: int | str | None) -> int | None:
    """torch's intra-op threads for decoding an offloaded model on a CPU under
    ``OffloadOptions.compute_threads``, or None (leave torch's setting). "auto": one less than
    the CPUs this process may use when torch's threads would take all of them, else None."""
    if setting != "auto":
        return setting
    cpus = len(_allowed_cpus())
    return cpus - 1 if cpus > 1 and torch.get_num_threads() >= cpus else None


def reader_cpu(setting: int | str | None, compute_threads: int | str | None = None) -> int | None:
    """The CPU ``OffloadOptions.reader_cpu`` puts the native engine's reading threads on, or
    None (anywhere, no polling). "auto": the last CPU this process may run on, when it may run
    on more CPUs than torch's intra-op threads will use while decoding (``compute_threads``:
    ``OffloadOptions.compute_threads``), so that one is free for the readers."""
    if setting != "auto":
        return setting
    cpus = _allowed_cpus()
    if not cpus:
        return None
    threads = decode_threads(compute_threads) or torch.get_num_threads()
    return cpus[-1] if len(cpus) > threads else None


@functools.cache
def _note_fallback(reason: str) -> None:
    """Log once per reason why ``engine='auto'`` fell back to ThreadEngine."""
    log.info("offload: transfers on Python worker threads (ThreadEngine): %s", reason)
