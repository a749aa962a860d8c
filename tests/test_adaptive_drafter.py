"""``adaptive=True`` on the drafting recipes: each round chooses among the recipe's own drafter,
prompt lookup and no drafting (``leapfx.runtime.adaptive.AdaptiveDrafter``).

Lossless for any choice (hypothesis against HF greedy; the sampled distribution); and on a
synthetic model with a controlled clock, it takes the drafter that pays and turns off the one
that does not.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.runtime import adaptive
from leapfx.runtime.adaptive import PROBE_EVERY, AdaptiveDrafter, Policies
from leapfx.runtime.lookup import PromptLookup
from leapfx.runtime.metrics import DecodeMetrics
from leapfx.runtime.rounds import speculative_loop
from leapfx.runtime.sampling import SamplingParams
from leapfx.runtime.schedules import DecodeRequest, Draft, Drafter, no_draft
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lookup import _repetitive_prompt
from tests.test_lookup_first import TAKERS, _recipe_options
from tests.test_lossless import model_specs
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution


@settings(max_examples=examples(15, 60), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_adaptive_greedy_identical_to_hf(spec, data):
    recipe = data.draw(st.sampled_from(TAKERS), label="recipe")
    model = tiny_model(**spec)
    prompt = _repetitive_prompt(data, spec["vocab"])
    options, draft_option = _recipe_options(data, recipe, spec["layers"])
    options.pop("adaptive", None)  # (qspec's draw fixes it off; here it is on)
    with_lookup = data.draw(st.booleans(), label="lookup")
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    sm = rewrite.apply(model, recipe, adaptive=True, lookup=with_lookup, max_ngram=2, **options)
    for _ in range(2):  # the second decode starts from the first one's measured costs
        ours = sm.generate(prompt, max_new_tokens=max_new)
        assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    m = sm.last_metrics
    assert all(1 <= s <= options[draft_option] + 1 for s in m.accepted_per_verify)
    drafted = {k: v for k, v in m.drafter_rounds.items() if k not in ("declined", "none")}
    assert set(drafted) <= {"lookup", recipe} and sum(drafted.values()) == m.verify_calls


def test_adaptive_sampling_matches_target_distribution():
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2, 1, 4]])
    exact = _exact_distribution(model, prompt, 3)
    sm = rewrite.apply(
        model, "swift", adaptive=True, lookup=True, max_ngram=2, skip_layers=(1,),
        num_speculations=2,
    )  # fmt: skip
    n = 3000
    counts, _, drafted = sample_counts(
        sm, prompt, exact, 3, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert drafted > 0
    assert_sampled_from(counts, exact, n)


def test_adaptive_options_are_validated_and_refused_where_not_taken():
    model = tiny_model("llama", layers=4)
    with pytest.raises(ValueError, match=r"adaptive: 1 is invalid; allowed: True or False"):
        rewrite.apply(model, "swift", adaptive=1)
    with pytest.raises(ValueError, match=r"adaptive: recipe 'autoregressive' does not take"):
        rewrite.apply(model, "autoregressive", adaptive=True)
    assert rewrite.apply(model, "autoregressive", adaptive=False).recipe.name == "autoregressive"
    sm = rewrite.apply(model, "layerskip", adaptive=True)
    first = sm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8)
    policies = sm.recipe.schedule.keywords["first"].policies  # one set a model
    assert "layerskip" in policies
    assert sm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=8).equal(first)


# -- the choice, on a synthetic model whose next token is (last + 1) % V --------------------

V = 11


class _Cache:
    def crop(self, length: int) -> None:
        pass

    def crop_rows(self, ends: list[int]) -> None:
        pass


class _Clock:
    """perf_counter for the adaptive module: advanced by the fake model's calls."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Runner:
    """A full call over S tokens costs 1 + 0.05 (S - 1) on the clock; its logits put the
    next token of each position at (token + 1) % V."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.cache = clock, _Cache()

    def keep(self, rows: list[int]) -> None:  # the decode's one row goes on or ends
        pass

    def full(self, ids: torch.Tensor, start: int, key=None) -> torch.Tensor:
        self.clock.now += 1.0 + 0.05 * (ids.shape[1] - 1)
        return torch.nn.functional.one_hot((ids + 1) % V, V).float()  # [1, S, V]


class _Own(Drafter):
    """Drafts d tokens at 0.3 a draft: the right ones (``right``) or always wrong ones."""

    name = "own"

    def __init__(self, clock: _Clock, right: bool) -> None:
        self.clock, self.right = clock, right

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        self.clock.now += 0.3 * d
        step = 1 if self.right else 2
        first = int(x) + step
        tokens = torch.tensor([[(first + i * step) % V for i in range(d)]])
        return Draft(tokens, None, self.name)


def _decode(monkeypatch, own: Drafter | None, lookup: bool, tokens: int = 400):
    clock = own.clock if own is not None else _Clock()
    monkeypatch.setattr(adaptive.time, "perf_counter", clock)
    prompt = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0]])  # the cycle, once
    source = PromptLookup(prompt[0].tolist(), 2, 1) if lookup else None
    drafter = AdaptiveDrafter(own, source, Policies())
    request = DecodeRequest(tokens, frozenset(), SamplingParams())
    metrics = DecodeMetrics(schedule="adaptive")
    out = speculative_loop(_Runner(clock), prompt, request, metrics, 6, drafter)
    assert out == [(1 + i) % V for i in range(tokens)]  # every choice stays lossless
    return metrics.drafter_rounds


def test_a_drafter_whose_drafts_are_always_rejected_is_turned_off(monkeypatch):
    rounds = _decode(monkeypatch, _Own(_Clock(), right=False), lookup=False)
    # after a few rounds of learning only probes draft: one round in PROBE_EVERY
    assert rounds["own"] <= 10 + sum(rounds.values()) // PROBE_EVERY
    assert rounds["declined"] > 0.8 * sum(rounds.values())


def test_a_drafter_that_pays_drafts(monkeypatch):
    rounds = _decode(monkeypatch, _Own(_Clock(), right=True), lookup=False)
    assert rounds["own"] > 0.9 * sum(rounds.values())


def test_lookup_is_taken_over_a_drafter_that_does_not_pay(monkeypatch):
    # the text repeats the prompt's cycle: lookup's copies are always right and cost no draft
    rounds = _decode(monkeypatch, _Own(_Clock(), right=False), lookup=True)
    assert rounds["lookup"] > 0.8 * sum(rounds.values())
    assert rounds.get("own", 0) <= 10 + sum(rounds.values()) // PROBE_EVERY
