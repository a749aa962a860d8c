"""SamplingParams, HF-exact logits warping, and inverse-CDF sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from leapfx.runtime import sampling
from leapfx.runtime.sampling import SamplingParams, probs, sample, warp_logits
from tests.conftest import examples

# ---------------------------------------------------------------- warp_logits vs HF's warpers


@st.composite
def logits_and_params(draw):
    n = draw(st.integers(1, 4))
    V = draw(st.integers(1, 40))
    # Few distinct values -> many ties, which is where top-k/top-p semantics differ between
    # implementations; the wide scale makes float32 probabilities underflow to exactly 0.
    scale = draw(st.sampled_from([0.1, 1.0, 10.0, 60.0]))
    values = st.integers(-8, 8).map(lambda i: i * scale)
    rows = [draw(st.lists(values, min_size=V, max_size=V)) for _ in range(n)]
    logits = torch.tensor(rows, dtype=torch.float32)
    if draw(st.booleans()):  # some already-masked tokens, at least one finite per row
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=V, max_size=V)))
        mask[logits.argmax(-1)] = False
        logits = logits.masked_fill(mask, -math.inf)
    temperature = draw(st.sampled_from([1.0, 0.3, 0.7, 1.5, 4.0]) | st.floats(0.05, 5.0))
    top_k = draw(st.none() | st.just(0) | st.integers(1, V + 3))
    # 1e-9 rounds 1 - top_p to 1.0 in float32, where only min_tokens_to_keep saves the argmax
    top_p = draw(st.none() | st.sampled_from([1.0, 0.5, 0.9, 1e-9]) | st.floats(0.01, 1.0))
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    return logits, params


def hf_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's own warpers, built with the conditions of GenerationMixin._get_logits_processor."""
    procs = LogitsProcessorList()
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k is not None and params.top_k != 0:
        procs.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p is not None and params.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    input_ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    return procs(input_ids, logits.clone())


def assert_same_warp(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    kept = torch.isfinite(theirs)
    assert torch.equal(torch.isfinite(ours), kept), "different tokens filtered"
    assert torch.all(ours[~kept] == -math.inf)
    torch.testing.assert_close(ours[kept], theirs[kept])


@settings(max_examples=examples(300, 300), deadline=None)
@given(logits_and_params())
def test_warp_logits_matches_hf_warpers(case):
    logits, params = case
    assert_same_warp(warp_logits(logits, params), hf_warp(logits, params))


@settings(max_examples=examples(50, 200), deadline=None)
@given(logits_and_params())
def test_warp_logits_any_leading_shape(case):
    logits, params = case
    V = logits.shape[-1]
    stacked = torch.cat([logits, logits.flip(0)])  # [2n, V]
    ours = warp_logits(stacked.reshape(2, -1, V), params)  # [2, n, V]
    assert ours.shape == (2, logits.shape[0], V)
    assert_same_warp(ours.reshape(-1, V), hf_warp(stacked, params))
    assert_same_warp(warp_logits(logits[0], params)[None], hf_warp(logits[:1], params))


def test_top_p_one_is_skipped_like_hf():
    # exp(-200) underflows to 0 in float32: a top_p < 1 rule would drop the second token, which
    # HF does not apply at top_p == 1.0.
    logits = torch.tensor([[0.0, -200.0]])
    p = SamplingParams(do_sample=True, top_p=1.0)
    assert torch.isfinite(warp_logits(logits, p)).all()
    p = SamplingParams(do_sample=True, top_p=0.999)
    assert torch.isinf(warp_logits(logits, p)[0, 1])


def test_tiny_top_p_keeps_the_argmax():
    logits = torch.tensor([[0.5, 2.0, 1.0], [3.0, 3.0, -1.0]])
    out = warp_logits(logits, SamplingParams(do_sample=True, top_p=1e-9))
    assert torch.isfinite(out).sum(-1).tolist() == [1, 1]
    assert torch.isfinite(out[0, 1])


def test_top_k_keeps_ties():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    out = warp_logits(logits, SamplingParams(do_sample=True, top_k=2))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_greedy_params_do_not_warp():
    logits = torch.randn(2, 3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=False, temperature=0.5, top_k=1, top_p=0.1)
    out = warp_logits(logits, params)
    assert out.dtype == torch.float32
    assert torch.equal(out, logits.float())


def test_probs_is_float32_softmax_of_warped():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0)).bfloat16()
    params = SamplingParams(do_sample=True, temperature=0.6, top_k=5, top_p=0.8)
    out = probs(logits, params)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.sum(-1), torch.ones(3))
    assert torch.equal(out == 0, torch.isinf(warp_logits(logits, params)))
    torch.testing.assert_close(out, torch.softmax(hf_warp(logits.float(), params), -1))


