"""The expert-offload runtime: cache rules against a pure-Python model, and offloaded decoding
token-identical to resident decoding for every recipe, eviction and prefetch policy.

Slots are poisoned (NaN) whenever they are reassigned and transfers are delayed in most cases
here, so a compute that does not wait for its load reads NaN and fails deterministically.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.bench.offload import summarize
from leapfx.bench.routing import moe_layers
from leapfx.offload import DiskStore, OffloadOptions, ReuseProbe, SlotCache
from leapfx.passes.capture import decoder_pieces, nodes_by_role
from tests.conftest import MOE_ARCHS, examples, tiny_moe_model
from tests.distribution_check import assert_sampled_from
from tests.greedy_check import assert_greedy_equal, hf_greedy

# ---- the cache against a pure-Python model ----------------------------------------------------


class ModelCache:
    """LRU/LFU/reuse of a fixed number of slots, written as plainly as possible (the
    reference). ``reuse``: the lowest of ``scores`` (set from outside) goes, else LRU."""

    def __init__(self, slots: int, policy: str) -> None:
        self.slots, self.policy = slots, policy
        self.scores: list[int] | None = None
        self.where: dict[int, int] = {}  # expert -> slot
        self.recency: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.uses: dict[int, int] = {}
        self.pinned: set[int] = set()
        self.speculative: set[int] = set()
        self.hits = self.misses = self.evictions = self.wasted = self.prefetch_hits = 0

    def _touch(self, e: int) -> None:
        self.recency.pop(e, None)
        self.recency[e] = None

    def _slot(self, keep: frozenset[int] = frozenset()) -> tuple[int, int | None] | None:
        free = sorted(set(range(self.slots)) - set(self.where.values()))
        if free:
            return free[0], None
        # least recent first
        order = [e for e in self.recency if e not in self.pinned and e not in keep]
        if not order:
            return None
        if self.policy == "lfu":
            victim = min(order, key=lambda e: self.uses.get(e, 0))  # min keeps the first (LRU)
        elif self.policy == "reuse" and self.scores is not None:
            victim = min(order, key=lambda e: self.scores[e])
        else:
            victim = order[0]
        return self.where[victim], victim

    def _put(self, e: int, keep: frozenset[int] = frozenset()) -> tuple[int, int | None]:
        slot, victim = self._slot(keep)
        if victim is not None:
            del self.where[victim]
            self.recency.pop(victim)
            self.uses.pop(victim, None)
            self.evictions += 1
            if victim in self.speculative:
                self.speculative.discard(victim)
                self.wasted += 1
        self.where[e] = slot
        return slot, victim

    def demand(self, experts: list[int]) -> list[tuple[int, int, bool, int | None]]:
        out = []
        for e in experts:
            if e in self.where:
                self.hits += 1
                if e in self.speculative:
                    self.speculative.discard(e)
                    self.prefetch_hits += 1
                out.append((e, self.where[e], False, None))
            else:
                self.misses += 1
                slot, victim = self._put(e)
                out.append((e, slot, True, victim))
            self.pinned.add(e)
            self.uses[e] = self.uses.get(e, 0) + 1
            self._touch(e)
        return out

    def release(self, experts: list[int]) -> None:
        self.pinned -= set(experts)

    def prefetch(self, e: int, keep: frozenset[int] = frozenset()):
        if e in self.where:
            self._touch(e)
            return None
        if self._slot(keep) is None:
            return None
        slot, victim = self._put(e, keep)
        self.speculative.add(e)
        self._touch(e)
        return (e, slot, True, victim)


@st.composite
def cache_programs(draw):
    experts = draw(st.integers(2, 10))
    slots = draw(st.integers(1, experts))
    ops = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("demand"), st.lists(st.integers(0, experts - 1), min_size=1,
                                                      max_size=slots, unique=True)),
                # an expert, and the experts the prefetch must not evict (often none)
                st.tuples(st.just("prefetch"), st.tuples(
                    st.integers(0, experts - 1),
                    st.frozensets(st.integers(0, experts - 1), max_size=experts))),
                # demand + release at once (ExpertOffload's fast path), where all are resident
                st.tuples(st.just("hit"), st.lists(st.integers(0, experts - 1), min_size=1,
                                                   max_size=slots, unique=True)),
                # new eviction scores (reuse); few values, so that ties fall back to LRU
                st.tuples(st.just("score"), st.lists(st.integers(0, 2), min_size=experts,
                                                     max_size=experts)),
            ),
            max_size=60,
        )
    )  # fmt: skip
    return slots, draw(st.sampled_from(["lru", "lfu", "reuse"])), ops


@settings(max_examples=examples(300, 300))
@given(program=cache_programs())
def test_slot_cache_matches_the_pure_python_model(program):
    slots, policy, ops = program
    cache, model = SlotCache(slots, policy), ModelCache(slots, policy)
    for op, arg in ops:
        if op == "demand":
            got = [(p.expert, p.slot, p.load, p.evicted) for p in cache.demand(arg)]
            assert got == model.demand(arg)
            # pinned: in a slot, and the slot holds it (no slot overwritten while in use)
            assert all(cache.expert_of[cache.slot_of[e]] == e for e in arg)
            cache.release(arg)
            model.release(arg)
        elif op == "hit":
            if all(e in model.where for e in arg):
                cache.hit(arg)
                assert all(not p for p in cache.pins)  # nothing left pinned
                assert all(load is False for _, _, load, _ in model.demand(arg))
                model.release(arg)
            else:  # refused whole: nothing counted, nothing moved
                before = (dict(cache.slot_of), dict(cache._last), cache.stats.hits)
                with pytest.raises(KeyError, match="not resident"):
                    cache.hit(arg)
                assert (dict(cache.slot_of), dict(cache._last), cache.stats.hits) == before
        elif op == "score":
            cache.scores, model.scores = list(arg), list(arg)
        else:
            expert, keep = arg
            p = cache.prefetch(expert, keep)
            want = model.prefetch(expert, keep)
            assert (None if p is None else (p.expert, p.slot, p.load, p.evicted)) == want
            assert p is None or p.evicted not in keep
        assert len(cache.slot_of) <= slots and len(cache.expert_of) == slots  # never exceeded
        assert cache.slot_of == model.where
    s = cache.stats
    assert (s.hits, s.misses, s.evictions) == (model.hits, model.misses, model.evictions)
    assert (s.wasted_prefetches, s.prefetch_hits) == (model.wasted, model.prefetch_hits)


def test_pinned_and_busy_slots_are_never_victims():
    cache = SlotCache(2, "lru")
    cache.demand([0, 1])  # both pinned
    assert cache.prefetch(2) is None and cache.demand_one(2) is None
    cache.release([0, 1])
    p = cache.prefetch(2)  # evicts 0 (least recent); its slot is now loading
    cache.begin_load(p.slot)
    cache.demand([1])
    assert cache.demand_one(3) is None  # 1 pinned, 2's slot busy: wait for the load
    cache.end_load(p.slot)
    assert cache.demand_one(3).evicted == 2
    assert cache.stats.wasted_prefetches == 1


def test_victim_key_replaces_the_policy_but_not_the_pins():
    cache = SlotCache(3, "lru")
    for expert in (0, 1, 2):  # 0 least recent
        cache.release([cache.demand_one(expert).expert])
    cache.victim_key = lambda expert: -expert  # the highest id goes first
    cache.demand([2])  # pinned: never a victim, whatever the key says
    assert cache.demand_one(3).evicted == 1
    cache.victim_key = None  # back to LRU: 0
    assert cache.prefetch(4).evicted == 0


# ---- offloaded decoding ----------------------------------------------------------------------


def random_probe(model, seed: int = 0) -> ReuseProbe:
    """A reuse probe of random weights for ``model``'s MoE layers (any order is lossless)."""
    layers = moe_layers(model)
    experts = decoder_pieces(model).layers[layers[0]].mlp.experts.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(layers), experts, model.config.hidden_size, generator=g)
    return ReuseProbe(layers, weight, torch.randn(len(layers), experts, generator=g), horizon=2)


