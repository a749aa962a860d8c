"""The sampling-distribution check shared by the end-to-end sampling tests.

A lossless recipe must sample what the target model samples: decode ``n`` times with a fresh
draw, count each continuation, and compare the counts with the exact distribution of
continuations under the target (chi-square; continuations the target gives no mass must never
appear; the sparse tail of the support is merged into one bin so no expected count is tiny).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

P_MIN = 1e-3  # the bar a chi-square p-value must clear


def assert_sampled_from(counts: dict, exact: dict, n: int) -> None:
    """``counts``: continuation -> times sampled out of ``n``; ``exact``: continuation -> its
    probability under the target (every continuation with mass)."""
    stat, pvalue, bins = _chi_square(counts, exact, n)
    assert pvalue > P_MIN, f"chi-square {stat:.1f} over {bins} bins, p={pvalue:.2e}"


def assert_sampler_draws_from(sample, exact: dict, n: int, seed: int) -> None:
    """:func:`assert_sampled_from` for a test that draws its examples (hypothesis): over many
    examples, one seeded draw of ``n`` falls below the bar by chance now and then. A draw below
    it is followed by an independent one of ``4 n`` (seed ``seed + 1``), which must pass: a
    chance tail fails both with probability ``P_MIN ** 2``, while a biased sampler fails the
    larger draw with more power than the first. ``sample(n, seed)`` returns the counts."""
    stat, pvalue, bins = _chi_square(sample(n, seed), exact, n)
    if pvalue > P_MIN:
        return
    again = 4 * n
    stat2, pvalue2, bins2 = _chi_square(sample(again, seed + 1), exact, again)
    assert pvalue2 > P_MIN, (
        f"chi-square {stat:.1f} over {bins} bins, p={pvalue:.2e} (n={n}); redrawn "
        f"n={again}: chi-square {stat2:.1f} over {bins2} bins, p={pvalue2:.2e}"
    )


def _chi_square(counts: dict, exact: dict, n: int) -> tuple[float, float, int]:
    """(statistic, p-value, bins) of ``counts`` against ``exact``; sampling a continuation the
    target gives no mass fails outright."""
    keys = sorted(exact, key=lambda k: -exact[k])
    expected = np.array([exact[k] * n for k in keys])
    observed = np.array([counts[k] for k in keys])
    assert observed[expected == 0].sum() == 0, "sampled a token the target gives zero mass"
    big = expected >= 5
    tail = (expected > 0) & ~big
    exp_b, obs_b = expected[big], observed[big]
    if tail.any():
        exp_b = np.append(exp_b, expected[tail].sum())
        obs_b = np.append(obs_b, observed[tail].sum())
    stat, pvalue = chisquare(obs_b, exp_b * obs_b.sum() / exp_b.sum())
    return float(stat), float(pvalue), len(exp_b)


def sample_counts(
    sm, prompt, exact: dict, length: int, n: int, *, seed: int = 1234, **sampling
) -> tuple[dict, int, int]:
    """Decode ``n`` sampled ``length``-token continuations of ``prompt`` [1, p] with ``sm``
    (``sampling``: temperature, top_k, top_p) from one seeded generator; returns the counts
    per continuation (keys of ``exact``) and the drafts rejected and drafted over all runs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    counts = dict.fromkeys(exact, 0)
    rejections = drafted = 0
    for _ in range(n):
        out = sm.generate(prompt, do_sample=True, max_new_tokens=length, generator=g, **sampling)
        counts[tuple(out[0, prompt.shape[1] :].tolist())] += 1
        m = sm.last_metrics
        rejections += m.drafted_tokens - m.accepted_drafts
        drafted += m.drafted_tokens
    return counts, rejections, drafted
