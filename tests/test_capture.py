"""Capture: the layer-level graph computes exactly what the HF model computes."""

from __future__ import annotations

import pytest
import torch
import transformers

from leapfx.passes.capture import LAYER, ROLE, capture, decoder_pieces
from leapfx.runtime.cache import cache_for
from leapfx.runtime.masks import masks_for
from tests.conftest import ARCHS, tiny_model


def _run(model, gm, ids, start=0, cache=None):
    pieces = decoder_pieces(model)
    n = ids.shape[1]
    masks = masks_for(
        model.config._attn_implementation, pieces.attn_kinds, start, n,
        window=pieces.sliding_window, dtype=torch.float32, device="cpu",
    )  # fmt: skip
    pos = torch.arange(start, start + n)[None]
    return gm(ids, pos, masks, cache)["logits"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_capture_matches_hf_prefill_exactly(arch, attn):
    model = tiny_model(arch, layers=3, attn=attn, sliding_window=4)
    gm = capture(model)
    ids = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(_run(model, gm, ids), model(ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_incremental_with_cache_matches_hf(arch):
    model = tiny_model(arch, layers=3, sliding_window=4)
    gm = capture(model)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = cache_for(model, 32)
    with torch.no_grad():
        first = _run(model, gm, ids[:, :5], 0, cache)
        rest = [_run(model, gm, ids[:, t : t + 1], t, cache) for t in range(5, 12)]
        ref = model(ids).logits
    got = torch.cat([first, *rest], dim=1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert cache.lengths == [12, 12, 12]


def test_capture_annotations_and_shared_weights():
    model = tiny_model("llama", layers=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = capture(model)
    roles = [n.meta.get(ROLE) for n in gm.graph.nodes if n.op == "call_module"]
    assert roles == ["embed", "rotary", "layer", "layer", "layer", "norm", "head"]
    layers = [n.meta[LAYER] for n in gm.graph.nodes if n.meta.get(ROLE) == "layer"]
    assert layers == [0, 1, 2]
    # shared by reference, not copied
    assert gm.get_submodule("model.layers.1") is model.model.layers[1]
    assert gm.get_submodule("lm_head").weight.data_ptr() == model.lm_head.weight.data_ptr()
    # the user's model is untouched
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert type(model.model.layers[0]).__name__ == "LlamaDecoderLayer"


def test_unsupported_architecture_is_refused_with_the_list():
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(ValueError, match=r"'gpt2'.*not supported.*gemma, llama, mistral"):
        capture(model)