def _offload(**kw) -> OffloadOptions:
    return OffloadOptions(poison=True, **kw)


def _generate(model, recipe, prompt, max_new, offload=None, **opts):
    sm = rewrite.apply(model, recipe, offload=offload, **opts)
    try:
        return sm.generate(prompt, max_new_tokens=max_new), sm
    finally:
        if sm.offload is not None:
            sm.offload.close()


RECIPES = {
    "autoregressive": {},
    "early_exit": {"exit_layer": 1},
    "layerskip": {"exit_layer": 1, "num_speculations": 3},
    "lookup": {"num_speculations": 3},
    "kangaroo": {"exit_layer": 1, "confidence_threshold": 0.0},
    "eagle": {"max_draft_tokens": 3, "confidence_threshold": 0.0},
    "specee": {"verify": True, "exit_layer": 1},
    "m2r2_exit": {"threshold": 1.01},  # never exits: the resident side is HF greedy's
}


@pytest.mark.parametrize(("recipe", "opts"), [("specee", {}), ("m2r2_exit", {"threshold": 0.5})])
def test_lossy_layer_by_layer_recipes_exit_alike_offloaded(recipe, opts):
    """Untrained predictors and routers (seeded alike): the offloaded model exits where the
    resident one does, so the tokens are the same, whatever they are."""
    model = tiny_moe_model("qwen3_moe", layers=4, experts=6, top_k=2, vocab=64, seed=2)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    torch.manual_seed(0)
    resident = rewrite.apply(model, recipe, **opts).generate(prompt, max_new_tokens=12)
    for slots in (2, 6):
        torch.manual_seed(0)
        ours, sm = _generate(model, recipe, prompt, 12, offload=_offload(slots=slots), **opts)
        assert torch.equal(ours, resident), (slots, ours.tolist(), resident.tolist())
        assert sm.last_offload_report.hit_rate < 1.0 or slots == 6


