"""Kangaroo is lossless: greedy output identical to HF greedy, sampling with HF's distribution.

Hypothesis draws tiny configs of every supported architecture (model_specs of test_lossless),
prompts, exit layers, gamma in 1..8, eta in [0, 1), and untrained or briefly trained adapters (a
few fit steps at a high learning rate, so the drafts differ from the initial copy). Float ties
are detected and reported (greedy_check), never assumed.
"""

from __future__ import annotations

import functools
import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from leapfx import rewrite
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_kangaroo import _spy_rounds
from tests.test_lossless import _prompt, model_specs

TEMPERATURE, TOP_K, TOP_P = 0.9, 3, 0.95


@settings(max_examples=examples(200, 300))
@given(spec=model_specs(), data=st.data())
def test_kangaroo_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    options = dict(
        exit_layer=data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer"),
        max_draft_tokens=data.draw(st.integers(1, 8), label="gamma"),
        confidence_threshold=data.draw(
            st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)), label="eta"
        ),
    )
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    sm = rewrite.apply(model, "kangaroo", **options)
    trained = data.draw(st.booleans(), label="trained")
    check_chain_rounds(sm, model, prompt, max_new, options, _spy_rounds, trained=trained)


def check_chain_rounds(sm, model, prompt, max_new, options, spy, *, trained) -> None:
    """Decode greedily with a chain drafter (Kangaroo's adapter, the EAGLE head), optionally
    after two training steps, and check: identical to HF greedy, and each round's draft count
    (recorded by ``spy(sm)`` on the stage that verifies, set after training: fit packs the
    kernel stages again) follows ``max_draft_tokens`` and ``confidence_threshold``."""
    if trained:
        vocab = model.config.vocab_size
        tokens = torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(1))
        sm.fit(tokens, steps=2, batch_size=2, seq_len=16, lr=1e-2, progress=False)
    rounds = spy(sm)
    ours = sm.generate(prompt, max_new_tokens=max_new)
    ref = hf_greedy(model, prompt, max_new)
    assert_greedy_equal(model, ours, ref, prompt.shape[1])
    m = sm.last_metrics
    assert m.new_tokens == ours.shape[1] - prompt.shape[1]
    gamma = options["max_draft_tokens"]
    assert all(1 <= s <= gamma + 1 for s in m.accepted_per_verify)
    assert len(rounds) == m.verify_calls and sum(rounds) == m.drafted_tokens
    emitted = 1  # the prefill's token
    for d, s in zip(rounds, m.accepted_per_verify, strict=True):
        bound = min(gamma, max_new - emitted - 1)  # drafts past max_new_tokens are waste
        # eta = 0 drafts exactly gamma (unless truncated); eta > 0 may stop earlier (eq. 4)
        assert d == bound if options["confidence_threshold"] == 0.0 else 1 <= d <= bound
        emitted += s


def test_kangaroo_float64_is_exact_with_a_trained_adapter(tmp_path):
    """In float64 float ties cannot happen: the output must be identical, full stop."""
    model = tiny_model("llama", layers=6, vocab=64, dtype=torch.float64, seed=3)
    prompt = torch.tensor([[5, 9, 1, 33, 2]])
    sm = rewrite.apply(model, "kangaroo", exit_layer=2, max_draft_tokens=5)
    text = hf_greedy(model, prompt, 120)[0]
    sm.fit(text, steps=30, batch_size=4, seq_len=32, lr=3e-3, progress=False)
    sm.save_adapter(tmp_path / "adapter")
    for eta in (0.0, 0.6):
        sm = rewrite.apply(model, "kangaroo", adapter=tmp_path / "adapter",
                           confidence_threshold=eta)  # fmt: skip
        ours = sm.generate(prompt, max_new_tokens=96)
        assert torch.equal(ours, hf_greedy(model, prompt, 96))
        assert sm.last_metrics.verify_calls > 0 and sm.last_metrics.drafted_tokens > 0


def _exact_distribution(model, prompt: torch.Tensor, vocab: int, length: int) -> dict:
    """P(continuation) for every ``length``-token continuation, from HF's logits and warpers."""
    warp = LogitsProcessorList(
        [TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P)]
    )

    @functools.cache
    def next_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor([prefix])
        with torch.no_grad():
            logits = model(ids).logits[:, -1].double()
        return torch.softmax(warp(ids, logits), dim=-1)[0]

    base = tuple(prompt[0].tolist())
    dist = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            p *= float(next_probs(base + seq[:i])[seq[i]])
            if p == 0.0:
                break
        dist[seq] = p
    return dist


def test_kangaroo_sampling_matches_target_distribution():
    """Chi-square of 3000 sampled 4-token continuations against the exact HF distribution.

    After the prefill token a round drafts at most two tokens (eta stops some after one),
    then rejection sampling emits the correction or bonus token; a second round or a full step
    finishes. Temperature, top-k and top-p warp both the drafts and the target.
    """
    vocab, length = 4, 4
    model = tiny_model("llama", layers=3, vocab=vocab, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # undo the tests' sharpening: a flatter target is harder
    prompt = torch.tensor([[1, 3, 2]])
    exact = _exact_distribution(model, prompt, vocab, length)
    # The first draft's confidence (warped q) is 0.345..0.361 over the four possible contexts
    # here, so eta = 0.355 stops some rounds after one draft and lets others draft two.
    sm = rewrite.apply(model, "kangaroo", exit_layer=1, max_draft_tokens=4,
                       confidence_threshold=0.355)  # fmt: skip
    g = torch.Generator().manual_seed(1234)
    n = 3000
    counts = dict.fromkeys(exact, 0)
    rejections = drafted = rounds = 0
    for _ in range(n):
        out = sm.generate(
            prompt, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
            max_new_tokens=length, generator=g,
        )  # fmt: skip
        counts[tuple(out[0, 3:].tolist())] += 1
        m = sm.last_metrics
        rejections += m.drafted_tokens - m.accepted_drafts
        drafted += m.drafted_tokens
        rounds += m.verify_calls
    assert 0 < rejections < drafted  # both branches of the accept rule ran
    assert rounds < drafted < 2 * rounds  # dynamic drafting stopped some rounds after one draft
    assert_sampled_from(counts, exact, n)


def test_kangaroo_sampling_is_reproducible_with_a_generator():
    sm = rewrite.apply(tiny_model("gemma", layers=3, seed=2), "kangaroo", exit_layer=1)
    prompt = torch.tensor([[3, 1, 4]])
    a, b = (
        sm.generate(
            prompt, do_sample=True, max_new_tokens=12, generator=torch.Generator().manual_seed(5)
        )  # fmt: skip
        for _ in range(2)
    )
    assert torch.equal(a, b)
