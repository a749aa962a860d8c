"""Bad input: each raises ValueError naming the option, the value and what is allowed."""

from __future__ import annotations

import pytest
import torch
import transformers

from leapfx import rewrite
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4)


def test_unknown_recipe(model):
    with pytest.raises(ValueError, match=r"recipe: unknown recipe 'kangaroo2'.*layerskip"):
        rewrite.apply(model, "kangaroo2")


def test_unknown_option(model):
    with pytest.raises(ValueError, match=r"'num_drafts' is not an option.*num_speculations"):
        rewrite.apply(model, "layerskip", num_drafts=3)


@pytest.mark.parametrize("bad", [0, 4, 9, -2, 1.5, "2"])
def test_exit_layer_out_of_range(model, bad):
    with pytest.raises(ValueError, match=rf"exit_layer: {bad!r} is invalid; allowed: .*1\.\.3"):
        rewrite.apply(model, "layerskip", exit_layer=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_num_speculations_below_one(model, bad):
    with pytest.raises(ValueError, match=rf"num_speculations: {bad!r} is invalid; allowed: .*>= 1"):
        rewrite.apply(model, "layerskip", num_speculations=bad)


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "0.5", True])
def test_layerskip_confidence_threshold(model, bad):
    with pytest.raises(ValueError, match=r"confidence_threshold: .* allowed: a number in \[0, 1\)"):
        rewrite.apply(model, "layerskip", confidence_threshold=bad)


def test_unsupported_architecture():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2))
    with pytest.raises(ValueError, match=r"model: architecture 'gpt2'.*supported.*llama"):
        rewrite.apply(gpt2, "layerskip")


def test_batch_larger_than_one(model):
    # Batches decode (tests/test_batch.py) where the recipe batches; the others say why not.
    out = rewrite.apply(model, "layerskip", exit_layer=2).generate(
        torch.ones(2, 4, dtype=torch.long), max_new_tokens=3
    )
    assert out.shape == (2, 7)
    sm = rewrite.apply(model, "early_exit", exit_layer=2)
    with pytest.raises(ValueError, match=r"input_ids: 2 rows .* recipe 'early_exit' .*allowed"):
        sm.generate(torch.ones(2, 4, dtype=torch.long), max_new_tokens=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16, torch.bool])
def test_input_ids_of_a_non_index_dtype(model, dtype):
    # The check both backends share (runtime.decode.check_prompt): without it the embedding
    # raised a bare RuntimeError about 'indices' that did not name input_ids.
    sm = rewrite.apply(model, "layerskip", exit_layer=2)
    pattern = rf"input_ids: dtype {dtype} is invalid; allowed: .*torch.int64 .*torch.int32"
    with pytest.raises(ValueError, match=pattern):
        sm.generate(torch.ones(1, 4, dtype=dtype), max_new_tokens=3)


def test_input_ids_int32_decodes_like_int64(model):
    sm = rewrite.apply(model, "layerskip", exit_layer=2)
    ids = torch.tensor([[1, 2, 3, 4]])
    out = sm.generate(ids.int(), max_new_tokens=6)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), sm.generate(ids, max_new_tokens=6))


def test_prompt_longer_than_the_cache(model):
    sm = rewrite.apply(model, "layerskip", exit_layer=2, max_cache_len=16)
    with pytest.raises(ValueError, match=r"max_cache_len: .*need 32 cache positions.*is 16"):
        sm.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=5)


def test_bad_max_cache_len(model):
    with pytest.raises(ValueError, match=r"max_cache_len: 0 is invalid; allowed: an integer >= 2"):
        rewrite.apply(model, "autoregressive", max_cache_len=0)


def test_right_padding_is_refused(model):
    sm = rewrite.apply(model, "autoregressive")
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask: row 0 is padded on the right .*left"):
        sm.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0]]), max_new_tokens=2)
    out = sm.generate(ids, attention_mask=torch.tensor([[0, 1, 1, 1]]), max_new_tokens=2)
    assert out.shape == (1, 6)  # left padding decodes (the batched path)


def test_bad_max_new_tokens(model):
    sm = rewrite.apply(model, "autoregressive")
    with pytest.raises(ValueError, match=r"max_new_tokens: 0 is invalid; allowed: int >= 1"):
        sm.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=0)


def test_token_ids_out_of_vocabulary(model):
    sm = rewrite.apply(model, "autoregressive")
    with pytest.raises(ValueError, match=r"input_ids: token ids must lie in 0\.\.127"):
        sm.generate(torch.tensor([[1, 500]]), max_new_tokens=2)


def test_bad_temperature(model):
    sm = rewrite.apply(model, "layerskip", exit_layer=2)
    with pytest.raises(ValueError, match="temperature"):
        sm.generate(torch.ones(1, 4, dtype=torch.long), do_sample=True, temperature=-1.0)


def test_apply_never_mutates_the_model(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    sm = rewrite.apply(model, "layerskip", exit_layer=2)
    sm.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=8)
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