@settings(max_examples=examples(40, 160))
@given(data=st.data())
def test_offloaded_decoding_is_token_identical_to_resident(data):
    arch = data.draw(st.sampled_from(MOE_ARCHS), label="arch")
    experts = data.draw(st.integers(2, 8), label="experts")
    top_k = data.draw(st.integers(1, min(2, experts)), label="top_k")
    model = tiny_moe_model(
        arch, layers=3, experts=experts, top_k=top_k, vocab=64,
        norm_topk_prob=data.draw(st.booleans(), label="norm_topk_prob"),
        dense_layers=(1,) if arch.startswith("qwen") and data.draw(st.booleans()) else (),
        seed=data.draw(st.integers(0, 999), label="seed"),
        # 32: whole 4 KiB expert slices, which the disk tier's native engine reads (16: padded
        # records, ThreadEngine)
        intermediate=data.draw(st.sampled_from([16, 32]), label="intermediate"),
    )  # fmt: skip
    recipe = data.draw(st.sampled_from(sorted(RECIPES)), label="recipe")
    policy = data.draw(st.sampled_from(["lru", "lfu", "reuse"]), label="policy")
    seed = data.draw(st.integers(0, 99), label="probe_seed")
    options = _offload(
        slots=data.draw(st.integers(1, experts), label="slots"),
        policy=policy,
        reuse_probe=random_probe(model, seed) if policy == "reuse" else None,
        prefetch=data.draw(st.sampled_from(["none", "next_gate"]), label="prefetch"),
        prefetch_budget=data.draw(st.sampled_from([None, 0, 1000, 10**9]), label="budget"),
        tier=data.draw(st.sampled_from(["disk", "host"]), label="tier"),
        transfer_delay_s=data.draw(st.sampled_from([0.0, 0.002]), label="delay"),
    )  # fmt: skip
    ids = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=12), label="prompt")
    prompt = torch.tensor([ids])
    max_new = data.draw(st.integers(1, 10), label="max_new_tokens")
    # With the CPU kernels both sides run leapfx_cpu::moe_experts (over the weights, over
    # the slots); without, HF's experts code.
    opts = {**RECIPES[recipe], "cpu_kernels": data.draw(st.booleans(), label="cpu_kernels")}
    resident, _ = _generate(model, recipe, prompt, max_new, **opts)
    ours, sm = _generate(model, recipe, prompt, max_new, offload=options, **opts)
    assert sm.offload.kernels == opts["cpu_kernels"]
    # top_k <= 2: exact even when a call needs more experts than slots (see runtime's docstring)
    assert torch.equal(ours, resident), f"offloaded {ours.tolist()}\nresident  {resident.tolist()}"
    report = sm.last_offload_report
    assert 0.0 <= report.hit_rate <= 1.0 and report.new_tokens == ours.shape[1] - len(ids)
    for moved, allowed in sm.offload.counters.prefetch_calls:  # the budget, per call
        assert moved <= allowed
    for cache in sm.offload.caches.values():
        assert len(cache.slot_of) <= sm.offload.num_slots and not any(cache.pins)


def test_top3_waves_agree_with_hf_greedy():
    # top_k = 3 with 2 slots: every call runs in waves (partial sums, equal up to rounding).
    model = tiny_moe_model("qwen3_moe", layers=3, experts=6, top_k=3, norm_topk_prob=True, seed=4)
    prompt = torch.tensor([[5, 9, 2, 6, 5, 3]])
    ours, sm = _generate(model, "layerskip", prompt, 16, offload=_offload(slots=2),
                         exit_layer=1, num_speculations=3)  # fmt: skip
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, 16), prompt.shape[1])


