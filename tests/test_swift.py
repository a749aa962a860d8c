"""Layer-skip drafting (``swift``): the skip pass, losslessness, sampling, the skip-set search."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.bench.sweep import predicted_speedup
from leapfx.passes.capture import capture
from leapfx.passes.partition import full_stage
from leapfx.passes.skip_layers import SkipLayers
from leapfx.runtime.runner import StageRunner
from leapfx.runtime.swift import search_skip_set
from tests.conftest import examples, tiny_model, tiny_moe_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lossless import model_specs
from tests.test_moe import moe_specs
from tests.test_partition import _check_golden
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution


def test_skip_layers_is_the_model_without_them():
    model = tiny_model("llama", layers=5, vocab=40, seed=3)
    gm = full_stage(capture(model))
    result = SkipLayers(layers=(1, 3)).run(gm)
    assert result.modified and result.matches == 2
    assert "layer_1" not in gm.code and "layer_3" not in gm.code
    assert SkipLayers(layers=()).run(full_stage(capture(model))).matches == 0  # no match
    # The draft stage's logits are those of HF's model with the layers deleted (its cache
    # slots renumbered: the skipped layers' slots are simply never written).
    short = copy.deepcopy(model)
    short.model.layers = torch.nn.ModuleList([short.model.layers[i] for i in (0, 2, 4)])
    for i, layer in enumerate(short.model.layers):
        layer.self_attn.layer_idx = i
    short.config.num_hidden_layers = 3
    ids = torch.tensor([[5, 1, 7, 2]])
    with torch.no_grad():
        want = short(ids).logits
    sm = rewrite.apply(model, "swift", skip_layers=(1, 3), fuse_layers=False)
    with torch.inference_mode():  # as generate() runs (the cache is an inference tensor)
        runner = StageRunner(sm.stages.modules, sm._cache_for(8), sm._layout)
        got = runner.chunk("draft", ids, 0)["logits"]
    torch.testing.assert_close(got, want)
    assert runner.cache.lengths == [4, 0, 4, 0, 4]  # skipped layers write nothing


def test_golden_swift_stage_text():
    sm = rewrite.apply(tiny_model("llama", layers=4), "swift", skip_layers=(1, 2))
    _check_golden("swift_llama4", sm.stages.code())


def test_swift_options_are_validated():
    model = tiny_model("llama", layers=4)
    assert rewrite.apply(model, "swift").options.skip_layers == (1,)
    for bad in [(0,), (4,), (), (1, 1)]:
        with pytest.raises(ValueError, match="skip_layers: .* allowed: distinct layer indices"):
            rewrite.apply(model, "swift", skip_layers=bad)
    with pytest.raises(ValueError, match="backend='eager'"):
        rewrite.apply(model, "swift").compile()


def _skip_set(data, layers: int) -> tuple[int, ...]:
    return tuple(data.draw(st.sets(st.integers(1, layers - 1), min_size=1), label="skip_layers"))


@settings(max_examples=examples(15, 40), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_swift_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    ids = data.draw(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=24))
    prompt = torch.tensor([ids])
    d = data.draw(st.integers(1, 6), label="num_speculations")
    max_new = data.draw(st.integers(1, 20), label="max_new_tokens")
    sm = rewrite.apply(model, "swift", skip_layers=_skip_set(data, spec["layers"]),
                       num_speculations=d)  # fmt: skip
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    assert all(1 <= s <= d + 1 for s in sm.last_metrics.accepted_per_verify)


@settings(max_examples=examples(4, 10), deadline=None)
@given(spec=moe_specs(), data=st.data())
def test_swift_greedy_identical_to_hf_on_moe(spec, data):
    model = tiny_moe_model(**spec)
    ids = data.draw(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=16))
    prompt = torch.tensor([ids])
    max_new = data.draw(st.integers(1, 12), label="max_new_tokens")
    sm = rewrite.apply(model, "swift", skip_layers=_skip_set(data, spec["layers"]))
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])


def test_swift_sampling_matches_target_distribution():
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact_distribution(model, prompt, 3)
    sm = rewrite.apply(model, "swift", skip_layers=(1,), num_speculations=2)
    n = 4000
    counts, rejections, drafted = sample_counts(
        sm, prompt, exact, 3, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert drafted >= n and 0 < rejections < drafted
    assert_sampled_from(counts, exact, n)


@pytest.mark.parametrize("seed", range(5))
def test_search_finds_the_best_skip_set_of_a_synthetic_table(seed):
    # Each layer's skip costs acceptance by its own share (additive, as a layer's importance);
    # a draft costs the share of layers it runs. The formula's speed for each set is the table;
    # the search must find the set exhaustive search finds.
    L, d = 8, 4
    g = torch.Generator().manual_seed(seed)
    harm = (torch.rand(L, generator=g) * 0.3).tolist()
    calls: list[tuple[int, ...]] = []

    def speed(skip: tuple[int, ...]) -> float:
        calls.append(skip)
        if not skip:
            return 1.0
        alpha = max(0.0, 0.98 - sum(harm[i] for i in skip))
        return predicted_speedup(alpha, d, (L - len(skip)) / L)

    best, score = search_skip_set(speed, L)
    searched = len(calls)
    subsets = [
        s for k in range(1, L - 1) for s in itertools.combinations(range(1, L), k)
    ]  # fmt: skip
    truth = max([(), *subsets], key=speed)
    assert best == truth and score == pytest.approx(speed(truth))
    assert searched < len(subsets) // 2  # greedy: far fewer evaluations than every set


def test_calibrate_skip_set_runs_the_search_on_measured_decodes():
    from leapfx.bench.swift_search import calibrate_skip_set

    model = tiny_model("llama", layers=3, vocab=32, seed=1)
    skip, ratio = calibrate_skip_set(model, [torch.tensor([[1, 2, 3, 1, 2]])], max_new_tokens=8)
    assert skip in [(), (1,), (2,)] and ratio > 0  # at most L - 2 = 1 layer skipped
