"""The native transfer engine of the CPU disk tier: C++ reader threads that never take the GIL.

Offloaded decoding over ``NativeEngine`` is token-identical to resident decoding (slots
poisoned, transfers delayed, so a compute that does not wait reads NaN); a missing wait reads
the poison; read errors come back on ``wait`` naming the expert and the layer; ``engine`` is
validated, and ``auto`` falls back to ``ThreadEngine`` where the native reader cannot run.

Experts are direct-readable when their slices are multiples of 4 KiB: with ``tiny_moe_model``'s
hidden size 32, ``intermediate=32`` makes ``gate_up`` 8 KiB and ``down`` 4 KiB in float32.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.kernels import cpu_reader
from leapfx.offload import DiskStore, NativeEngine, OffloadOptions, ReadJob, ThreadEngine
from leapfx.offload import runtime as offload_runtime
from leapfx.offload.store import aligned_pool
from tests.conftest import MOE_ARCHS, examples, tiny_moe_model
from tests.test_moe_prefetch import _perturb
from tests.test_offload import _generate

pytestmark = pytest.mark.skipif(not cpu_reader.available(), reason="no C++ toolchain here")

ALIGNED = 32  # intermediate size whose expert slices are whole 4 KiB blocks (see above)
SPECULATIVE = {"exit_layer": 1, "num_speculations": 3}


def _native(**kw) -> OffloadOptions:
    return OffloadOptions(engine="native", tier="disk", poison=True, **kw)


def _decode(model, recipe, prompt, max_new, options, **opts):
    sm = rewrite.apply(model, recipe, offload=options, **opts)
    if options.prefetch == "m2r2":
        _perturb(sm.graph_module.m2r2_accelerator)  # an untrained stream predicts from h^0
    try:
        return sm.generate(prompt, max_new_tokens=max_new), sm
    finally:
        sm.offload.close()


@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["no-delay", "delayed"])
@pytest.mark.parametrize(
    ("recipe", "prefetch"),
    [
        ("autoregressive", "none"),
        ("autoregressive", "next_gate"),
        ("autoregressive", "m2r2"),
        ("layerskip", "none"),
        ("layerskip", "next_gate"),
    ],
)
def test_native_engine_decodes_like_resident(recipe, prefetch, delay):
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, intermediate=ALIGNED, seed=2)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    opts = SPECULATIVE if recipe == "layerskip" else {}
    resident, _ = _generate(model, recipe, prompt, 16, **opts)
    options = _native(slots=3, prefetch=prefetch, transfer_delay_s=delay)
    ours, sm = _decode(model, recipe, prompt, 16, options, **opts)
    assert type(sm.offload.engine) is NativeEngine
    assert torch.equal(ours, resident), f"offloaded {ours.tolist()}\nresident  {resident.tolist()}"
    report = sm.last_offload_report
    assert report.demand_bytes_per_token > 0 and report.copy_busy_share > 0
    if prefetch != "none":
        assert report.prefetch_bytes_per_token > 0 and report.prefetch_hit_rate > 0


@settings(max_examples=examples(12, 48), deadline=None)
@given(data=st.data())
def test_native_engine_decodes_like_resident_property(data):
    arch = data.draw(st.sampled_from(MOE_ARCHS), label="arch")
    experts = data.draw(st.integers(2, 6), label="experts")
    model = tiny_moe_model(
        arch, layers=4, experts=experts, top_k=2, vocab=64, intermediate=ALIGNED,
        seed=data.draw(st.integers(0, 999), label="seed"),
    )  # fmt: skip
    recipe = data.draw(st.sampled_from(["autoregressive", "layerskip"]), label="recipe")
    prefetches = ["none", "next_gate"] + (["m2r2"] if recipe == "autoregressive" else [])
    options = _native(
        slots=data.draw(st.integers(1, experts), label="slots"),
        policy=data.draw(st.sampled_from(["lru", "lfu"]), label="policy"),
        prefetch=data.draw(st.sampled_from(prefetches), label="prefetch"),
        transfer_delay_s=data.draw(st.sampled_from([0.0, 0.002]), label="delay"),
    )  # fmt: skip
    prompt = torch.tensor([data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=8))])
    max_new = data.draw(st.integers(1, 10), label="max_new_tokens")
    opts = SPECULATIVE if recipe == "layerskip" else {}
    resident, _ = _generate(model, recipe, prompt, max_new, **opts)
    ours, sm = _decode(model, recipe, prompt, max_new, options, **opts)
    assert torch.equal(ours, resident), f"offloaded {ours.tolist()}\nresident  {resident.tolist()}"
    for cache in sm.offload.caches.values():
        assert len(cache.slot_of) <= sm.offload.num_slots and not any(cache.pins)


def test_native_engine_a_missing_wait_reads_poison():
    """With the wait bypassed, compute reads the poisoned slots before the delayed reads land."""
    model = tiny_moe_model("olmoe", layers=2, experts=4, top_k=2, intermediate=ALIGNED)
    prompt = torch.tensor([[1, 2, 3]])
    sm = rewrite.apply(model, "autoregressive",
                       offload=_native(slots=2, transfer_delay_s=0.05))  # fmt: skip
    runtime = sm.offload
    assert type(runtime.engine) is NativeEngine
    runtime.engine.wait = lambda ticket: 0.0  # the bug: compute does not wait for its reads
    logits = sm.stages["full"](prompt, torch.arange(3)[None], {"full_attention": None}, None)
    del runtime.engine.wait
    runtime.close()
    assert torch.isnan(logits["logits"]).any()


def test_native_trace_spans_share_perf_counters_clock():
    """The C++ workers' read times (CLOCK_MONOTONIC) fall inside the call's perf_counter
    window, on both transfer lanes."""
    model = tiny_moe_model("olmoe", layers=3, experts=6, top_k=2, intermediate=ALIGNED)
    sm = rewrite.apply(model, "autoregressive", offload=_native(slots=2, prefetch="next_gate"))
    sm.offload.trace = []
    start = time.perf_counter()
    sm.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6)
    end = time.perf_counter()
    transfers = [span for span in sm.offload.trace if span[0] in ("demand", "prefetch")]
    assert {span[0] for span in transfers} == {"demand", "prefetch"}
    assert all(start <= a <= b <= end for _, _, _, a, b in transfers)
    assert all(expert is not None for _, _, expert, _, _ in transfers)
    sm.offload.close()


# ---- the engine alone --------------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path):
    gate_up, down = torch.randn(3, 32, 64), torch.randn(3, 64, 16)  # 8 KiB and 4 KiB slices
    store = DiskStore({0: (gate_up, down)}, path=tmp_path / "experts.bin")
    pools = (aligned_pool((2, 32, 64), torch.float32, float("nan")),
             aligned_pool((2, 64, 16), torch.float32, float("nan")))  # fmt: skip
    yield store, (gate_up, down), pools
    store.close()


def test_native_engine_reads_into_slots(disk):
    store, (gate_up, down), (pool_a, pool_b) = disk
    engine = NativeEngine()
    job = ReadJob(store, 0, [(2, pool_a[1], pool_b[1]), (0, pool_a[0], pool_b[0])], "prefetch")
    ticket = engine.submit(job, demand=False)
    assert engine.wait(ticket) >= 0.0 and engine.done(ticket)
    assert engine.wait(ticket) == 0.0  # a second wait (another slot of the job) returns at once
    assert torch.equal(pool_a[1], gate_up[2]) and torch.equal(pool_b[1], down[2])
    assert torch.equal(pool_a[0], gate_up[0]) and torch.equal(pool_b[0], down[0])
    assert engine.busy_seconds > 0
    engine.close()


def test_native_reads_of_a_job_run_side_by_side(disk):
    """A job's reads take about one read's time with several workers, and the inline caller
    reads with them; the slots still receive their own experts."""
    store, (gate_up, down), (pool_a, pool_b) = disk
    for inline in (False, True):
        engine = NativeEngine(delay_s=0.2, inline_demand=inline, workers=2)
        job = ReadJob(store, 0, [(2, pool_a[0], pool_b[0]), (1, pool_a[1], pool_b[1])], "demand")
        start = time.perf_counter()
        engine.wait(engine.submit(job, demand=True))
        elapsed = time.perf_counter() - start
        assert 0.2 <= elapsed < 0.35, f"inline={inline}: two reads took {elapsed:.3f} s"
        assert torch.equal(pool_a[0], gate_up[2]) and torch.equal(pool_b[0], down[2])
        assert torch.equal(pool_a[1], gate_up[1]) and torch.equal(pool_b[1], down[1])
        engine.close()
        pool_a.fill_(float("nan"))
        pool_b.fill_(float("nan"))
    one = NativeEngine(delay_s=0.1, inline_demand=False, workers=1)
    job = ReadJob(store, 0, [(2, pool_a[0], pool_b[0]), (1, pool_a[1], pool_b[1])], "prefetch")
    start = time.perf_counter()
    one.wait(one.submit(job, demand=False))
    assert time.perf_counter() - start >= 0.2  # one worker: one read after the other
    one.close()


def test_native_reader_refuses_a_bad_worker_count():
    with pytest.raises(RuntimeError, match="workers: 0 is invalid; allowed: 1..64"):
        cpu_reader.reader(workers=0)


def test_native_reader_refuses_a_bad_cpu():
    with pytest.raises(RuntimeError, match="cpu: -2 is invalid; allowed: -1"):
        cpu_reader.reader(cpu=-2)


def _thread_cpus() -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_polling_reader_on_a_cpu_reads_every_job(disk):
    """Workers pinned to ``cpu``, one polling between jobs: jobs submitted while it polls, and
    after it gave up and slept, all land in their slots."""
    store, (gate_up, down), (pool_a, pool_b) = disk
    cpu = max(os.sched_getaffinity(0))
    before = set(_thread_cpus())
    engine = NativeEngine(cpu=cpu, idle_spin_s=0.005, workers=2)
    time.sleep(0.05)  # the workers have started and pinned themselves
    new = {t: cpus for t, cpus in _thread_cpus().items() if t not in before}
    assert len(new) == 2 and all(cpus == {cpu} for cpus in new.values()), new
    for pause in (0.0, 0.001, 0.02, 0.0):  # 0.02: past the poll, the workers sleep
        time.sleep(pause)
        for expert in (2, 1, 0):
            pool_a.fill_(float("nan"))
            pool_b.fill_(float("nan"))
            job = ReadJob(store, 0, [(expert, pool_a[0], pool_b[0])], "demand")
            engine.wait(engine.submit(job, demand=True))
            assert torch.equal(pool_a[0], gate_up[expert]) and torch.equal(pool_b[0], down[expert])
    engine.close()


def test_native_engine_refuses_jobs_that_are_not_direct_reads(disk):
    store, _, (pool_a, pool_b) = disk
    engine = NativeEngine()
    unaligned = torch.empty(32 * 64 + 1)[1:].view(32, 64)
    with pytest.raises(TypeError, match="straight into their slots"):
        engine.submit(ReadJob(store, 0, [(1, unaligned, pool_b[0])], "demand"), demand=True)
    with pytest.raises(TypeError, match="ReadJobs"):
        engine.submit(lambda: 0, demand=True)
    engine.close()


def test_native_engine_short_read_names_expert_and_layer(disk):
    store, _, (pool_a, pool_b) = disk
    engine = NativeEngine()
    os.truncate(store.path, 2 * store.record + 4096)  # expert 2's record loses its tail
    ticket = engine.submit(ReadJob(store, 0, [(2, pool_a[0], pool_b[0])], "prefetch"),
                           demand=False)  # fmt: skip
    with pytest.raises(OSError, match=r"short read of expert 2 of layer 0: 4096 of 12288 bytes"):
        engine.wait(ticket)
    assert engine.done(ticket)
    with pytest.raises(OSError, match="short read"):  # every wait on it fails, not only the first
        engine.wait(ticket)
    engine.close()


@pytest.mark.parametrize("inline", [True, False], ids=["inline-demand", "worker"])
def test_native_engine_bad_fd_names_expert_and_layer(disk, inline):
    store, _, (pool_a, pool_b) = disk
    engine = NativeEngine(inline_demand=inline)
    os.close(store._fd)
    store._fd = -1  # a descriptor that reads nothing
    ticket = engine.submit(ReadJob(store, 0, [(1, pool_a[0], pool_b[0])], "demand"), demand=True)
    with pytest.raises(OSError, match="reading expert 1 of layer 0.*Bad file descriptor"):
        engine.wait(ticket)
    store._fd = None  # closed already: the fixture's close has nothing to do
    engine.close()


def test_native_wait_releases_the_gil():
    """While the compute thread blocks in ``wait``, another Python thread runs."""
    reader = cpu_reader.reader(delay_s=0.2)
    counted, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    thread = threading.Thread(target=count)
    thread.start()
    time.sleep(0.02)
    ticket = reader.submit(False, [])
    before = counted[0]
    reader.wait(ticket)  # blocks ~0.2 s on the worker's delay
    during = counted[0] - before
    stop.set()
    thread.join()
    assert reader.take(ticket) == (0, "", [])
    assert during > 1000


def test_native_reader_refuses_an_unknown_conversion():
    with pytest.raises(RuntimeError, match="convert: 7 is invalid"):
        cpu_reader.reader().submit(False, [0, 0, 0, 0, 4096, 7, 1, 0, 4096])


# ---- a narrowed disk tier ---------------------------------------------------------------------


def _rounded(model, dtype: torch.dtype):
    """``model`` with every expert weight rounded to ``dtype`` and kept in float32 (a float16
    or bfloat16 checkpoint computed in float32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(p.to(dtype).to(p.dtype))
    return model


@pytest.mark.parametrize("engine", ["native", "thread"])
@pytest.mark.parametrize(
    ("rounded", "slow_dtype"), [(torch.float16, "auto"), (torch.bfloat16, "bfloat16")]
)
def test_a_narrowed_disk_tier_decodes_like_resident(engine, rounded, slow_dtype):
    """Experts that a 2-byte dtype holds exactly go to disk in it (half the bytes) and are
    widened as they are read: by the native reader from its own buffer, by ThreadEngine
    through the store's. Poisoned slots and delayed reads: every widened value is waited for."""
    # intermediate 64: the float16 slices are 8 and 4 KiB, whole blocks, so the native reader
    # takes them
    model = _rounded(tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, intermediate=64,
                                    seed=5), rounded)  # fmt: skip
    prompt = torch.tensor([[2, 7, 1, 8, 2, 8]])
    resident, _ = _generate(model, "autoregressive", prompt, 16)
    options = OffloadOptions(engine=engine, tier="disk", poison=True, slots=3,
                             prefetch="next_gate", slow_dtype=slow_dtype,
                             transfer_delay_s=0.002)  # fmt: skip
    ours, sm = _decode(model, "autoregressive", prompt, 16, options)
    assert type(sm.offload.engine).__name__ == {"native": "NativeEngine",
                                                "thread": "ThreadEngine"}[engine]  # fmt: skip
    store = sm.offload.store
    assert store.file_dtype == rounded
    assert sm.offload.expert_bytes == (128 * 32 + 32 * 64) * 2  # float16 / bfloat16 bytes
    assert torch.equal(ours, resident), f"offloaded {ours.tolist()}\nresident  {resident.tolist()}"
    assert sm.last_offload_report.demand_bytes_per_token > 0