def test_a_missing_wait_reads_poison():
    """The poisoning catches a compute that does not wait for its transfer."""
    model = tiny_moe_model("olmoe", layers=2, experts=4, top_k=2)
    prompt = torch.tensor([[1, 2, 3]])
    sm = rewrite.apply(model, "autoregressive",
                       offload=_offload(slots=2, transfer_delay_s=0.05, tier="host"))  # fmt: skip
    runtime = sm.offload
    runtime.engine.wait = lambda ticket: 0.0  # the bug: compute does not wait for its copy
    logits = sm.stages["full"](prompt, torch.arange(3)[None], {"full_attention": None}, None)
    runtime.close()
    assert torch.isnan(logits["logits"]).any()


def _count_hits(runtime) -> list:
    """A list that gets an entry per ``SlotCache.hit`` call of ``runtime``'s caches."""
    calls: list = []

    def counting(hit):
        def wrapper(experts):
            calls.append(experts)
            return hit(experts)

        return wrapper

    for cache in runtime.caches.values():
        cache.hit = counting(cache.hit)
    return calls


@pytest.mark.parametrize("prefetch", ["none", "next_gate"])
def test_the_all_resident_fast_path_counts_and_decodes_as_the_general_path(prefetch):
    """An experts call whose experts are all resident skips placing and pinning (``cache.hit``):
    the tokens, every count of the report and every layer's slot map equal the general path's."""
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, seed=3)
    prompt = torch.tensor([[5, 9, 2, 7, 1]])
    got = {}
    for fast in (True, False):
        sm = rewrite.apply(model, "autoregressive",
                           offload=_offload(slots=4, prefetch=prefetch, tier="host"))  # fmt: skip
        runtime = sm.offload
        runtime._pinless = fast
        hits = _count_hits(runtime)
        out = sm.generate(prompt, max_new_tokens=16)
        report = sm.last_offload_report.as_dict()
        timed = ("seconds", "stall_ms_per_token", "copy_busy_share", "ready_rate",
                 "stall_ms_per_token_per_layer", "ready_rate_per_layer")  # fmt: skip
        for name in timed:  # they depend on when the reads land
            report.pop(name)
        got[fast] = (out, report, {i: c.resident() for i, c in runtime.caches.items()})
        runtime.close()
        assert bool(hits) == fast  # the fast path ran (and only where it is on)
    assert torch.equal(got[True][0], got[False][0])
    assert got[True][1:] == got[False][1:]


def test_the_fast_path_waits_for_a_prefetch_in_flight():
    """A resident expert whose prefetch is still being read is waited for (poisoned slots and
    slow transfers: a fast path that read it early would compute with NaN)."""
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, seed=1)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    options = _offload(slots=4, prefetch="next_gate", tier="host", engine="thread",
                       transfer_delay_s=0.02)  # fmt: skip
    sm = rewrite.apply(model, "autoregressive", offload=options)
    runtime = sm.offload
    hits = _count_hits(runtime)
    out = sm.generate(prompt, max_new_tokens=6)
    runtime.close()
    assert_greedy_equal(model, out, hf_greedy(model, prompt, 6), prompt.shape[1])
    assert hits and sm.last_offload_report.prefetch_hit_rate > 0


def test_a_hit_whose_prefetch_is_still_being_read_is_late_not_ready():
    """``ready_rate`` leaves out hits whose load had not landed when their layer asked. Every
    transfer 20 ms slow: next_gate's prefetches, started one layer ahead, are still in flight
    when the step that predicted them uses them, so ready < hit; a late hit is always a
    prefetch hit (hit - prefetch hits <= ready). On-demand loading has no late hits."""
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, seed=1)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    reports = {}
    for prefetch in ("none", "next_gate"):
        options = _offload(slots=4, prefetch=prefetch, tier="host", engine="thread",
                           transfer_delay_s=0.02)  # fmt: skip
        _, sm = _generate(model, "autoregressive", prompt, 6, offload=options)
        reports[prefetch] = sm.last_offload_report
    none, gate = reports["none"], reports["next_gate"]
    assert none.ready_rate == none.hit_rate
    assert none.ready_rate_per_layer == none.hit_rate_per_layer
    assert gate.prefetch_hit_rate > 0
    assert gate.hit_rate - gate.prefetch_hit_rate <= gate.ready_rate < gate.hit_rate
    assert all(gate.ready_rate_per_layer[i] <= rate for i, rate in gate.hit_rate_per_layer.items())
    assert gate.ready_rate_per_layer[0] == gate.hit_rate_per_layer[0]  # layer 0: no prefetch


