"""The adaptive drafter's policy (``leapfx.runtime.adaptive``) on synthetic rounds.

Its losslessness is tested with prompt lookup's (tests/test_lookup.py: ``auto`` is drawn there
beside ``lookup``); here, what it chooses given acceptance and cost.
"""

from __future__ import annotations

import pytest
import torch

from leapfx.runtime.adaptive import (
    COST_EMA,
    MARGIN,
    OUTLIER,
    PROBE_EVERY,
    AdaptiveDrafter,
    DraftPolicy,
    Policies,
    expected_tokens,
)
from leapfx.runtime.lookup import PromptLookup
from leapfx.runtime.schedules import Output


def _run(policy: DraftPolicy, rounds: int, accept, cost, available: int = 8) -> list[int]:
    """``rounds`` synthetic rounds: ``accept(d)`` drafts kept of d, ``cost(d)`` seconds."""
    chosen = []
    for _ in range(rounds):
        d = policy.choose(available)
        policy.observe(d, accept(d), cost(d))
        chosen.append(d)
    return chosen


def test_drafting_turns_off_when_drafts_are_always_rejected():
    policy = DraftPolicy(max_drafts=8)
    chosen = _run(policy, 400, accept=lambda d: 0, cost=lambda d: 1.0 + 0.05 * d)
    assert chosen[0] > 0  # the prior (alpha 0.5) tries drafting first
    late = chosen[100:]
    assert policy.alpha < 0.01
    # only the probes draft, one token each, once in PROBE_EVERY rounds
    assert set(late) <= {0, 1} and late.count(1) <= len(late) // PROBE_EVERY + 1
    cost = sum(1.0 + 0.05 * d for d in late) / len(late)
    # within the probes' share of plain decoding's cost
    assert cost <= 1.0 + 0.05 * (len(late) // PROBE_EVERY + 1) / len(late) + 1e-9


def test_drafts_the_most_when_drafts_are_always_kept_and_verify_is_cheap():
    policy = DraftPolicy(max_drafts=8)
    chosen = _run(policy, 50, accept=lambda d: d, cost=lambda d: 1.0 + 0.05 * d)
    assert chosen[-10:] == [8] * 10
    assert _run(policy, 1, accept=lambda d: d, cost=lambda d: 1.0, available=3) == [3]


@pytest.mark.parametrize("slope", [0.1, 0.3, 0.6])
def test_picks_the_length_with_the_most_tokens_per_cost(slope):
    # Measured costs 1 + slope d for every d, alpha held at 0.6: the choice is the argmax of
    # E(d) / C(d) (or 0 where no d beats a plain step by the margin).
    policy = DraftPolicy(max_drafts=8)
    policy.costs = {d: 1.0 + slope * d for d in range(9)}
    policy.acceptance.accepted, policy.acceptance.rejections = 3.0, 2.0
    rates = {d: expected_tokens(0.6, d) / (1.0 + slope * d) for d in range(9)}
    best = max(range(1, 9), key=rates.get)
    want = best if rates[best] > (1 + MARGIN) * rates[0] else 0
    assert policy.choose(8) == want
    if slope == 0.6:
        assert want == 0  # a verify this steep: plain decoding wins


def test_unmeasured_lengths_follow_the_measured_line():
    policy = DraftPolicy(max_drafts=8)
    policy.costs = {0: 1.0, 4: 2.0}
    assert policy.cost(2) == pytest.approx(1.5) and policy.cost(8) == pytest.approx(3.0)
    policy.costs = {2: 1.2}  # one point: the prior slope through it
    assert policy.cost(0) == pytest.approx(1.0)


def test_a_plain_step_is_weighed_at_its_own_measured_cost():
    # SmolLM2's 8-row costs: a verify of 2 tokens 1.46 plain steps, of 3 tokens 1.78 (the
    # first extra token the dearest). The line through them starts at 1.02, above the plain
    # step's own 1.0; weighed against the line, one draft at acceptance 0.42 looked 2.8%
    # better than a plain step and was drafted, and ran slower. Against the step's own cost
    # it is not.
    policy = DraftPolicy(max_drafts=4)
    policy.costs = {0: 1.0, 1: 1.46, 2: 1.78}
    policy.acceptance.accepted, policy.acceptance.rejections = 0.42, 0.58
    assert policy.cost(0) == 1.0
    assert policy.line()[0] > 1.0
    assert policy.best(2)[1] < 1.0 + MARGIN
    assert policy.choose(2) == 0


def _auto_drafter(prompt: list[int], policies: Policies) -> AdaptiveDrafter:
    """``auto``'s drafter: prompt lookup alone under the adaptive policy."""
    return AdaptiveDrafter(None, PromptLookup(prompt, 2, 1), policies)


def _out(tokens: list[int]) -> Output:
    out = Output(None)
    out.tokens = tokens
    return out


def test_auto_learns_each_rounds_outcome_from_the_verify():
    policies = Policies()
    drafter = _auto_drafter([1, 2, 3, 1, 2, 3], policies)
    policies["lookup"].acceptance.accepted = 100.0  # alpha near 1: the longest draft
    seen = []
    policies["lookup"].observe = lambda d, k, s, key=None: seen.append((d, k, key))
    x = torch.tensor([[1]])
    first = drafter.propose(None, x, 6, 4, None, _out([1]))  # text ..3 1: (3, 1) at 2
    assert first.tokens.tolist() == [[2, 3, 1, 2]] and first.drafter == "lookup"
    assert first.copied and first.ngram == 2
    drafter.accepted(None, 6, 2)  # two drafts kept, then the correction
    drafter.propose(None, torch.tensor([[9]]), 9, 4, None, _out([1, 2, 3, 9]))
    assert seen == [(4, 2, 2)]  # the round's match was a 2-gram


def test_each_ngram_length_learns_its_own_acceptance():
    # 3-gram matches are always right, 1-gram ones never: the policy drafts on the first and
    # declines the second, instead of one pooled rate that is wrong for both.
    policy = DraftPolicy(max_drafts=4)
    policy.costs = {d: 1.0 + 0.2 * d for d in range(5)}
    for _ in range(30):
        for key in (3, 1):
            d = policy.choose(4, key)
            policy.observe(d, d if key == 3 else 0, 1.0 + 0.2 * d, key)
    assert policy.choose(4, 3) == 4
    assert policy.alpha_of(1) < 0.3 < 0.9 < policy.alpha_of(3)
    assert policy.choose(4, 1) == 0
    assert policy.alpha_of(2) == policy.alpha  # an unseen length reads the pooled rate


def test_a_models_policies_keep_costs_across_decodes_and_restart_acceptance():
    policies = Policies()
    first = _auto_drafter([1, 2, 3], policies)
    policy = policies["lookup"]
    policy.costs = {0: 1.0, 2: 1.6}
    policy.acceptance.accepted, policy.acceptance.rejections = 0.1, 9.0
    second = _auto_drafter([4, 5], policies)
    assert second.policies is first.policies and policies["lookup"] is policy
    assert policy.costs == {0: 1.0, 2: 1.6}
    assert policy.alpha == 0.5 and policy.acceptance.by_key == {}


def test_one_stalled_round_does_not_hold_drafting_off():
    # Drafts kept 3 of 4, a round of d drafts costs 1 + 0.1 d: the policy drafts 4. One round
    # the machine stalls (22 steps long): it still drafts on the next round, and a stall on a
    # length's first counted round is held to OUTLIER x (d + 1) plain steps.
    policy = DraftPolicy(max_drafts=4)
    chosen = _run(policy, 40, accept=lambda d: min(d, 3), cost=lambda d: 1.0 + 0.1 * d)
    assert chosen[-1] == 4
    policy.observe(4, 3, 22.0)
    assert policy.choose(4) == 4
    assert policy.costs[4] == pytest.approx(1.4 + COST_EMA * (OUTLIER * 1.4 - 1.4))

    fresh = DraftPolicy(max_drafts=4)
    fresh.observe(0, 0, 1.0)  # first call at a shape: not counted
    fresh.observe(0, 0, 1.0)
    fresh.observe(2, 2, 1.0)  # not counted
    fresh.observe(2, 2, 50.0)  # a stall on the first counted round of d = 2
    assert fresh.costs[2] == OUTLIER * 1.0 * 3
    for _ in range(4):  # rounds at their true cost pull it down fast (halfway a round)
        fresh.observe(2, 2, 1.2)
    assert fresh.costs[2] < 2.0
