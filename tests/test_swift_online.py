"""``swift`` with ``search="online"``: SWIFT's on-the-fly skip-set search
(``leapfx.runtime.skip_search``, ``leapfx.runtime.swift.OnlineSkipDrafter``).

Lossless whatever sets it tries (hypothesis against HF greedy, dense and MoE, alone and under
``lookup``/``adaptive``; the sampled distribution); on a synthetic cost/acceptance table it
finds the set exhaustive search finds; on a synthetic model with a controlled clock it stops
drafting where every draft is rejected, and drafts with the set that pays where one does.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.runtime import adaptive
from leapfx.runtime.adaptive import MARGIN, AdaptiveDrafter, Policies, expected_tokens
from leapfx.runtime.lookup import PromptLookup
from leapfx.runtime.metrics import DecodeMetrics
from leapfx.runtime.rounds import speculative_loop
from leapfx.runtime.sampling import SamplingParams
from leapfx.runtime.schedules import DecodeRequest
from leapfx.runtime.skip_search import OnlineSkipSearch
from leapfx.runtime.swift import OnlineSkipDrafter
from tests.conftest import examples, tiny_model, tiny_moe_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lossless import model_specs
from tests.test_moe import moe_specs
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution
from tests.test_swift import _skip_set

# -- lossless whatever it tries ------------------------------------------------------------


def _online(model, data, layers: int, **options):
    """A swift model searching online, its trials one timed round long (so that a short decode
    tries many sets), from a drawn starting set."""
    d = data.draw(st.integers(1, 5), label="num_speculations")
    sm = rewrite.apply(model, "swift", search="online", num_speculations=d,
                       skip_layers=_skip_set(data, layers), **options)  # fmt: skip
    sm.skip_search.rounds = 1
    return sm, d


@settings(max_examples=examples(10, 40), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_online_search_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    ids = data.draw(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=24))
    prompt = torch.tensor([ids])
    with_lookup = data.draw(st.booleans(), label="lookup")
    with_adaptive = data.draw(st.booleans(), label="adaptive")
    sm, d = _online(model, data, spec["layers"], lookup=with_lookup, adaptive=with_adaptive,
                    max_ngram=2)  # fmt: skip
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    want = hf_greedy(model, prompt, max_new)
    for _ in range(3):  # later calls go on from the search's state
        ours = sm.generate(prompt, max_new_tokens=max_new)
        assert_greedy_equal(model, ours, want, prompt.shape[1])
        m = sm.last_metrics
        assert all(1 <= s <= d + 1 for s in m.accepted_per_verify)
        assert m.skip_search == sm.skip_search.as_dict()
        assert set(m.drafter_rounds) <= {"swift", "lookup", "declined", "none"}
    assert len(sm.skip_search.order) >= 1 and sm.skip_search.order[0] == ()


@settings(max_examples=examples(4, 10), deadline=None)
@given(spec=moe_specs(), data=st.data())
def test_online_search_greedy_identical_to_hf_on_moe(spec, data):
    model = tiny_moe_model(**spec)
    ids = data.draw(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=16))
    prompt = torch.tensor([ids])
    sm, _ = _online(model, data, spec["layers"])
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    for _ in range(2):
        ours = sm.generate(prompt, max_new_tokens=max_new)
        assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])


def test_online_search_sampling_matches_target_distribution():
    model = tiny_model("llama", layers=4, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact_distribution(model, prompt, 3)
    # one draft a round: each 3-token decode has a full-length round (d = 1) for the search
    sm = rewrite.apply(model, "swift", search="online", num_speculations=1)
    sm.skip_search.rounds = 1  # many sets tried over the decodes, each drafting some rounds
    n = 3000
    counts, _, drafted = sample_counts(
        sm, prompt, exact, 3, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert drafted > 0 and len(sm.skip_search.order) > 2
    assert_sampled_from(counts, exact, n)


def test_online_search_state_persists_reports_and_resets():
    model = tiny_model("llama", layers=5, vocab=40, seed=2)
    sm = rewrite.apply(model, "swift", search="online", num_speculations=3)
    search = sm.skip_search
    search.rounds = 1
    prompt = torch.tensor([[1, 2, 3, 4, 1, 2]])
    sm.generate(prompt, max_new_tokens=6)
    tried = len(search.order)
    for _ in range(4):
        sm.generate(prompt, max_new_tokens=24)
    assert sm.skip_search is search and len(search.order) >= tried  # one search a model
    assert search.order[:2] == [(), sm.options.skip_layers]  # the baseline, the starting set
    report = search.as_dict()
    assert report["trials"][0]["skip_layers"] == [] and report["trials"][0]["acceptance"] is None
    assert sm.last_metrics.as_dict()["skip_search"] == report
    text = search.summary()
    assert text.startswith("skip-set search:") and "x plain" in text
    search.reset()
    assert search.order == [()] and not search.done and search.chosen is None
    assert rewrite.apply(model, "swift").skip_search is None  # a fixed set: no search


def test_online_search_options_are_validated():
    model = tiny_model("llama", layers=4)
    for bad in ["offline", "Online", True, 1]:
        with pytest.raises(ValueError, match=r"search: .* is invalid; allowed: None .* 'online'"):
            rewrite.apply(model, "swift", search=bad)
    with pytest.raises(ValueError, match=r"skip_layers: .* allowed: distinct layer indices"):
        rewrite.apply(model, "swift", search="online", skip_layers=(4,))
    sm = rewrite.apply(model, "swift", search="online")
    with pytest.raises(ValueError, match=r"calibrate: this swift model searches .* search=None"):
        sm.calibrate([torch.tensor([[1, 2, 3]])])


def test_save_parts_keeps_the_set_the_search_chose(tmp_path):
    model = tiny_model("llama", layers=5, vocab=32, seed=2)
    sm = rewrite.apply(model, "swift", search="online", num_speculations=3)
    search = sm.skip_search
    search.bind(5)
    search.done, search.chosen = True, (2, 3)
    sm.save_parts(tmp_path / "parts")
    loaded = rewrite.apply(model, "swift", parts=tmp_path / "parts")
    assert loaded.options.skip_layers == (2, 3)


# -- the search on a synthetic table -------------------------------------------------------


def _table(L: int, d: int, seed: int):
    """Additive layer harms (acceptance 0.98 - the skipped layers' harms) and a round's cost
    (a verify of 1.1 plain steps and d draft calls of the head and the kept layers); the
    tokens/s of each set and the set exhaustive search finds."""
    g = torch.Generator().manual_seed(seed)
    harm = (torch.rand(L, generator=g) * 0.3).tolist()

    def alpha(skip):
        return max(0.0, 0.98 - sum(harm[i] for i in skip))

    def cost(skip):
        return 1.0 if not skip else 1.1 + d * (0.1 + 0.9 * (L - len(skip)) / L)

    def rate(skip):
        return (expected_tokens(alpha(skip), d) if skip else 1.0) / cost(skip)

    subsets = [s for k in range(L) for s in itertools.combinations(range(1, L), k)]
    return alpha, cost, rate, max(subsets, key=rate)


def _search_table(L: int, d: int, seed: int, rounds: int) -> tuple[OnlineSkipSearch, int]:
    """Run the search to its end on ``_table``: each round's accepted drafts follow the
    set's acceptance (a geometric count over an evenly spread sequence, so a trial's mean is
    close to the table's), its seconds the set's cost."""
    alpha, cost, _, _ = _table(L, d, seed)
    search = OnlineSkipSearch(start=tuple(range(1, L - 1, 2)), draft_length=d, rounds=rounds)
    search.bind(L)
    rounds_run, drafting = 0, 0
    while not search.done:
        skip = search.current
        rounds_run += 1
        if not skip:
            search.observe((), 0, 0, 1.0)
            continue
        u = ((drafting + 0.5) * (math.sqrt(5) - 1) / 2) % 1.0
        drafting += 1
        k = 0
        while k < d and alpha(skip) ** (k + 1) > u:
            k += 1
        search.observe(skip, d, k, cost(skip))
    return search, rounds_run


@pytest.mark.parametrize("L,seed", [(6, 3), (6, 4), (6, 5), (8, 3), (10, 4)])
def test_search_finds_the_best_set_of_a_synthetic_table(L, seed):
    d = 4
    _, _, rate, truth = _table(L, d, seed)
    assert truth and rate(truth) > 1 + MARGIN  # tables where a set pays
    search, _ = _search_table(L, d, seed, rounds=30)
    assert search.done and search.chosen == truth
    assert len(search.order) <= min(search.max_trials, 2 ** (L - 1) // 2)  # far from every set


@pytest.mark.parametrize("L,seed", [(8, 2), (10, 0)])
def test_search_ends_on_plain_steps_where_no_set_pays(L, seed):
    d = 4
    _, _, rate, truth = _table(L, d, seed)
    assert truth == ()
    search, rounds_run = _search_table(L, d, seed, rounds=30)
    assert search.done and search.chosen == ()
    assert len(search.order) <= 2 + search.random_trials + search.patience + 1


def test_search_of_a_tiny_model_ends_when_no_set_is_left():
    search = OnlineSkipSearch(start=(1,), draft_length=2, rounds=1)
    search.bind(2)  # one layer to skip: the baseline and (1,) are every set
    while not search.done:
        drafted = 2 if search.current else 0  # every draft kept, a round as dear as a step
        search.observe(search.current, drafted, drafted, 0.5)
    assert search.order == [(), (1,)] and search.chosen == (1,)


# -- a synthetic model with a controlled clock ---------------------------------------------

V = 11


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Cache:
    def crop(self, length: int) -> None:
        pass

    def crop_rows(self, ends: list[int]) -> None:
        pass


class _Runner:
    """A full call over S tokens costs 1 + 0.05 (S - 1); its next token is (token + 1) % V."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.cache = clock, _Cache()

    def keep(self, rows: list[int]) -> None:  # the decode's one row goes on or ends
        pass

    def full(self, ids: torch.Tensor, start: int, key=None) -> torch.Tensor:
        self.clock.now += 1.0 + 0.05 * (ids.shape[1] - 1)
        return torch.nn.functional.one_hot((ids + 1) % V, V).float()  # [1, S, V]


class _DraftRunner:
    """The draft stage of ``skip`` on a 6-layer model: a call costs 0.05 + 0.15 a kept layer;
    it drafts the right token where ``skip`` is within ``harmless``, else a wrong one."""

    def __init__(self, clock: _Clock, skip: tuple[int, ...], harmless: set[int]) -> None:
        self.clock, self.skip, self.right = clock, skip, set(skip) <= harmless

    def chunk(self, name: str, ids: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        self.clock.now += 0.05 + 0.15 * (6 - len(self.skip))
        step = 1 if self.right else 2
        return {"logits": torch.nn.functional.one_hot((ids + step) % V, V).float()}


class _Stages:
    def __init__(self, clock: _Clock, harmless: set[int]) -> None:
        self.clock, self.harmless = clock, harmless

    def runner(self, runner, skip):
        return _DraftRunner(self.clock, skip, self.harmless)


def _decode(monkeypatch, harmless: set[int], *, adaptive_lookup: bool = False, tokens=400):
    clock = _Clock()
    monkeypatch.setattr(adaptive.time, "perf_counter", clock)  # the time module's, for both
    search = OnlineSkipSearch(start=(1, 3), draft_length=4)
    search.bind(6)
    own = OnlineSkipDrafter(search, _Stages(clock, harmless))
    prompt = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]])  # the cycle, once
    drafter = own
    if adaptive_lookup:
        drafter = AdaptiveDrafter(own, PromptLookup(prompt[0].tolist(), 2, 1), Policies())
    request = DecodeRequest(tokens, frozenset(), SamplingParams())
    metrics = DecodeMetrics(schedule="swift")
    out = speculative_loop(_Runner(clock), prompt, request, metrics, 4, drafter)
    assert out == [(1 + i) % V for i in range(tokens)]  # every choice stays lossless
    return search, metrics.drafter_rounds, clock.now


