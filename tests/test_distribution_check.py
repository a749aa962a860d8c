"""The sampling-distribution check itself: it passes a fair sampler's chance tail on a redraw
and fails a biased sampler."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distribution_check import assert_sampled_from, assert_sampler_draws_from

EXACT = {(0,): 0.5, (1,): 0.3, (2,): 0.2, (3,): 0.0}


def _sampler(probs: dict, draws: list[int]):
    def sample(n: int, seed: int) -> dict:
        draws.append(n)
        rng = np.random.default_rng(seed)
        keys = list(probs)
        picked = rng.choice(len(keys), size=n, p=[probs[k] for k in keys])
        return {k: int((picked == i).sum()) for i, k in enumerate(keys)}

    return sample


def test_a_fair_sampler_passes_and_a_chance_tail_is_redrawn_larger():
    draws: list[int] = []
    assert_sampler_draws_from(_sampler(EXACT, draws), EXACT, 1000, seed=0)
    assert draws == [1000]
    # a first draw far in the tail (all on the likeliest continuation), then a fair one
    tail = {(0,): 1000, (1,): 0, (2,): 0, (3,): 0}
    with pytest.raises(AssertionError, match=r"p="):
        assert_sampled_from(tail, EXACT, 1000)
    fair, redraws = _sampler(EXACT, draws), iter([tail])
    assert_sampler_draws_from(lambda n, s: next(redraws, None) or fair(n, s), EXACT, 1000, 0)
    assert draws[-1] == 4000


def test_a_biased_sampler_fails_the_redraw():
    biased = {(0,): 0.56, (1,): 0.26, (2,): 0.18, (3,): 0.0}
    with pytest.raises(AssertionError, match=r"redrawn n=4000"):
        assert_sampler_draws_from(_sampler(biased, []), EXACT, 1000, seed=1)
    with pytest.raises(AssertionError, match=r"zero mass"):
        assert_sampled_from({(0,): 999, (1,): 0, (2,): 0, (3,): 1}, EXACT, 1000)