def test_a_narrowed_disk_tier_only_where_exact(tmp_path):
    """``auto`` keeps float32 where no 2-byte dtype holds the experts; asked for one that does
    not, the store refuses (decoding would change); the host tier narrows nothing."""
    from leapfx.offload.store import aligned_pool

    model = tiny_moe_model("olmoe", layers=2, experts=4, intermediate=64, seed=1)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2, slow_dtype="auto"))
    assert sm.offload.store.file_dtype == torch.float32
    sm.offload.close()
    with pytest.raises(ValueError, match="slow_dtype: torch.float16 does not hold the experts"):
        rewrite.apply(model, "autoregressive",
                      offload=OffloadOptions(slots=2, slow_dtype="float16"))  # fmt: skip
    host = OffloadOptions(slots=2, tier="host", slow_dtype="float16")
    with pytest.raises(ValueError, match="slow_dtype: 'float16' with the 'host' tier"):
        rewrite.apply(model, "autoregressive", offload=host)
    gate_up = torch.randn(3, 64, 32).half().float()
    down = torch.randn(3, 32, 32).half().float()
    store = DiskStore({0: (gate_up, down)}, path=tmp_path / "e.bin", file_dtype=torch.float16)
    assert os.path.getsize(tmp_path / "e.bin") == 3 * (4096 + 2048 + 2048)  # padded halves
    a, b = torch.empty(64, 32), torch.empty(32, 32)
    assert store.read_into(0, 2, a, b) == (64 * 32 + 32 * 32) * 2
    assert torch.equal(a, gate_up[2]) and torch.equal(b, down[2])
    pool_a = aligned_pool((1, 64, 32), torch.float32, 0.0)
    assert store.direct_read(0, 1, pool_a[0], b) is None  # down's 2 KiB half needs padding
    store.close()


