"""Half precision on a CPU: every recipe generates from a bfloat16 / float16 model.

Losslessness is exact only in float32/float64 (the property tests in test_lossless.py and
test_kangaroo_lossless.py prove it there). In half precision a verify pass over several
positions rounds differently from one-token steps, so a near tie between the top two logits
may resolve the other way: ``assert_greedy_equal`` accepts a divergence only where the full
model's gap is within the dtype's tolerance of a tie (``leapfx.bench.ties``), then checks the
rest against HF greedy continued from our choice.
"""

from __future__ import annotations

import pytest
import torch

from leapfx import rewrite
from tests.conftest import tiny_model
from tests.greedy_check import assert_greedy_equal, hf_greedy

HALF = [torch.bfloat16, torch.float16]
LOSSLESS = [
    ("autoregressive", {}),
    ("layerskip", {"exit_layer": 2, "num_speculations": 3}),
    ("layerskip", {"exit_layer": 1, "num_speculations": 4, "confidence_threshold": 0.5}),
    ("kangaroo", {"exit_layer": 2, "max_draft_tokens": 4}),
    ("kangaroo", {"exit_layer": 1, "max_draft_tokens": 3, "confidence_threshold": 0.0}),
]
PROMPTS = [[5, 17, 42, 9, 3], [100, 2, 2, 77], [64]]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_greedy_matches_hf_up_to_near_ties(arch, dtype):
    model = tiny_model(arch, layers=4, dtype=dtype, seed=1)
    for prompt in map(lambda p: torch.tensor([p]), PROMPTS):
        ref = hf_greedy(model, prompt, 20)
        for name, options in LOSSLESS:
            sm = rewrite.apply(model, name, **options)
            out = sm.generate(prompt, max_new_tokens=20)
            assert out.dtype == prompt.dtype and out.shape == ref.shape
            assert_greedy_equal(model, out, ref, prompt.shape[1])
        early = rewrite.apply(model, "early_exit", exit_layer=2).generate(prompt, max_new_tokens=8)
        assert early.shape == (1, prompt.shape[1] + 8)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_sampling_runs(dtype):
    model = tiny_model("llama", layers=4, dtype=dtype)
    prompt = torch.tensor([PROMPTS[0]])
    for name, options in LOSSLESS[1:]:
        sm = rewrite.apply(model, name, **options)
        gen = torch.Generator().manual_seed(0)
        out = sm.generate(prompt, max_new_tokens=16, do_sample=True, temperature=0.8,
                          generator=gen)  # fmt: skip
        assert out.shape == (1, prompt.shape[1] + 16)
        assert int(out.max()) < model.config.vocab_size


def test_cpu_kernels_are_off_for_half_precision():
    # auto leaves them off (they multiply float32 weights); asking for them says why not.
    model = tiny_model("llama", layers=4, dtype=torch.bfloat16)
    sm = rewrite.apply(model, "layerskip", exit_layer=2)
    with pytest.raises(ValueError, match="needs a CPU model in float32; .* torch.bfloat16"):
        sm.use_cpu_kernels()
    assert sm.cpu_kernels is False


@pytest.mark.slow
def test_inductor_bfloat16_layerskip_matches_hf_up_to_near_ties():
    model = tiny_model("llama", layers=4, dtype=torch.bfloat16)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3).compile()
    assert sm.cpu_kernels is False  # auto: float32 only
    for prompt in map(lambda p: torch.tensor([p]), PROMPTS[:2]):
        out = sm.generate(prompt, max_new_tokens=20)
        assert_greedy_equal(model, out, hf_greedy(model, prompt, 20), prompt.shape[1])
