"""EAGLE is lossless: greedy output identical to HF greedy, sampling with HF's distribution.

Hypothesis draws tiny configs of every supported architecture (model_specs of test_lossless),
prompts, d in 1..8, the confidence threshold in [0, 1), the layer the head is copied from, and
untrained or briefly trained heads (a few fit steps at a high learning rate, so the drafts
differ from the initial copy). Float ties are detected and reported (greedy_check), never
assumed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import hf_greedy
from tests.test_kangaroo_lossless import (
    TEMPERATURE,
    TOP_K,
    TOP_P,
    _exact_distribution,
    check_chain_rounds,
)
from tests.test_lossless import _prompt, model_specs


def _spy_rounds(sm) -> list[int]:
    """Record the number of drafts d of every verify (target call after the prefill) of the
    stages generate runs (the kernel stages where rewrite.apply turned them on)."""
    rounds: list[int] = []
    stages = sm._executors if sm._executors is not None else sm.stages.modules
    target = stages["target"]

    def spy(**inputs):
        if inputs["position_ids"][0, 0] > 0 and inputs["input_ids"].shape[1] > 1:
            rounds.append(inputs["input_ids"].shape[1] - 1)
        return target(**inputs)

    stages["target"] = spy
    return rounds


@settings(max_examples=examples(150, 300))
@given(spec=model_specs(), data=st.data())
def test_eagle_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    options = dict(
        max_draft_tokens=data.draw(st.integers(1, 8), label="d"),
        confidence_threshold=data.draw(
            st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)), label="threshold"
        ),
        init_layer=data.draw(st.integers(0, spec["layers"] - 1), label="init_layer"),
    )
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    sm = rewrite.apply(model, "eagle", **options)
    trained = data.draw(st.booleans(), label="trained")
    check_chain_rounds(sm, model, prompt, max_new, options, _spy_rounds, trained=trained)


def test_eagle_float64_is_exact_with_a_trained_head(tmp_path):
    """In float64 float ties cannot happen: the output must be identical, full stop; and the
    trained head, saved and loaded, drafts well enough that most drafts are accepted."""
    model = tiny_model("llama", layers=4, vocab=64, dtype=torch.float64, seed=3)
    prompt = torch.tensor([[5, 9, 1, 33, 2]])
    text = hf_greedy(model, prompt, 120)[0]
    sm = rewrite.apply(model, "eagle", max_draft_tokens=5)
    untrained = sm.generate(prompt, max_new_tokens=96)
    rate_before = sm.last_metrics.acceptance_rate
    sm.fit(text, steps=60, batch_size=4, seq_len=48, lr=3e-3, progress=False)
    sm.save_parts(tmp_path / "parts")
    assert torch.equal(untrained, hf_greedy(model, prompt, 96))
    for threshold in (0.0, 0.6):
        sm = rewrite.apply(model, "eagle", parts=tmp_path / "parts",
                           confidence_threshold=threshold)  # fmt: skip
        ours = sm.generate(prompt, max_new_tokens=96)
        assert torch.equal(ours, hf_greedy(model, prompt, 96))
        assert sm.last_metrics.verify_calls > 0 and sm.last_metrics.drafted_tokens > 0
    assert sm.last_metrics.acceptance_rate > rate_before


@pytest.mark.parametrize("trained", [False, True])
def test_eagle_sampling_matches_target_distribution(trained):
    """Chi-square of 3000 sampled 4-token continuations against the exact HF distribution.

    After the prefill token a round drafts at most two tokens, then rejection sampling emits
    the correction or bonus token. Temperature, top-k and top-p warp both the drafts and the
    target. ``trained``: a few fit steps at a high rate first, so q is not the initial copy's.
    """
    vocab, length = 4, 4
    model = tiny_model("llama", layers=3, vocab=vocab, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # undo the tests' sharpening: a flatter target is harder
    prompt = torch.tensor([[1, 3, 2]])
    exact = _exact_distribution(model, prompt, vocab, length)
    sm = rewrite.apply(model, "eagle", max_draft_tokens=2, confidence_threshold=0.0)
    if trained:
        tokens = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(2))
        sm.fit(tokens, steps=5, batch_size=2, seq_len=16, lr=1e-2, progress=False)
    n = 3000
    counts, rejections, drafted = sample_counts(
        sm, prompt, exact, length, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert 0 < rejections < drafted  # both branches of the accept rule ran
    assert_sampled_from(counts, exact, n)


def test_eagle_sampling_is_reproducible_with_a_generator():
    sm = rewrite.apply(tiny_model("gemma", layers=3, seed=2), "eagle")
    prompt = torch.tensor([[3, 1, 4]])
    a, b = (
        sm.generate(
            prompt, do_sample=True, max_new_tokens=12, generator=torch.Generator().manual_seed(5)
        )  # fmt: skip
        for _ in range(2)
    )
    assert torch.equal(a, b)
