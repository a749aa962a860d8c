"""A quantized copy of the model as its own draft (``qspec``): the copy, the stages, the
options, losslessness over every float architecture (and MoE), sampling, the default choice."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.kernels import cpu_blocks
from leapfx.modules.blocks import BlockLinear, quantized_copy
from leapfx.passes.quantized_draft import QDRAFT_SIZE
from leapfx.runtime.runner import StageRunner
from tests.conftest import examples, tiny_model, tiny_moe_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lossless import model_specs
from tests.test_moe import moe_specs
from tests.test_partition import _check_golden
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution

FORMATS = ("q8_0", "q4_0", "q4_1")


def _dequantized_model(model, fmt: str):
    """``model`` with each linear whose input size is a multiple of 32 replaced by its ``fmt``
    blocks dequantized: what the draft computes, in plain float modules (the reference)."""
    ref = copy.deepcopy(model)
    for module in ref.modules():
        if type(module) is torch.nn.Linear and module.in_features % 32 == 0:
            w = cpu_blocks.dequantize(cpu_blocks.quantize(module.weight, fmt.upper()))
            module.weight = torch.nn.Parameter(w)  # unties a tied head, as the copy does
    return ref


def test_quantized_copy_shares_all_but_the_linears_and_leaves_the_model_alone():
    model = tiny_model("qwen2", layers=2, heads=2, head_dim=16, vocab=50, tie=True, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layer = model.model.layers[0]
    q, count, nbytes = quantized_copy(layer, "Q4_0")
    assert count == 7  # q, k, v, o, gate, up, down
    attn = q.self_attn
    assert isinstance(attn.q_proj, BlockLinear) and attn.q_proj.bias is layer.self_attn.q_proj.bias
    assert q.input_layernorm is layer.input_layernorm  # shared, not copied
    assert type(layer.self_attn.q_proj) is torch.nn.Linear  # the model's own stay float
    assert nbytes == sum(m.blocks.numel() for m in q.modules() if isinstance(m, BlockLinear))
    norm = model.model.norm
    assert quantized_copy(norm, "Q8_0") == (norm, 0, 0)  # nothing to quantize: itself
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("fmt", FORMATS)
def test_draft_stage_is_the_model_over_its_quantized_weights(fmt):
    model = tiny_model("llama", layers=3, heads=2, head_dim=16, vocab=64, seed=4)
    ids = torch.tensor([[5, 1, 7, 2, 9]])
    with torch.no_grad():
        want = _dequantized_model(model, fmt)(ids).logits
    sm = rewrite.apply(model, "qspec", draft_weights=fmt)
    size = sm.stages["draft"].meta[QDRAFT_SIZE]
    assert size["linears"] == 3 * 7 + 1 and size["format"] == fmt.upper()
    assert size["float32_bytes"] == 4 * sum(
        m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear
    )
    with torch.inference_mode():
        runner = StageRunner(sm.stages.modules, sm._cache_for(8), sm._layout)
        got = runner.rows("draft", 0, 5, input_ids=ids)["logits"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # summation order only


def test_golden_qspec_stage_text():
    model = tiny_model("llama", layers=4, heads=2, head_dim=16)
    sm = rewrite.apply(model, "qspec", skip_layers=(2,))
    _check_golden("qspec_llama4", sm.stages.code())


def test_qspec_options_are_validated():
    model = tiny_model("llama", layers=4, heads=2, head_dim=16)
    o = rewrite.apply(model, "qspec", draft_weights="Q4_1").options
    assert (o.draft_weights, o.skip_layers, o.adaptive) == ("q4_1", (), True)
    for name, bad in [("draft_weights", "q5_k"), ("draft_weights", 8), ("head_weights", "f16")]:
        with pytest.raises(
            ValueError, match=rf"{name}: {bad!r} is invalid; allowed: 'q8_0', 'q4_0', 'q4_1'"
        ):
            rewrite.apply(model, "qspec", **{name: bad})
    with pytest.raises(ValueError, match=r"skip_layers: \(0,\) is invalid; allowed: distinct"):
        rewrite.apply(model, "qspec", skip_layers=(0,))
    with pytest.raises(ValueError, match=r"num_speculations: 0 is invalid"):
        rewrite.apply(model, "qspec", num_speculations=0)
    with pytest.raises(ValueError, match="backend='eager'"):
        rewrite.apply(model, "qspec").compile()


def _options(data, layers: int) -> dict:
    skip = data.draw(st.sets(st.integers(1, layers - 1), max_size=layers - 1), label="skip")
    return dict(
        draft_weights=data.draw(st.sampled_from(FORMATS), label="draft_weights"),
        head_weights=data.draw(st.sampled_from([None, *FORMATS]), label="head_weights"),
        skip_layers=tuple(sorted(skip)) or None,
        num_speculations=data.draw(st.integers(1, 8), label="num_speculations"),
        adaptive=data.draw(st.booleans(), label="adaptive"),
        lookup=data.draw(st.booleans(), label="lookup"),
    )


@settings(max_examples=examples(25, 100), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_qspec_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    ids = data.draw(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=24))
    prompt = torch.tensor([ids])
    max_new = data.draw(st.integers(1, 20), label="max_new_tokens")
    options = _options(data, spec["layers"])
    sm = rewrite.apply(model, "qspec", **options)
    if spec["heads"] * spec["head_dim"] % 32 == 0:  # every linear holds whole blocks
        assert sm.stages["draft"].meta[QDRAFT_SIZE]["linears"] > 0
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    d = options["num_speculations"]
    assert all(1 <= s <= d + 1 for s in sm.last_metrics.accepted_per_verify)


@settings(max_examples=examples(4, 10), deadline=None)
@given(spec=moe_specs(), data=st.data())
def test_qspec_greedy_identical_to_hf_on_moe(spec, data):
    model = tiny_moe_model(**spec)
    ids = data.draw(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=16))
    prompt = torch.tensor([ids])
    max_new = data.draw(st.integers(1, 12), label="max_new_tokens")
    sm = rewrite.apply(model, "qspec", **_options(data, spec["layers"]))
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])


def test_qspec_drafts_are_mostly_accepted():
    # A copy of the model agrees with it on most tokens: fixed-length rounds of 4 drafts
    # keep most of them (the recipe's point; random tiny weights, Q8_0).
    model = tiny_model("llama", layers=4, heads=4, head_dim=16, vocab=128, seed=7)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    sm = rewrite.apply(model, "qspec", adaptive=False, num_speculations=4)
    out = sm.generate(prompt, max_new_tokens=40)
    assert torch.equal(out, hf_greedy(model, prompt, 40))
    m = sm.last_metrics
    assert m.drafter_rounds.get("qspec", 0) >= 5 and m.acceptance_rate > 0.8


def test_qspec_sampling_matches_target_distribution():
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, head_dim=16, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 4, 2]])
    exact = _exact_distribution(model, prompt, 3)
    sm = rewrite.apply(model, "qspec", draft_weights="q4_0", adaptive=False, num_speculations=2)
    n = 4000
    counts, rejections, drafted = sample_counts(
        sm, prompt, exact, 3, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert drafted >= n and 0 < rejections < drafted
    assert_sampled_from(counts, exact, n)


def test_auto_drafts_with_the_quantized_copy_only_where_it_pays(monkeypatch):
    from leapfx.rewrite import defaults

    model = tiny_model("llama", layers=3, heads=2, head_dim=16, vocab=64, seed=3)
    assert not defaults.qspec_pays(model)  # a few KB of weights: a float step reads no memory
    assert rewrite.apply(model, "auto").recipe.name == "auto"
    monkeypatch.setattr(defaults, "QSPEC_MIN_FLOAT_BYTES", 0)
    assert defaults.qspec_pays(model)
    sm = rewrite.apply(model, "auto", num_speculations=3, max_ngram=2)
    o = sm.options
    assert sm.recipe.name == "qspec" and (o.lookup, o.adaptive) == (True, True)
    assert (o.num_speculations, o.max_ngram) == (3, 2)
    prompt = torch.tensor([[1, 2, 3, 1, 2]])
    assert torch.equal(sm.generate(prompt, max_new_tokens=16), hf_greedy(model, prompt, 16))
    # weights already blocks (a GGUF model loaded natively): the copy would be the model
    native = copy.deepcopy(model)
    native.lm_head = BlockLinear(cpu_blocks.quantize(model.lm_head.weight, "Q8_0"))
    assert not defaults.qspec_pays(native)
    assert not defaults.qspec_pays(model.to(torch.bfloat16))


def test_the_bench_has_a_qspec_row_with_its_costs():
    from leapfx.bench.harness import BenchConfig, run_bench

    model = tiny_model("llama", layers=3, heads=2, head_dim=16, vocab=64, seed=5)
    prompts = [torch.tensor([[1, 2, 3, 4, 1, 2]])]
    config = BenchConfig(recipe="qspec", max_new_tokens=12, repeats=1)
    rows = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    row = rows["leapfx_qspec"]
    assert row.identical_to_greedy and row.extra["dynamic_draft_length"] is True
    assert set(row.extra["drafter_rounds"]) <= {"qspec", "declined"}
    weights = row.extra["draft_weights"]  # the copy's memory, reported
    assert weights["format"] == "Q8_0" and 0 < weights["bytes"] < weights["float32_bytes"]
    if row.extra.get("draft_calls"):  # the adaptive policy drafted: c and verify reported
        assert row.extra["draft_cost"] > 0 and row.extra["verify_cost"] > 0
