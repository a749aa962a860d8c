"""The sampling-distribution check shared by the end-to-end sampling tests.

A lossless recipe must sample what the target model samples: decode ``n`` times with a fresh
draw, count each continuation, and compare the counts with the exact distribution of
continuations under the target (chi-square; continuations the target gives no mass must never
appear; the sparse tail of the support is merged into one bin so no expected count is tiny).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def assert_sampled_from(counts: dict, exact: dict, n: int) -> None:
    """``counts``: continuation -> times sampled out of ``n``; ``exact``: continuation -> its
    probability under the target (every continuation with mass)."""
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
    assert pvalue > 1e-3, f"chi-square {stat:.1f} over {len(exp_b)} bins, p={pvalue:.2e}"


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