def test_next_gate_prefetch_raises_the_hit_rate_and_reports_precision():
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2, seed=1)
    prompt = torch.tensor([[7, 3, 9, 1, 4]])
    _, none = _generate(model, "autoregressive", prompt, 24, offload=_offload(slots=3))
    _, gate = _generate(model, "autoregressive", prompt, 24,
                        offload=_offload(slots=3, prefetch="next_gate"))  # fmt: skip
    a, b = none.last_offload_report, gate.last_offload_report
    assert b.hit_rate > a.hit_rate and b.prefetch_hit_rate > 0
    assert a.prefetch_precision is None and 0 < b.prefetch_precision <= 1
    assert 0 < b.prefetch_recall <= 1 and b.prefetch_bytes_per_token > 0
    assert set(b.hit_rate_per_layer) == {0, 1, 2, 3}
    # Layer 0 has no earlier layer to predict it from.
    assert b.hit_rate_per_layer[0] == pytest.approx(a.hit_rate_per_layer[0])


def test_stall_per_layer_sums_to_the_stall_and_follows_the_misses():
    """Every load is delayed 3 ms: a layer stalls when it has misses, never without; the
    per-layer stalls add up to the total."""
    model = tiny_moe_model("olmoe", layers=3, experts=6, top_k=2, seed=2)
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    options = _offload(slots=6, transfer_delay_s=0.003, engine="thread")
    sm = rewrite.apply(model, "autoregressive", offload=options)
    try:
        reports = []
        for _ in range(2):  # cold slots (misses in every layer), then warm (all experts held)
            sm.generate(prompt, max_new_tokens=6)
            reports.append((sm.last_offload_report, sm.offload.slot_stats()))
    finally:
        sm.offload.close()
    for report, stats in reports:
        per_layer = report.stall_ms_per_token_per_layer
        assert set(per_layer) == {0, 1, 2}
        assert sum(per_layer.values()) == pytest.approx(report.stall_ms_per_token)
        for layer, stall in per_layer.items():
            if stats[layer].misses:  # waited for at least one 3 ms read
                assert stall * report.new_tokens >= 3.0 * 0.9
            else:
                assert stall == 0.0
    assert all(s.misses for s in reports[0][1].values())
    assert not any(s.misses for s in reports[1][1].values())
    assert summarize([reports[1][0]])["stall_ms_per_token_per_layer"] == {"0": 0, "1": 0, "2": 0}
    summary = summarize([reports[0][0], reports[1][0]])["stall_ms_per_token_per_layer"]
    first = reports[0][0].stall_ms_per_token_per_layer
    assert summary == pytest.approx({str(i): v / 2 for i, v in first.items()})


def test_a_prefetch_call_never_loads_two_experts_into_one_slot():
    """With one idle slot, a call's second candidate must not evict the first (the reads of a
    job run side by side, so two reads into one slot would land in no set order)."""
    model = tiny_moe_model("olmoe", layers=2, experts=6, top_k=2)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2, tier="host"))
    runtime = sm.offload
    layer = runtime.layers[0]
    cache = runtime.caches[layer]
    cache.demand([0, 1])
    cache.release([0, 1])
    cache.begin_load(cache.slot_of[0])  # slot of expert 0 receiving a load: not a victim
    runtime.prefetch_experts(layer, [4, 5])
    assert 4 in cache.slot_of and 5 not in cache.slot_of
    assert runtime.counters.prefetch_calls[-1][0] == runtime.expert_bytes
    runtime.synchronize()
    runtime.close()


def test_a_prefetch_call_never_evicts_its_own_resident_candidates():
    """Candidates [2, 0] with 0 resident and least recently used: loading 2 evicts 1, not 0 (a
    candidate later in the list is touched before any load of the call)."""
    model = tiny_moe_model("olmoe", layers=2, experts=6, top_k=2)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=2, tier="host"))
    runtime = sm.offload
    layer = runtime.layers[0]
    cache = runtime.caches[layer]
    for expert in (0, 1):  # 0 first: the least recently used
        cache.release([cache.demand([expert])[0].expert])
    runtime.prefetch_experts(layer, [2, 0])
    runtime.synchronize()
    assert set(cache.slot_of) == {0, 2}
    assert runtime.counters.prefetch_calls[-1][0] == runtime.expert_bytes  # 0 was not reloaded
    runtime.close()