def test_matches_hf_generate_scores():
    """End to end: HF generate's processed scores for a tiny model equal our warp of its logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=200,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # spread the logits so top-k and top-p both bite
    ids = torch.randint(1, 200, (3, 5))
    for overrides in [{}, {"temperature": 0.8, "top_p": 0.9}, {"top_k": 0, "top_p": 0.5}]:
        params = SamplingParams.from_generation_config(
            model.generation_config, do_sample=True, **overrides
        )
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=1,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **overrides,
        )
        ours = warp_logits(out.logits[0], params)
        assert_same_warp(ours, out.scores[0])
        assert torch.isinf(ours).any(), overrides  # the case is not vacuous


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"do_sample": True, "temperature": -0.5}, "temperature"),
        ({"do_sample": True, "temperature": math.nan}, "temperature"),
        ({"do_sample": True, "temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"do_sample": 1}, "do_sample"),
    ],
)
def test_sampling_params_rejects(kwargs, option):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    msg = str(err.value)
    assert f"{option}=" in msg
    assert repr(kwargs[option]) in msg


def test_greedy_ignores_temperature():
    assert SamplingParams(do_sample=False, temperature=0.0).temperature == 0.0


def test_valid_params():
    SamplingParams(do_sample=True, temperature=0.01, top_k=0, top_p=1.0)
    SamplingParams(do_sample=True, temperature=2, top_k=1, top_p=1e-6)


def test_hf_defaults_match_transformers():
    defaults = GenerationConfig._get_default_generation_params()
    assert defaults["do_sample"] == sampling.HF_DEFAULT_DO_SAMPLE
    assert defaults["temperature"] == sampling.HF_DEFAULT_TEMPERATURE
    assert defaults["top_k"] == sampling.HF_DEFAULT_TOP_K
    assert defaults["top_p"] == sampling.HF_DEFAULT_TOP_P


def test_from_generation_config_defaults_and_overrides():
    assert SamplingParams.from_generation_config(GenerationConfig()) == SamplingParams(
        do_sample=False, temperature=1.0, top_k=50, top_p=1.0
    )
    assert SamplingParams.from_generation_config(None, do_sample=True).top_k == 50

    config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9)
    before = config.to_dict()
    got = SamplingParams.from_generation_config(config)
    assert got == SamplingParams(do_sample=True, temperature=0.6, top_k=50, top_p=0.9)
    got = SamplingParams.from_generation_config(
        config, temperature=None, top_k=0, top_p=None, do_sample=None
    )
    assert got == SamplingParams(do_sample=True, temperature=0.6, top_k=0, top_p=0.9)
    got = SamplingParams.from_generation_config(config, do_sample=False, temperature=1.3, top_k=7)
    assert got == SamplingParams(do_sample=False, temperature=1.3, top_k=7, top_p=0.9)
    assert config.to_dict() == before  # the caller's config is not written

    with pytest.raises(ValueError, match="top_p="):
        SamplingParams.from_generation_config(config, top_p=2.0)
    with pytest.raises(TypeError):
        SamplingParams.from_generation_config(config, top_h=0.5)


# ---------------------------------------------------------------- sample


def test_sample_hand_made():
    p = torch.tensor([0.25, 0.0, 0.5, 0.25, 0.0])
    cases = {0.0: 0, 0.2: 0, 0.25: 2, 0.5: 2, 0.74: 2, 0.75: 3, 0.9: 3}
    for u, token in cases.items():
        assert sample(p, torch.tensor(u)).item() == token, u
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    assert sample(p, below_one).item() == 3  # never the zero-mass tail token 4
    # out-of-contract u is clamped, still never a zero-mass token (nor an index past V)
    assert sample(p, torch.tensor(1.0)).item() == 3
    assert sample(p, torch.tensor(1.5)).item() == 3
    assert sample(torch.tensor([0.0, 1.0]), torch.tensor(-0.1)).item() == 1
    # u near 1 against a CDF that rounds to below 1: still the last token with mass
    p = torch.tensor([0.1] * 7 + [0.0, 0.0], dtype=torch.float32)
    assert sample(p, below_one).item() == 6
    # leading shape and unnormalised weights
    p = torch.tensor([[[1.0, 3.0], [0.0, 2.0]], [[2.0, 0.0], [5.0, 5.0]]])
    u = torch.tensor([[0.3, 0.0], [0.99, 0.5]])
    assert sample(p, u).tolist() == [[1, 1], [0, 1]]


@st.composite
def probs_and_u(draw):
    V = draw(st.integers(1, 12))
    w = draw(st.lists(st.sampled_from([0.0, 0.0, 1e-30, 0.1, 1.0, 3.0]), min_size=V, max_size=V))
    w[draw(st.integers(0, V - 1))] = 1.0
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    p = torch.tensor(w, dtype=dtype)
    p = p / p.sum() if draw(st.booleans()) else p
    u = draw(st.floats(0.0, 1.0, exclude_max=True, width=32) | st.just(1.0 - 2.0**-24))
    return p, u


@settings(max_examples=examples(300, 300), deadline=None)
@given(probs_and_u())
def test_sample_is_inverse_cdf(case):
    p, u = case
    u = torch.tensor(u, dtype=torch.float32)
    assert 0 <= u < 1
    tok = sample(p, u).item()
    assert p[tok] > 0
    cdf = p.cumsum(0)
    x = u.to(p.dtype) * cdf[-1]
    # the first token whose CDF exceeds u * total, or the last token with mass if none does
    exceeds = (cdf > x).nonzero()
    expected = exceeds[0, 0].item() if len(exceeds) else (p > 0).nonzero()[-1, 0].item()
    assert tok == expected