# ---- selection --------------------------------------------------------------------------------


def test_auto_selects_native_for_direct_readable_disk_tiers():
    model = tiny_moe_model("olmoe", layers=2, experts=4, intermediate=ALIGNED)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2))
    assert type(sm.offload.engine) is NativeEngine
    sm.offload.close()
    forced = rewrite.apply(
        model, "autoregressive", offload=OffloadOptions(slots=2, engine="thread")
    )
    assert type(forced.offload.engine) is ThreadEngine
    forced.offload.close()


@pytest.mark.parametrize(
    ("model_kw", "tier", "why"),
    [
        ({"intermediate": 16}, "disk", "not multiples of 4096 bytes"),  # padded records
        ({"intermediate": ALIGNED}, "host", "slow tier is 'host'"),
    ],
)
def test_auto_falls_back_to_thread_and_logs_why(model_kw, tier, why, caplog):
    offload_runtime._note_fallback.cache_clear()
    model = tiny_moe_model("olmoe", layers=2, experts=4, **model_kw)
    with caplog.at_level(logging.INFO, logger="leapfx.offload.runtime"):
        sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2, tier=tier))
    assert type(sm.offload.engine) is ThreadEngine
    assert any("ThreadEngine" in r.message and why in r.message for r in caplog.records)
    sm.offload.close()
    with pytest.raises(ValueError, match=f"engine: 'native' cannot run here: .*{why}"):
        rewrite.apply(model, "autoregressive",
                      offload=OffloadOptions(slots=2, tier=tier, engine="native"))  # fmt: skip