def test_a_union_prefetch_never_evicts_the_rounds_earlier_predictions():
    """verify_union: a round's drafts predicted experts 0-3 of a 4-slot layer (all resident,
    unpinned); a later draft's prediction [4, 5] must not evict any of them: the verify pass
    needs the whole union, so a load for 4 would only move which expert it misses. Without a
    union, the call's prediction replaces the earlier one and 4 evicts the least recent."""
    model = tiny_moe_model("olmoe", layers=2, experts=8, top_k=2)
    sm = rewrite.apply(model, "autoregressive", offload=OffloadOptions(slots=4, tier="host"))
    runtime = sm.offload
    layer = runtime.layers[0]
    cache = runtime.caches[layer]
    runtime.prefetch_experts(layer, [0, 1], union=True)
    runtime.prefetch_experts(layer, [2, 3], union=True)
    runtime.synchronize()
    assert set(cache.slot_of) == {0, 1, 2, 3}
    moved = len(runtime.counters.prefetch_calls)
    runtime.prefetch_experts(layer, [4, 5], union=True)
    assert set(cache.slot_of) == {0, 1, 2, 3}
    assert runtime._predicted[layer] == {0, 1, 2, 3, 4, 5}  # still scored as the union
    assert runtime.counters.prefetch_calls[moved][0] == 0
    runtime.prefetch_experts(layer, [4, 5])  # a fresh prediction: 0 and 1 are LRU's victims
    runtime.synchronize()
    assert set(cache.slot_of) == {2, 3, 4, 5}
    runtime.close()


def test_prefetch_budget_zero_moves_nothing_ahead():
    model = tiny_moe_model("mixtral", layers=3, experts=6, top_k=2)
    prompt = torch.tensor([[1, 2, 3, 4]])
    options = _offload(slots=2, prefetch="next_gate", prefetch_budget=0)
    _, sm = _generate(model, "autoregressive", prompt, 8, offload=options)
    assert sm.last_offload_report.prefetch_bytes_per_token == 0
    assert sm.last_offload_report.prefetch_precision is not None  # still predicted and scored


def test_offload_graph_nodes():
    model = tiny_moe_model("qwen2_moe", layers=3, dense_layers=(1,))
    sm = rewrite.apply(model, "layerskip", exit_layer=1,
                       offload=_offload(slots=2, prefetch="next_gate"))  # fmt: skip
    gm = sm.graph_module
    assert [n.target for n in nodes_by_role(gm, "experts")] == [
        "leapfx_offload.experts_0", "leapfx_offload.experts_2"]  # fmt: skip
    prefetch = nodes_by_role(gm, "prefetch")
    assert [n.meta["leapfx.prefetch_layer"] for n in prefetch] == [2]
    # The draft (layer 0) keeps the prefetch of layer 2 although nothing reads its output.
    assert nodes_by_role(sm.stages["draft"], "prefetch")
    # The offloaded stages do not hold the expert weights.
    names = {n for n, _ in sm.stages["full"].named_parameters()}
    assert not any("experts" in n for n in names)
    sm.offload.close()


@pytest.mark.parametrize("prefetch", ["next_gate", "m2r2"])
def test_the_offload_pass_only_rewrites_and_build_offload_binds(prefetch):
    # The pass inserts unbound modules: no runtime, no file, no thread, nothing in gm.meta;
    # build_offload builds the one ExpertOffload and binds every module the pass inserted.
    import threading

    from leapfx.modules.moe import OffloadModule
    from leapfx.offload import build_offload
    from leapfx.passes.base import PassPipeline
    from leapfx.passes.capture import capture
    from leapfx.passes.offload import OffloadExperts

    model = tiny_moe_model("olmoe", layers=4)
    threads = threading.active_count()
    gm = PassPipeline([OffloadExperts(prefetch=prefetch)])(capture(model))
    assert threading.active_count() == threads
    assert "leapfx.offload" not in gm.meta
    bound = [m for m in gm.modules() if isinstance(m, OffloadModule)]
    assert len(bound) > 4 and all(m._runtime is None for m in bound)  # experts + prefetches
    with pytest.raises(RuntimeError, match="build_offload"):
        gm.leapfx_offload.experts_0(None, None, None)
    runtime = build_offload(gm, OffloadOptions(slots=2, prefetch=prefetch, tier="host"))
    assert all(m.runtime is runtime for m in bound)
    assert runtime.layers == [0, 1, 2, 3] and runtime.num_slots == 2
    runtime.close()
    with pytest.raises(ValueError, match="offload-experts pass"):
        build_offload(capture(model), OffloadOptions(slots=2))


def test_disk_store_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    gate_up, down = torch.randn(3, 8, 4), torch.randn(3, 4, 4)
    disk = DiskStore({0: (gate_up, down)}, path=tmp_path / "experts.bin")
    a, b = torch.empty(8, 4), torch.empty(4, 4)
    disk.read_into(0, 1, a, b)
    assert torch.equal(a, gate_up[1]) and torch.equal(b, down[1])
    disk.close()
    assert (tmp_path / "experts.bin").exists()  # a path the caller gave is kept
    real_open = os.open

    def refusing_open(path, flags, *args):  # what tmpfs on older kernels does
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    with pytest.warns(UserWarning, match="O_DIRECT is refused"):
        store = DiskStore({0: (gate_up, down)})
    assert not store.direct
    store.read_into(0, 2, a, b)
    assert torch.equal(a, gate_up[2]) and torch.equal(b, down[2])
    path = store.path
    store.close()
    assert not os.path.exists(path)  # a temporary file is removed


