"""End to end: layerskip sampling has the target model's distribution (chi-square, fixed seed).

The exact distribution of the first three (or four) new tokens is computed from the HF model's
own logits with HF's own logits warpers (temperature, top-k, top-p), and compared with 6000 draws of
``generate(do_sample=True)``. With max_new_tokens=3 the second and third tokens come from a
draft/verify round (one draft token, rejection sampling, then the correction or bonus token);
with 4 new tokens the first round has up to two drafts, which a confidence threshold may cut.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from leapfx import rewrite
from tests.conftest import tiny_model
from tests.distribution_check import assert_sampled_from

VOCAB = 6
TEMPERATURE, TOP_K, TOP_P = 0.9, 5, 0.95


def _exact_distribution(model, prompt: torch.Tensor, n: int) -> dict[tuple[int, ...], float]:
    warp = LogitsProcessorList(
        [TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P)]
    )

    def next_probs(prefix):
        ids = torch.tensor([prefix])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].double()
        return torch.softmax(warp(ids, logits), dim=-1)[0]

    dist = {}
    base = prompt[0].tolist()
    for seq in itertools.product(range(VOCAB), repeat=n):
        p = 1.0
        for i in range(n):
            p *= float(next_probs(base + list(seq[:i]))[seq[i]])
            if p == 0.0:
                break
        dist[seq] = p
    return dist


@pytest.mark.parametrize(("new_tokens", "eta"), [(3, 0.0), (4, 0.5)])
def test_layerskip_sampling_matches_target_distribution(new_tokens, eta):
    # new_tokens 3: one round of one draft. 4: one round of up to two drafts, and with eta 0.5
    # some rounds stop after the first (its exit top-1 probability <= 0.5).
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # undo the tests' sharpening: a flatter target is harder
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact_distribution(model, prompt, new_tokens)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=4,
                       confidence_threshold=eta)  # fmt: skip
    g = torch.Generator().manual_seed(1234)
    n = 6000
    counts: dict[tuple[int, ...], int] = dict.fromkeys(exact, 0)
    rejections = short_rounds = 0
    for _ in range(n):
        out = sm.generate(
            prompt, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
            max_new_tokens=new_tokens, generator=g,
        )  # fmt: skip
        counts[tuple(out[0, 3:].tolist())] += 1
        m = sm.last_metrics
        rejections += m.drafted_tokens - m.accepted_drafts
        full, emitted = 0, 1  # drafts a round would make without eta: min(d, remaining - 1)
        for s in m.accepted_per_verify:
            full += min(4, new_tokens - emitted - 1)
            emitted += s
        short_rounds += m.drafted_tokens < full
    assert 0 < rejections < n  # both branches of the accept rule ran
    assert (short_rounds > 0) == (eta > 0)  # eta stopped some rounds early, and only eta
    assert_sampled_from(counts, exact, n)


def test_sampling_is_reproducible_with_a_generator():
    model = tiny_model("llama", layers=3, seed=2)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    prompt = torch.tensor([[3, 1, 4]])
    a = sm.generate(
        prompt, do_sample=True, max_new_tokens=12, generator=torch.Generator().manual_seed(5)
    )
    b = sm.generate(
        prompt, do_sample=True, max_new_tokens=12, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a, b)
