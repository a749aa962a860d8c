"""``lookup=True`` on the drafting recipes: prompt lookup first, the recipe's own drafter where
the text has no match.

Every recipe that takes it must stay token-identical to HF greedy (hypothesis over tiny
configs, on prompts that repeat so that matches happen), record which drafter ran each round,
and sample the target's distribution; the recipes whose state a full-model round would leave
stale refuse it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.recipes.table import RECIPES, lookup_recipes
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lookup import _repetitive_prompt
from tests.test_lossless import model_specs
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution

TAKERS = ("swift", "qspec", "layerskip", "kangaroo", "m2r2", "eagle")
# Options that make a taker draft every round with its own drafter (qspec's default is the
# adaptive policy, which may decline rounds)
FIXED = {"qspec": {"adaptive": False}}
# Takers whose own drafts are kept about as long as lookup's copied ones (a copy of the model)
ACCURATE = ("qspec",)


def _eta(data) -> float:
    return data.draw(
        st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)), label="threshold"
    )


def _recipe_options(data, recipe: str, layers: int) -> tuple[dict, str]:
    """Options of ``recipe`` drawn for a ``layers``-layer model, and the option that sets its
    draft length (the most drafts a lookup round takes too)."""
    d = data.draw(st.integers(1, 6), label="drafts")
    if recipe == "swift":
        skip = data.draw(st.sets(st.integers(1, layers - 1), min_size=1), label="skip_layers")
        return dict(skip_layers=tuple(skip), num_speculations=d), "num_speculations"
    if recipe == "qspec":
        fmt = data.draw(st.sampled_from(["q8_0", "q4_0", "q4_1"]), label="draft_weights")
        return dict(draft_weights=fmt, num_speculations=d, adaptive=False), "num_speculations"
    if recipe == "layerskip":  # a threshold > 0: dynamic layerskip
        exit_layer = data.draw(st.integers(1, layers - 1), label="exit_layer")
        opts = dict(exit_layer=exit_layer, num_speculations=d, confidence_threshold=_eta(data))
        return opts, "num_speculations"
    if recipe == "kangaroo":
        exit_layer = data.draw(st.integers(1, layers - 1), label="exit_layer")
        opts = dict(exit_layer=exit_layer, max_draft_tokens=d, confidence_threshold=_eta(data))
        return opts, "max_draft_tokens"
    if recipe == "m2r2":
        fast = data.draw(st.integers(1, layers - 1), label="fast_layers")
        opts = dict(fast_layers=fast, num_speculations=d, confidence_threshold=_eta(data))
        return opts, "num_speculations"
    assert recipe == "eagle"
    init = data.draw(st.integers(0, layers - 1), label="init_layer")
    opts = dict(max_draft_tokens=d, confidence_threshold=_eta(data), init_layer=init)
    return opts, "max_draft_tokens"


def _check_rounds(sm, recipe: str) -> None:
    """Every round that drafted is one verify, counted under the drafter that ran it."""
    m = sm.last_metrics
    assert set(m.drafter_rounds) <= {"lookup", recipe}
    assert sum(m.drafter_rounds.values()) == m.verify_calls
    assert sum(m.ngram_matches.values()) == m.drafter_rounds.get("lookup", 0)


def test_the_drafting_recipes_take_lookup():
    assert lookup_recipes() == list(TAKERS)


@settings(max_examples=examples(20, 80), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_lookup_first_greedy_identical_to_hf(spec, data):
    recipe = data.draw(st.sampled_from(TAKERS), label="recipe")
    model = tiny_model(**spec)
    prompt = _repetitive_prompt(data, spec["vocab"])
    options, draft_option = _recipe_options(data, recipe, spec["layers"])
    max_ngram = data.draw(st.integers(1, 4), label="max_ngram")
    min_ngram = data.draw(st.integers(1, max_ngram), label="min_ngram")
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    sm = rewrite.apply(
        model, recipe, lookup=True, max_ngram=max_ngram, min_ngram=min_ngram, **options
    )
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    d = options[draft_option]
    assert all(1 <= s <= d + 1 for s in sm.last_metrics.accepted_per_verify)
    _check_rounds(sm, recipe)


@pytest.mark.parametrize("recipe", TAKERS)
def test_lookup_rounds_happen_and_stay_lossless(recipe):
    # The tests' tiny models are sharpened: greedy falls into short cycles, which n-gram drafts
    # continue; the recipe's own (untrained) drafter runs where the text has no match.
    model = tiny_model("llama", layers=4, vocab=32, seed=1)
    prompt = torch.tensor([[1, 2, 3, 4, 5] * 3])
    ref = hf_greedy(model, prompt, 40)
    plain = rewrite.apply(model, recipe, **FIXED.get(recipe, {}))
    assert torch.equal(plain.generate(prompt, max_new_tokens=40), ref)
    assert set(plain.last_metrics.drafter_rounds) == {recipe}  # lookup=False: as before
    sm = rewrite.apply(model, recipe, lookup=True, max_ngram=2, **FIXED.get(recipe, {}))
    assert sm.options.lookup and sm.options.max_ngram == 2
    assert torch.equal(sm.generate(prompt, max_new_tokens=40), ref)
    rounds = sm.last_metrics.drafter_rounds
    assert rounds.get("lookup", 0) > 0 and rounds.get(recipe, 0) > 0, rounds
    _check_rounds(sm, recipe)
    # fewer verify passes than without lookup: the copied drafts are accepted in long runs
    # (longer than an untrained drafter's; qspec's copy of the model is kept as long itself)
    if recipe not in ACCURATE:
        assert sm.last_metrics.verify_calls < plain.last_metrics.verify_calls


@pytest.mark.parametrize("recipe", ["swift", "eagle"])
def test_lookup_first_sampling_matches_target_distribution(recipe):
    # prompt 1 4 2 1 4: the first rounds find a match of the newest token (or of (4, x)), the
    # others draft with the recipe's own drafter; 3 new tokens, up to two drafts a round.
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2, 1, 4]])
    exact = _exact_distribution(model, prompt, 3)
    draft = {"swift": dict(skip_layers=(1,), num_speculations=2), "eagle": {}}[recipe]
    sm = rewrite.apply(model, recipe, lookup=True, max_ngram=2, **draft)
    n = 3000
    counts, rejections, drafted = sample_counts(
        sm, prompt, exact, 3, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert drafted > n // 2 and 0 < rejections < drafted  # drafts both kept and rejected
    assert_sampled_from(counts, exact, n)


@pytest.mark.parametrize("recipe", sorted(set(RECIPES) - set(TAKERS)))
def test_recipes_that_do_not_take_lookup_refuse_it(recipe):
    model = tiny_model("llama", layers=4)
    message = (
        rf"lookup: recipe '{recipe}' does not take lookup=True \(.+\); recipes that take it: "
        + ", ".join(TAKERS)
    )
    with pytest.raises(ValueError, match=message):
        rewrite.apply(model, recipe, lookup=True)
    if recipe not in ("specee", "m2r2_exit"):  # they need their trained parts to apply
        assert rewrite.apply(model, recipe, lookup=False).recipe.name == recipe  # a no-op


def test_lookup_options_are_validated_as_the_lookup_recipes_are():
    model = tiny_model("llama", layers=4)
    with pytest.raises(ValueError, match=r"lookup: 1 is invalid; allowed: True or False"):
        rewrite.apply(model, "swift", lookup=1)
    with pytest.raises(ValueError, match=r"min_ngram: 3 is invalid; allowed: an integer 1\.\.2"):
        rewrite.apply(model, "layerskip", lookup=True, max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match=r"max_ngram: 0 is invalid; allowed: an integer >= 1"):
        rewrite.apply(model, "kangaroo", lookup=True, max_ngram=0)


def test_onnx_export_keeps_lookup_first(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from leapfx.export import OnnxModel, export_onnx

    model = tiny_model("llama", layers=2, vocab=32, seed=1)
    prompt = torch.tensor([[1, 2, 3, 4, 5] * 3])
    sm = rewrite.apply(model, "kangaroo", lookup=True, max_ngram=2)
    om = OnnxModel(export_onnx(sm, tmp_path / "kangaroo"), threads=1)
    assert om.options.lookup and om.options.max_ngram == 2  # the manifest's options
    ours = om.generate(prompt, max_new_tokens=24)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, 24), prompt.shape[1])
    assert om.last_metrics.drafter_rounds.get("lookup", 0) > 0
