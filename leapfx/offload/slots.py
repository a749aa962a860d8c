"""SlotCache: which expert sits in which fast-tier slot of one MoE layer (bookkeeping only).

The fast tier of a layer is a fixed pool of ``num_slots`` expert slots; it is never exceeded:
every expert the layer computes with sits in a slot. This class decides, and only decides:
which slot an expert goes to, which expert is evicted for it, which slots are pinned. The
transfers themselves belong to the transfer engine; the tensors to ``ExpertOffload``.

Rules (a pure-Python LRU/LFU model in tests/test_offload.py replays them exactly):

- ``demand(experts)``: the experts a layer needs now, in order. A resident one is a hit; a
  missing one takes the lowest free slot, else evicts the policy's victim among the resident
  experts that are not pinned. All of them are pinned until ``release``: what the current layer
  needs is never evicted, and a slot is never overwritten while in use. ``hit(experts)``, for
  experts that are all resident, is ``demand`` and ``release`` at once.
- A slot whose load is in flight is ``busy`` (``begin_load`` .. ``end_load``) and is not a
  victim either: two transfers never target one slot at once. ``demand_one`` returns None when
  every slot is pinned or busy; the caller waits for a load to finish and asks again.
- ``prefetch(expert, keep)``: load ahead of use into a free slot or the policy's unpinned
  victim outside ``keep``; refused (None) when there is none (every slot pinned, busy or
  kept). A prefetched expert is "speculative" until a demand uses it (a prefetch hit) or it is
  evicted unused (wasted bytes).
- Policies. ``lru``: evict the least recently used (demand or prefetch). ``lfu``: evict the
  least frequently demanded (counts survive only while resident), ties to the least recent.
  A clock that ticks on every event orders recency; it is exact, not wall time. ``reuse``:
  evict the expert with the lowest ``scores`` entry, ties to the least recent: the scores are
  a learned estimate of how likely each expert is to be used by the next few tokens
  (``leapfx.offload.reuse.ReuseProbe``), set by the runtime from what the layer saw
  last; before the first scores arrive, ``reuse`` is LRU.
  ``victim_key`` (None: the policy) replaces the policy's order: a function of an expert, the
  smallest key evicted first (``leapfx.bench.offload.RoutingOracle`` sets one that knows the
  future, to measure the optimal eviction).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("lru", "lfu", "reuse")


@dataclass
class SlotStats:
    """Counts of one layer's cache since the last reset."""

    hits: int = 0  # demanded and resident (prefetch hits included)
    misses: int = 0  # demanded and loaded on demand
    prefetch_hits: int = 0  # demanded and resident because a prefetch brought it
    prefetches: int = 0  # loads issued by prefetch
    evictions: int = 0
    wasted_prefetches: int = 0  # prefetched, evicted before any demand used it

    def add(self, other: SlotStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class Placement:
    """Where a demanded or prefetched expert goes: ``load`` is False for a hit."""

    expert: int
    slot: int
    load: bool
    evicted: int | None = None  # the expert that lost the slot, if any


@dataclass
class SlotCache:
    """The slot map and eviction policy of one layer's fast tier."""

    num_slots: int
    policy: str = "lru"
    expert_of: list[int | None] = field(init=False)  # slot -> expert
    slot_of: dict[int, int] = field(init=False, default_factory=dict)  # expert -> slot
    pins: list[int] = field(init=False)  # slot -> pin count
    stats: SlotStats = field(init=False, default_factory=SlotStats)
    _last: dict[int, int] = field(init=False, default_factory=dict)  # expert -> clock
    _uses: dict[int, int] = field(init=False, default_factory=dict)  # expert -> demands
    _speculative: set[int] = field(init=False, default_factory=set)
    busy: set[int] = field(init=False, default_factory=set)  # slots with a load in flight
    _clock: int = field(init=False, default=0)
    # expert -> key, the smallest evicted first, in place of the policy's order (None: policy)
    victim_key: Callable[[int], Any] | None = field(init=False, default=None)
    # policy "reuse": expert -> score (the lowest evicted first); None: none yet (LRU)
    scores: list[float] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is invalid; allowed: {', '.join(POLICIES)}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots: {self.num_slots!r} is invalid; allowed: >= 1")
        self.expert_of = [None] * self.num_slots
        self.pins = [0] * self.num_slots

    def _tick(self, expert: int) -> None:
        self._clock += 1
        self._last[expert] = self._clock

    def _victim_key(self, expert: int) -> tuple[float, int]:
        if self.policy == "lfu":
            return (self._uses.get(expert, 0), self._last[expert])
        if self.policy == "reuse" and self.scores is not None:
            return (self.scores[expert], self._last[expert])
        return (0, self._last[expert])

    def _slot_for(self, expert: int, keep: Collection[int] = ()) -> tuple[int, int | None] | None:
        """A free slot, else the unpinned victim's (never one of ``keep``); None when there is
        no such slot."""
        for slot, held in enumerate(self.expert_of):
            if held is None:
                return slot, None
        candidates = [
            e for e, s in self.slot_of.items()
            if self.pins[s] == 0 and s not in self.busy and e not in keep
        ]  # fmt: skip
        if not candidates:
            return None
        victim = min(candidates, key=self.victim_key or self._victim_key)
        return self.slot_of[victim], victim

    def _place(self, expert: int, slot: int, evicted: int | None) -> None:
        if evicted is not None:
            assert self.pins[slot] == 0 and slot not in self.busy, "never evict a slot in use"
            del self.slot_of[evicted]
            self._uses.pop(evicted, None)
            self.stats.evictions += 1
            if evicted in self._speculative:
                self._speculative.discard(evicted)
                self.stats.wasted_prefetches += 1
        self.expert_of[slot] = expert
        self.slot_of[expert] = slot

    def demand_one(self, expert: int) -> Placement | None:
        """Place and pin one demanded expert; None when no slot is free, unpinned and idle."""
        slot = self.slot_of.get(expert)
        if slot is not None:
            self.stats.hits += 1
            if expert in self._speculative:
                self._speculative.discard(expert)
                self.stats.prefetch_hits += 1
            placement = Placement(expert, slot, load=False)
        else:
            found = self._slot_for(expert)
            if found is None:
                return None
            slot, evicted = found
            self._place(expert, slot, evicted)
            self.stats.misses += 1
            placement = Placement(expert, slot, load=True, evicted=evicted)
        self.pins[slot] += 1
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._tick(expert)
        return placement

    def hit(self, experts: list[int]) -> None:
        """``demand(experts)`` then ``release(experts)`` where every one of ``experts`` is
        resident: the same counts and policy order, nothing left pinned (a caller whose compute
        is done before it places anything else needs no pin: ``ExpertOffload``'s fast path)."""
        missing = [e for e in experts if e not in self.slot_of]
        if missing:
            raise KeyError(f"hit: experts {missing} are not resident; allowed: resident ones")
        stats, uses = self.stats, self._uses
        for expert in experts:
            stats.hits += 1
            if expert in self._speculative:
                self._speculative.discard(expert)
                stats.prefetch_hits += 1
            uses[expert] = uses.get(expert, 0) + 1
            self._clock += 1
            self._last[expert] = self._clock

    def demand(self, experts: list[int]) -> list[Placement]:
        """``demand_one`` for each of ``experts`` (distinct, at most num_slots, no load busy)."""
        assert len(set(experts)) == len(experts) <= self.num_slots, "caller splits waves"
        placements = [self.demand_one(e) for e in experts]
        assert all(p is not None for p in placements), "no slot: wait for busy loads first"
        return placements

    def begin_load(self, slot: int) -> None:
        self.busy.add(slot)

    def end_load(self, slot: int) -> None:
        self.busy.discard(slot)

    def release(self, experts: list[int]) -> None:
        """Unpin what ``demand`` pinned."""
        for expert in experts:
            slot = self.slot_of[expert]
            assert self.pins[slot] > 0, "release without demand"
            self.pins[slot] -= 1

    def prefetch(self, expert: int, keep: Collection[int] = ()) -> Placement | None:
        """Place ``expert`` ahead of use; None if no slot is free, unpinned and idle, or every
        such slot holds one of ``keep`` (experts still wanted: never evicted for a prefetch).

        A resident expert is only touched (its recency refreshed, so that the prefetches that
        follow in the same call do not evict it) and None is returned.
        """
        if expert in self.slot_of:
            self._tick(expert)
            return None
        found = self._slot_for(expert, keep)
        if found is None:
            return None
        slot, evicted = found
        self._place(expert, slot, evicted)
        self._speculative.add(expert)
        self.stats.prefetches += 1
        self._tick(expert)
        return Placement(expert, slot, load=True, evicted=evicted)

    def resident(self) -> dict[int, int]:
        """expert -> slot, a copy."""
        return dict(self.slot_of)
