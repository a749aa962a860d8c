"""Layer-skip drafting (``swift``): the skip pass, losslessness, sampling, the skip-set search."""

from __future__ import annotations

import copy
import itertools
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.bench.sweep import predicted_speedup
from leapfx.passes.capture import capture
from leapfx.passes.partition import full_stage
from leapfx.passes.skip_layers import SkipLayers
from leapfx.runtime import swift as swift_runtime
from leapfx.runtime.runner import StageRunner
from leapfx.runtime.sampling import SamplingParams
from leapfx.runtime.schedules import DecodeRequest
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
        got = runner.rows("draft", 0, 4, input_ids=ids)["logits"]  # every position's
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


def _table_speed(L: int, d: int, seed: int):
    """A synthetic tokens/s table over skip sets (additive layer harms, as above), and the set
    exhaustive search finds in it."""
    g = torch.Generator().manual_seed(seed)
    harm = (torch.rand(L, generator=g) * 0.3).tolist()

    def speed(skip: tuple[int, ...]) -> float:
        if not skip:
            return 100.0
        alpha = max(0.0, 0.98 - sum(harm[i] for i in skip))
        return 100.0 * predicted_speedup(alpha, d, (L - len(skip)) / L)

    subsets = [s for k in range(1, L - 1) for s in itertools.combinations(range(1, L), k)]
    return speed, max([(), *subsets], key=speed)


def _fake_measure(monkeypatch, sm, table):
    """Replace the timed decodes with ``table``, read off the stages ``calibrate`` really cut:
    each measurement runs one short decode, then scores the set the draft stage skips (the
    empty set for the autoregressive baseline)."""
    measured: list[tuple[int, ...]] = []

    def fake(run, prompts, max_new_tokens):
        metrics = run(prompts[0], DecodeRequest(2, frozenset(), SamplingParams()))
        draft = sm.stages.modules["draft"].code
        skipped = tuple(i for i in range(sm.config.num_hidden_layers) if f"layer_{i}(" not in draft)
        skip = () if metrics.schedule == "autoregressive" else skipped
        assert skip == () or skip == sm.options.skip_layers  # the stage and the options agree
        measured.append(skip)
        return table(skip)

    monkeypatch.setattr(swift_runtime, "measured_speed", fake)
    return measured


@pytest.mark.parametrize("seed", [0, 3, 5])  # tables where some set pays (1, 3 or 4 layers)
def test_calibrate_keeps_the_best_set_of_a_synthetic_table(monkeypatch, seed):
    L = 6
    model = tiny_model("llama", layers=L, vocab=32, seed=1)
    sm = rewrite.apply(model, "swift")
    speed, truth = _table_speed(L, sm.options.num_speculations, seed)
    measured = _fake_measure(monkeypatch, sm, speed)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    result = sm.calibrate([prompt], max_new_tokens=4, progress=False)
    assert truth and result.skip_layers == truth == sm.options.skip_layers
    assert result.speedup == pytest.approx(speed(truth) / 100.0)
    assert result.evaluated == len(measured) == len(set(measured))  # each set measured once
    assert sm.calibration is result
    assert torch.equal(sm.generate(prompt, max_new_tokens=12), hf_greedy(model, prompt, 12))


def test_calibrate_drafts_with_the_fastest_layer_where_no_set_pays(monkeypatch):
    model = tiny_model("llama", layers=4, vocab=32, seed=1)
    sm = rewrite.apply(model, "swift", skip_layers=(1, 2))
    rates = {(): 10.0, (1,): 6.0, (2,): 8.0, (3,): 7.0}
    _fake_measure(monkeypatch, sm, lambda skip: rates.get(skip, 1.0))
    with pytest.warns(UserWarning, match=r"no skip set beat autoregressive .*\(2,\), ran 0\.80x"):
        result = sm.calibrate([torch.tensor([[3, 1, 4]])], max_new_tokens=4, progress=False)
    assert result.skip_layers == sm.options.skip_layers == (2,) and result.evaluated == 4


def test_calibrated_skip_set_saves_and_loads_with_the_parts(monkeypatch, tmp_path):
    L = 5
    model = tiny_model("llama", layers=L, vocab=32, seed=2)
    sm = rewrite.apply(model, "swift", num_speculations=3)
    speed, truth = _table_speed(L, 3, seed=4)
    _fake_measure(monkeypatch, sm, speed)
    result = sm.calibrate([torch.tensor([[5, 6, 7, 5]])], max_new_tokens=4, progress=False)
    sm.save_parts(tmp_path / "parts")
    meta = json.loads((tmp_path / "parts" / "swift.json").read_text())
    assert meta["options"] == {"skip_layers": list(truth), "num_speculations": 3}
    assert meta["calibration"]["speedup"] == pytest.approx(result.speedup)
    loaded = rewrite.apply(model, "swift", parts=tmp_path / "parts")
    assert loaded.options.skip_layers == truth and loaded.options.parts == str(tmp_path / "parts")
    assert loaded.stages.code() == sm.stages.code()
    # the same set given explicitly is fine; another one conflicts, naming both
    assert rewrite.apply(model, "swift", parts=tmp_path / "parts", skip_layers=list(truth))
    other = (1,) if truth != (1,) else (2,)
    with pytest.raises(ValueError, match=re.escape(f"skip_layers: {other} differs from the set")):
        rewrite.apply(model, "swift", parts=tmp_path / "parts", skip_layers=other)
    with pytest.raises(ValueError, match=r"parts: .* for another model: num_hidden_layers=5"):
        rewrite.apply(tiny_model("llama", layers=4), "swift", parts=tmp_path / "parts")
    with pytest.raises(ValueError, match=r"parts: .* is not a swift parts directory"):
        rewrite.apply(model, "swift", parts=tmp_path / "missing")
    # an uncalibrated set saves too (no calibration record)
    rewrite.apply(model, "swift", skip_layers=(2,)).save_parts(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "swift.json").read_text())["calibration"] is None


def test_calibrate_is_refused_where_it_cannot_run():
    model = tiny_model("llama", layers=4)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"calibrate: recipe 'layerskip' has no skip set"):
        rewrite.apply(model, "layerskip").calibrate([prompt])
    sm = rewrite.apply(model, "swift")
    with pytest.raises(ValueError, match=r"prompts: Tensor is invalid; allowed: a non-empty"):
        sm.calibrate(prompt)
    with pytest.raises(ValueError, match=r"max_skip: 4 is invalid; allowed: None or .* 1\.\.3"):
        sm.calibrate([prompt], max_skip=4)
    with pytest.raises(ValueError, match=r"max_new_tokens: 0 is invalid"):
        sm.calibrate([prompt], max_new_tokens=0)
    with pytest.raises(ValueError, match=r"fit: recipe 'swift' trains nothing .*calibrate"):
        sm.fit(torch.arange(10))