def test_auto_falls_back_where_the_reader_does_not_build(monkeypatch):
    monkeypatch.setattr(cpu_reader, "available", lambda: False)
    model = tiny_moe_model("olmoe", layers=2, experts=4, intermediate=ALIGNED)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2))
    assert type(sm.offload.engine) is ThreadEngine
    sm.offload.close()
    with pytest.raises(ValueError, match="engine: 'native' cannot run here: .*did not build"):
        rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2, engine="native"))


def test_reader_cpu_auto_takes_a_cpu_torch_leaves_free(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert offload_runtime.reader_cpu("auto") == 5
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # every CPU computes: none free
    assert offload_runtime.reader_cpu("auto") is None
    assert offload_runtime.reader_cpu(None) is None and offload_runtime.reader_cpu(3) == 3


def test_compute_threads_auto_leaves_a_cpu_to_the_readers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # torch takes every CPU
    assert offload_runtime.decode_threads("auto") == 2
    assert offload_runtime.reader_cpu("auto", "auto") == 5  # free while decoding
    assert offload_runtime.reader_cpu("auto", 3) is None
    assert offload_runtime.reader_cpu("auto", 1) == 5
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # a CPU is free already
    assert offload_runtime.decode_threads("auto") is None
    assert offload_runtime.decode_threads(None) is None and offload_runtime.decode_threads(4) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one CPU: nothing to leave
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert offload_runtime.decode_threads("auto") is None


def test_compute_threads_hold_while_decoding_and_are_restored(monkeypatch):
    model = tiny_moe_model("olmoe", layers=2, experts=4, intermediate=ALIGNED)
    prompt = torch.tensor([[2, 7, 1, 8]])
    resident, _ = _generate(model, "autoregressive", prompt, 6)
    sm = rewrite.apply(model, "autoregressive",
                       offload=OffloadOptions(slots=2, compute_threads=1))  # fmt: skip
    seen = []
    run = sm.offload.run

    def spy(*args):  # torch's threads while an experts call runs
        seen.append(torch.get_num_threads())
        return run(*args)

    monkeypatch.setattr(sm.offload, "run", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(sm.generate(prompt, max_new_tokens=6), resident)
        assert set(seen) == {1} and sm.last_offload_report.compute_threads == 1
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(sm.offload, "run", lambda *a: 1 / 0)  # a decode that fails
        with pytest.raises(ZeroDivisionError):
            sm.generate(prompt, max_new_tokens=6)
        assert torch.get_num_threads() == 2  # restored all the same
    finally:
        torch.set_num_threads(before)
        sm.offload.close()


@pytest.mark.parametrize("setting", [0, -2, "all", 1.5, True])
def test_compute_threads_option_is_validated(setting):
    model = tiny_moe_model("olmoe", layers=2)
    with pytest.raises(ValueError, match=r"compute_threads: .* is invalid; allowed: 'auto', None"):
        rewrite.apply(model, "autoregressive", offload=OffloadOptions(compute_threads=setting))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_offload_on_a_reader_cpu_decodes_like_resident():
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, intermediate=ALIGNED, seed=3)
    prompt = torch.tensor([[2, 7, 1, 8, 2, 8]])
    resident, _ = _generate(model, "autoregressive", prompt, 16)
    cpu = max(os.sched_getaffinity(0))
    for setting in (cpu, None):
        options = _native(slots=3, prefetch="next_gate", reader_cpu=setting)
        ours, _ = _decode(model, "autoregressive", prompt, 16, options)
        assert torch.equal(ours, resident), f"reader_cpu={setting}"


@pytest.mark.parametrize("setting", [-1, "last", 1.0, True, 10**6])
def test_reader_cpu_option_is_validated(setting):
    model = tiny_moe_model("olmoe", layers=2)
    with pytest.raises(ValueError, match=r"reader_cpu: .* is invalid; allowed: 'auto', None"):
        rewrite.apply(model, "autoregressive", offload=OffloadOptions(reader_cpu=setting))


@pytest.mark.parametrize("engine", ["gil-free", "", None, "Native"])
def test_engine_option_is_validated(engine):
    model = tiny_moe_model("olmoe", layers=2)
    with pytest.raises(ValueError, match=r"engine: .* is invalid; allowed: 'auto', 'native'"):
        rewrite.apply(model, "autoregressive", offload=OffloadOptions(engine=engine))