def test_disk_store_reads_straight_into_aligned_slots(tmp_path):
    """Block-sized expert slices land in ``aligned_pool`` slots by one preadv (no bounce
    buffer); unaligned targets still get the same bytes through the bounce buffer."""
    from leapfx.offload.store import ALIGN, aligned_pool

    gate_up, down = torch.randn(3, 32, 64), torch.randn(3, 64, 16)  # 8 KiB and 4 KiB slices
    store = DiskStore({0: (gate_up, down)}, path=tmp_path / "experts.bin")
    pool_a = aligned_pool((2, 32, 64), torch.float32, float("nan"))
    pool_b = aligned_pool((2, 64, 16), torch.float32, float("nan"))
    assert pool_a.data_ptr() % ALIGN == 0 and pool_a[1].data_ptr() % ALIGN == 0
    assert torch.isnan(pool_a).all()
    for expert, slot in ((2, 1), (0, 0), (1, 1)):
        assert store.read_into(0, expert, pool_a[slot], pool_b[slot]) == 8192 + 4096
        assert torch.equal(pool_a[slot], gate_up[expert])
        assert torch.equal(pool_b[slot], down[expert])
    assert getattr(store._local, "buf", None) is None  # no read went through the bounce buffer
    unaligned = torch.empty(32 * 64 + 1)[1:].view(32, 64)
    store.read_into(0, 2, unaligned, pool_b[0])
    assert torch.equal(unaligned, gate_up[2]) and torch.equal(pool_b[0], down[2])
    assert store._local.buf is not None
    store.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"slots": 0}, "slots"),
        ({"slots": 1.5}, "slots"),
        ({"policy": "fifo"}, "policy"),
        ({"prefetch": "m3"}, "prefetch"),
        ({"prefetch_budget": -1}, "prefetch_budget"),
        ({"tier": "nvme"}, "tier"),
        ({"slow_dtype": "int8"}, "slow_dtype: 'int8' is invalid"),
        ({"policy": "reuse"}, "reuse_probe: missing with policy='reuse'"),
        ({"reuse_probe": "probe.safetensors"}, "reuse_probe: given with policy='lru'"),
        ({"policy": "reuse", "reuse_probe": 3}, "reuse_probe: 3 is invalid"),
        ({"policy": "reuse", "reuse_probe": "/nonexistent.safetensors"}, "is not a file"),
        ({"prefetch_lead": 0}, "prefetch_lead: 0 is invalid; allowed: None .* or an integer >= 1"),
        ({"prefetch_lead": 1.5}, "prefetch_lead: 1.5 is invalid"),
        ({"prefetch_lead": True}, "prefetch_lead: True is invalid"),
    ],
)
def test_offload_options_are_validated(kwargs, match):
    model = tiny_moe_model("olmoe", layers=2)
    with pytest.raises(ValueError, match=match):
        rewrite.apply(model, "autoregressive", offload=OffloadOptions(**kwargs))


def test_the_bench_slow_dtype_choices_are_the_runtime_ones():
    """``leapfx bench --offload-slow-dtype`` spells OffloadOptions' choices (the parser does
    not import the runtime): "none" stands for None."""
    from leapfx.cli import build_parser
    from leapfx.offload.runtime import SLOW_DTYPES

    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    action = next(a for a in bench._actions if a.dest == "offload_slow_dtype")
    assert tuple(None if c == "none" else c for c in action.choices) == SLOW_DTYPES


def test_offload_refuses_dense_models_and_compiled_backends():
    from tests.conftest import tiny_model

    with pytest.raises(ValueError, match="no MoE layers"):
        rewrite.apply(tiny_model("llama", layers=2), "autoregressive", offload=OffloadOptions())
    with pytest.raises(ValueError, match="eager"):
        rewrite.apply(tiny_moe_model("olmoe", layers=2), "autoregressive", backend="inductor",
                      offload=OffloadOptions())  # fmt: skip
    with pytest.raises(ValueError, match="slots"):
        rewrite.apply(tiny_moe_model("olmoe", layers=2, experts=4), "autoregressive",
                      offload=OffloadOptions(slots=5))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["no-delay", "delayed-copies"])
