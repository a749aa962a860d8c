"""Prompt lookup (``lookup``): the n-gram matcher, losslessness, sampling, backends.

The matcher is checked against a brute-force scan (hypothesis); decoding against HF greedy over
random tiny configs, dense and MoE, on prompts built with repetition so that drafts exist and
are accepted; sampling against the target's exact distribution.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.runtime.lookup import NgramIndex, PromptLookup, brute_force_match
from tests.conftest import examples, tiny_model, tiny_moe_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lossless import model_specs
from tests.test_moe import moe_specs
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution


@settings(max_examples=examples(300, 300))
@given(
    chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=8),
    max_ngram=st.integers(1, 4),
    data=st.data(),
)
def test_index_matches_brute_force(chunks, max_ngram, data):
    # A 4-token alphabet: most suffixes recur, at several n and several earlier positions.
    min_ngram = data.draw(st.integers(1, max_ngram), label="min_ngram")
    d = data.draw(st.integers(1, 10), label="d")
    index = NgramIndex(max_ngram, min_ngram)
    text: list[int] = []
    for chunk in chunks:  # the index grows by chunks, as a decode's accepted tokens arrive
        index.extend(chunk)
        text += chunk
        assert index.match(d) == brute_force_match(text, max_ngram, min_ngram, d)


def test_matcher_takes_the_longest_n_then_the_latest_match_and_repeats_runs():
    text = [1, 2, 3, 9, 2, 3, 7, 1, 2, 3]
    # (1, 2, 3) occurs at 0, followed by 9; (2, 3) latest at 4, followed by 7: n = 3 wins.
    assert brute_force_match(text, 3, 1, 2) == ((9, 2), 3)
    assert brute_force_match(text, 2, 1, 2) == ((7, 1), 2)
    assert brute_force_match([5, 6, 7], 3, 1, 4) == ((), 0)  # no earlier occurrence
    # A run of one token drafts d of it (the continuation reads the drafts themselves).
    assert brute_force_match([4, 8, 8, 8], 2, 1, 5) == ((8, 8, 8, 8, 8), 2)
    assert brute_force_match([1, 2, 1, 2, 1], 1, 1, 4) == ((2, 1, 2, 1), 1)


def test_prompt_lookup_reads_the_generated_tokens_it_has_not_seen():
    drafter = PromptLookup([1, 2, 3, 4], max_ngram=2, min_ngram=1)
    assert drafter.propose([5], 3).drafter == "none"
    proposal = drafter.propose([5, 1, 2], 3)  # text 1 2 3 4 5 1 2: (1, 2) at 0
    assert (proposal.tokens, proposal.ngram, proposal.drafter) == ((3, 4, 5), 2, "lookup")


def _repetitive_prompt(data, vocab: int) -> torch.Tensor:
    # A random phrase repeated (with a random tail) so that n-grams recur in the prompt and,
    # once the model copies, in the generated text.
    phrase = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8), label="phrase")
    times = data.draw(st.integers(1, 4), label="repeats")
    tail = data.draw(st.lists(st.integers(0, vocab - 1), max_size=4), label="tail")
    return torch.tensor([phrase * times + tail])


def _lookup_options(data) -> dict:
    max_ngram = data.draw(st.integers(1, 4), label="max_ngram")
    return dict(
        num_speculations=data.draw(st.integers(1, 10), label="num_speculations"),
        max_ngram=max_ngram,
        min_ngram=data.draw(st.integers(1, max_ngram), label="min_ngram"),
    )


def _check_lossless(model, sm, prompt, max_new, d) -> None:
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    m = sm.last_metrics
    assert m.new_tokens == ours.shape[1] - prompt.shape[1]
    assert all(1 <= s <= d + 1 for s in m.accepted_per_verify)
    # rounds that drafted are verify calls; the others, and the prefill, full calls
    assert m.verify_calls == m.drafter_rounds.get("lookup", 0)
    # prefill, the rounds that drafted nothing, and a last plain step where one token was left
    plain = m.drafter_rounds.get("none", 0) + m.drafter_rounds.get("declined", 0)
    assert m.full_calls - 1 - plain in (0, 1)
    assert sum(m.ngram_matches.values()) == m.verify_calls


@settings(max_examples=examples(20, 60), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_lookup_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _repetitive_prompt(data, spec["vocab"])
    opts = _lookup_options(data)
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    # auto: the same drafts, at lengths its policy picks from timing (any pick is lossless)
    recipe = data.draw(st.sampled_from(["lookup", "auto"]), label="recipe")
    sm = rewrite.apply(model, recipe, **opts)
    _check_lossless(model, sm, prompt, max_new, opts["num_speculations"])


@settings(max_examples=examples(6, 15), deadline=None)
@given(spec=moe_specs(), data=st.data())
def test_lookup_greedy_identical_to_hf_on_moe(spec, data):
    model = tiny_moe_model(**spec)
    prompt = _repetitive_prompt(data, spec["vocab"])
    opts = _lookup_options(data)
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    recipe = data.draw(st.sampled_from(["lookup", "auto"]), label="recipe")
    sm = rewrite.apply(model, recipe, **opts)
    _check_lossless(model, sm, prompt, max_new, opts["num_speculations"])


def test_lookup_accepts_drafts_on_a_repetitive_prompt():
    # The tests' tiny models are sharpened (lm_head x4): greedy falls into short cycles, which
    # n-gram drafts continue.
    model = tiny_model("llama", layers=3, vocab=32, seed=1)
    prompt = torch.tensor([[1, 2, 3, 4, 5] * 3])
    sm = rewrite.apply(model, "lookup", num_speculations=6)
    ours = sm.generate(prompt, max_new_tokens=40)
    assert torch.equal(ours, hf_greedy(model, prompt, 40))
    m = sm.last_metrics
    assert m.acceptance_rate > 0 and m.mean_accepted_tokens > 2
    assert m.full_calls + m.verify_calls < m.new_tokens  # fewer full-model calls than tokens
    assert m.as_dict()["drafter_rounds"]["lookup"] == m.verify_calls


@pytest.mark.parametrize("recipe", ["lookup", "auto"])
def test_lookup_sampling_matches_target_distribution(recipe):
    # prompt 1 4 2 1 4: after the first new token x, a round drafts from the latest earlier
    # match of x (or of (4, x)); 3 new tokens: up to two drafts checked by rejection sampling
    # with a point-mass draft distribution.
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2, 1, 4]])
    exact = _exact_distribution(model, prompt, 3)
    sm = rewrite.apply(model, recipe, num_speculations=4, max_ngram=2)
    n = 4000
    counts, rejections, drafted = sample_counts(
        sm, prompt, exact, 3, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert drafted > n // 2 and 0 < rejections < drafted  # drafts both kept and rejected
    assert_sampled_from(counts, exact, n)


def test_lookup_options_are_validated():
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="min_ngram: 3 is invalid; allowed: an integer 1..2"):
        rewrite.apply(model, "lookup", max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="num_speculations: 0 is invalid"):
        rewrite.apply(model, "lookup", num_speculations=0)


@pytest.mark.slow
def test_inductor_lookup_is_token_identical_and_never_recompiles():
    from tests.test_compiled import _check_compiled

    model = tiny_model("llama", layers=3, vocab=32, seed=1)
    _check_compiled(model, "lookup", "dynamic", num_speculations=5)


def test_onnx_lookup_runs_on_its_export_and_on_any_export_with_a_full_stage(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from leapfx.export import OnnxModel, export_onnx

    model = tiny_model("llama", layers=2, vocab=32, seed=1)
    prompt = torch.tensor([[1, 2, 3, 4, 5] * 3])
    ref = hf_greedy(model, prompt, 24)
    path = export_onnx(rewrite.apply(model, "lookup", num_speculations=4), tmp_path / "lookup")
    om = OnnxModel(path, threads=1)
    assert_greedy_equal(model, om.generate(prompt, max_new_tokens=24), ref, prompt.shape[1])
    assert om.last_metrics.accepted_drafts > 0
    # A layerskip export's full stage serves the lookup schedule (its shared options apply).
    skip = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    om = OnnxModel(export_onnx(skip, tmp_path / "layerskip"), threads=1, recipe="lookup")
    assert om.options.num_speculations == 3
    assert_greedy_equal(model, om.generate(prompt, max_new_tokens=24), ref, prompt.shape[1])
    assert om.last_metrics.verify_calls > 0
