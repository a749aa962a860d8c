"""Losslessness: leapfx greedy decoding is token-identical to HF greedy ``generate``.

Hypothesis draws random tiny configs of every supported architecture (2-8 layers, hidden sizes,
GQA ratios, tied and untied embeddings, sliding windows), prompts of 1-32 tokens, exit layers and
num_speculations. Float ties are detected and reported (see greedy_check), never assumed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.runtime.sampling import SamplingParams, warp_logits
from tests.conftest import ARCHS, examples, tiny_model
from tests.greedy_check import assert_greedy_equal, hf_greedy


@st.composite
def model_specs(draw, archs=ARCHS):
    arch = draw(st.sampled_from(archs))
    layers = draw(st.integers(2, 8))
    heads = draw(st.sampled_from([2, 4, 8]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    vocab = draw(st.integers(16, 300))
    spec = dict(
        arch=arch,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        tie=draw(st.booleans()),
        eos=draw(st.one_of(st.none(), st.integers(0, vocab - 1))),
        seed=draw(st.integers(0, 2**16)),
    )
    if arch in ("mistral", "qwen2", "phi3"):
        spec["sliding_window"] = draw(st.one_of(st.none(), st.integers(2, 24)))
    return spec


def _prompt(data, vocab: int) -> torch.Tensor:
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=32), label="prompt")
    return torch.tensor([ids])


@settings(max_examples=examples(200, 300))
@given(spec=model_specs(), data=st.data())
def test_layerskip_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    exit_layer = data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer")
    d = data.draw(st.integers(1, 8), label="num_speculations")
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    # 0: d drafts a round (the paper); > 0: rounds stop at the first unconfident draft.
    eta = data.draw(st.sampled_from([0.0, 0.0, 0.3, 0.6, 0.95]), label="confidence_threshold")
    sm = rewrite.apply(model, "layerskip", exit_layer=exit_layer, num_speculations=d,
                       confidence_threshold=eta)  # fmt: skip
    ours = sm.generate(prompt, max_new_tokens=max_new)
    ref = hf_greedy(model, prompt, max_new)
    assert_greedy_equal(model, ours, ref, prompt.shape[1])
    m = sm.last_metrics
    assert m.new_tokens == ours.shape[1] - prompt.shape[1]
    assert 0.0 <= m.acceptance_rate <= 1.0
    # Every verify step emits 1..d+1 tokens; truncation at EOS/max_new_tokens only drops some.
    assert all(1 <= s <= d + 1 for s in m.accepted_per_verify)
    assert m.full_calls + sum(m.accepted_per_verify) >= m.new_tokens


def test_layerskip_confidence_threshold_shortens_rounds():
    # A flattened head keeps the exit's top-1 probabilities low: with eta 0.9 most rounds stop
    # after one or two drafts, so there are more, shorter rounds; the output does not change.
    model = tiny_model("llama", layers=4, vocab=64, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    fixed = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=6)
    dynamic = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=6,
                            confidence_threshold=0.9)  # fmt: skip
    a = fixed.generate(prompt, max_new_tokens=40)
    b = dynamic.generate(prompt, max_new_tokens=40)
    assert torch.equal(a, b)
    assert_greedy_equal(model, b, hf_greedy(model, prompt, 40), prompt.shape[1])
    mf, md = fixed.last_metrics, dynamic.last_metrics
    assert md.drafted_tokens / md.verify_calls < mf.drafted_tokens / mf.verify_calls
    assert md.verify_calls > mf.verify_calls


@settings(max_examples=examples(80, 300))
@given(spec=model_specs(), data=st.data())
def test_autoregressive_schedule_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    ours = rewrite.apply(model, "autoregressive").generate(prompt, max_new_tokens=max_new)
    ref = hf_greedy(model, prompt, max_new)
    # The autoregressive schedule runs the same kernels in the same order as HF: no ties allowed.
    assert torch.equal(ours, ref), f"ours {ours.tolist()}\nHF   {ref.tolist()}"


@settings(max_examples=examples(40, 160))
@given(spec=model_specs(), data=st.data())
def test_early_exit_is_greedy_over_the_exit_head(spec, data):
    """The lossy early-exit schedule decodes greedily with norm + head after layer E."""
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    e = data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer")
    max_new = data.draw(st.integers(1, 12), label="max_new_tokens")
    ours = rewrite.apply(model, "early_exit", exit_layer=e).generate(prompt, max_new_tokens=max_new)
    # Reference: a copy of the HF model truncated to its first e layers.
    import copy

    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:e]
    short.config.num_hidden_layers = e
    if getattr(short.config, "layer_types", None):
        short.config.layer_types = short.config.layer_types[:e]
    ref = hf_greedy(short, prompt, max_new)
    assert_greedy_equal(short, ours, ref, prompt.shape[1])


def test_layerskip_float64_is_exact_with_long_generation():
    """In float64 float ties cannot happen: the output must be identical, full stop."""
    model = tiny_model("llama", layers=6, vocab=64, dtype=torch.float64, seed=3)
    prompt = torch.tensor([[5, 9, 1, 33, 2]])
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=5)
    ours = sm.generate(prompt, max_new_tokens=96)
    ref = hf_greedy(model, prompt, 96)
    assert torch.equal(ours, ref)
    assert sm.last_metrics.verify_calls > 0 and sm.last_metrics.drafted_tokens > 0


def test_verify_reuses_draft_layers():
    """Exit-query cache: verify runs lower layers only for the last draft of each round."""
    model = tiny_model("llama", layers=4, seed=1)
    calls = {i: 0 for i in range(4)}
    hooks = [
        layer.register_forward_hook(lambda mod, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(model.model.layers)
    ]
    # fuse_layers=False: the HF layer modules run, so their forward hooks count the calls.
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=4, fuse_layers=False)
    sm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20)
    for h in hooks:
        h.remove()
    m = sm.last_metrics
    # lower layers: prefill + every draft + one token per verify; upper: prefill + every verify.
    assert calls[0] == calls[1] == m.full_calls + m.draft_calls + m.verify_calls
    assert calls[2] == calls[3] == m.full_calls + m.verify_calls


@pytest.mark.parametrize("recipe", ["autoregressive", "layerskip", "early_exit"])
def test_fused_and_module_layers_decode_identically(recipe):
    model = tiny_model("qwen3", layers=5, seed=7)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    outs = [
        rewrite.apply(model, recipe, fuse_layers=fuse).generate(prompt, max_new_tokens=40)
        for fuse in (True, False)
    ]
    assert torch.equal(outs[0], outs[1])


def test_sampling_params_follow_generation_config():
    model = tiny_model("llama")
    model.generation_config.top_k = 7
    params = SamplingParams.from_generation_config(model.generation_config, do_sample=True)
    assert params.top_k == 7
    logits = torch.randn(1, 128)
    assert int(torch.isfinite(warp_logits(logits, params)).sum()) == 7