@pytest.mark.parametrize("prefetch", ["none", "next_gate"])
def test_cuda_engine_offload_is_token_identical(prefetch, delay):
    """Poisoned slots, and with ``delay`` every copy starts 2 ms late on its stream: only the
    compute stream's waits on the copies' events keep the NaN out."""
    model = tiny_moe_model("olmoe", layers=4, experts=8, top_k=2).cuda()
    prompt = torch.tensor([[3, 1, 4, 1, 5]], device="cuda")
    resident, _ = _generate(model, "layerskip", prompt, 24, exit_layer=1)
    options = _offload(slots=3, prefetch=prefetch, transfer_delay_s=delay)
    ours, sm = _generate(model, "layerskip", prompt, 24, offload=options, exit_layer=1)
    assert type(sm.offload.engine).__name__ == "CudaEngine"
    assert sm.offload.store.pinned
    assert torch.equal(ours, resident)
    assert sm.last_offload_report.hit_rate > 0
    assert sm.last_offload_report.ready_rate is None  # not known on the host


@pytest.mark.gpu
def test_cuda_engine_a_missing_wait_reads_poison():
    """The CUDA engine's poisoning catches a compute stream that does not wait for its copy."""
    model = tiny_moe_model("olmoe", layers=2, experts=4, top_k=2).cuda()
    prompt = torch.tensor([[1, 2, 3]], device="cuda")
    sm = rewrite.apply(model, "autoregressive",
                       offload=_offload(slots=2, transfer_delay_s=0.05))  # fmt: skip
    runtime = sm.offload
    assert type(runtime.engine).__name__ == "CudaEngine"
    runtime.engine.wait = lambda ticket: 0.0  # the bug: no wait on the copy's event
    positions = torch.arange(3, device="cuda")[None]
    logits = sm.stages["full"](prompt, positions, {"full_attention": None}, None)
    torch.cuda.synchronize()
    runtime.close()
    assert torch.isnan(logits["logits"]).any()


def test_offloaded_moe_layerskip_sampling_matches_target_distribution():
    """Rejection sampling over an offloaded MoE model: the target's distribution (chi-square)."""

    from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, _exact_distribution

    model = tiny_moe_model("qwen2_moe", layers=3, vocab=6, heads=2, kv_heads=1, experts=4,
                           seed=11)  # fmt: skip
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact_distribution(model, prompt, 3)
    options = OffloadOptions(slots=2, tier="host", prefetch="next_gate")
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=4, offload=options)
    g = torch.Generator().manual_seed(99)
    n = 3000
    counts = dict.fromkeys(exact, 0)
    for _ in range(n):
        out = sm.generate(prompt, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                          top_p=TOP_P, max_new_tokens=3, generator=g)  # fmt: skip
        counts[tuple(out[0, 3:].tolist())] += 1
    sm.offload.close()
    assert_sampled_from(counts, exact, n)


def test_trace_and_timeline_plot(tmp_path):
    from leapfx.bench.offload import plot_offload

    model = tiny_moe_model("olmoe", layers=3, experts=6, top_k=2)
    sm = rewrite.apply(model, "autoregressive",
                       offload=OffloadOptions(slots=2, prefetch="next_gate"))  # fmt: skip
    sm.offload.trace = []
    sm.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=6)
    trace = sm.offload.trace
    lanes = {span[0] for span in trace}
    assert {"compute", "demand"} <= lanes and all(span[3] <= span[4] for span in trace)
    assert sum(1 for span in trace if span[0] == "compute") == 3 * 6  # 3 layers x 6 calls
    rates = sm.last_offload_report.hit_rate_per_layer
    path = plot_offload({"next_gate": trace}, {"next_gate": rates}, tmp_path / "t.png")
    assert path.stat().st_size > 0
    sm.offload.close()


def test_offload_command_runs_on_a_device_and_dtype(tmp_path, capsys):
    """`python -m leapfx.bench.offload --device/--dtype`: rows on a tiny random model, and a
    clear refusal of CUDA where this torch build has none."""
    from leapfx.bench.offload import main

    small = ["--layers", "2", "--hidden", "32", "--experts", "4", "--top-k", "2",
             "--intermediate", "32", "--prompts", "1", "--tokens", "4", "--slots", "2"]  # fmt: skip
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device: 'cuda'"):
            main([*small, "--device", "cuda"])
    out = tmp_path / "rows.json"
    main([*small, "--dtype", "bfloat16", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows][:2] == ["leapfx_resident", "leapfx_offload_none"]
    assert all(r["identical"] for r in rows)
    assert "| leapfx_offload_none |" in capsys.readouterr().out