def test_drafting_stops_when_every_draft_is_rejected(monkeypatch):
    search, rounds, seconds = _decode(monkeypatch, harmless=set())
    assert search.done and search.chosen == ()
    trials = len(search.order)
    assert trials <= 2 + search.random_trials + search.patience + 1
    # the search's drafting rounds only: (its warm-up and timed rounds) a set, the rest plain
    assert rounds["swift"] <= (trials - 1) * 2 * (1 + search.rounds)
    assert rounds["declined"] >= 400 - 2 * rounds["swift"] - trials * (1 + search.rounds)
    assert all(t.alpha == 0.0 for s, t in search.trials.items() if s)


def test_the_search_drafts_with_the_set_that_pays(monkeypatch):
    search, rounds, seconds = _decode(monkeypatch, harmless={2, 3, 4})
    assert search.done and search.chosen == (2, 3, 4)  # the most layers whose drafts are right
    assert rounds["swift"] > 0.8 * sum(rounds.values())
    assert seconds < 0.85 * 400  # plain steps take 400: the search's rounds paid back


def test_adaptive_falls_back_to_lookup_when_no_set_pays(monkeypatch):
    # the text repeats the prompt's cycle: lookup pays, no skip set does
    search, rounds, seconds = _decode(monkeypatch, harmless=set(), adaptive_lookup=True)
    assert search.done and search.chosen == ()
    searched = sum(t.warmup + t.rounds for t in search.trials.values())
    assert rounds["swift"] <= searched  # none after the search
    assert rounds["lookup"] > 0.8 * (sum(rounds.values()) - searched)
    assert seconds < 0.7 * 400  # the search's cost paid back: plain steps take 400
