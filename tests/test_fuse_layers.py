"""FuseDecoderLayers: bitwise-identical layers without module dispatch, per architecture."""

from __future__ import annotations

import pytest
import torch

from leapfx.modules.fused import FusedDecoderLayer
from leapfx.passes.capture import capture, decoder_pieces
from leapfx.passes.fuse_layers import FuseDecoderLayers
from leapfx.runtime.cache import cache_for
from leapfx.runtime.masks import masks_for
from tests.conftest import tiny_model

FUSED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma")


def _decode(model, gm, ids, attn):
    """Prefill 7 tokens, then 3 one-token steps and one 3-token chunk (the verify shape)."""
    pieces = decoder_pieces(model)
    cache = cache_for(model, 32)
    outs, start = [], 0
    for n in (7, 1, 1, 1, 3):
        masks = masks_for(attn, pieces.attn_kinds, start, n, window=pieces.sliding_window,
                          dtype=torch.float32, device="cpu")  # fmt: skip
        pos = torch.arange(start, start + n)[None]
        outs.append(gm(ids[:, start : start + n], pos, masks, cache)["logits"])
        start += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("arch", FUSED_ARCHS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fused_layers_are_bitwise_identical(arch, attn):
    model = tiny_model(arch, layers=3, attn=attn, sliding_window=5, kv_heads=2)
    ids = torch.randint(0, 128, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _decode(model, capture(model), ids, attn)
        gm = capture(model)
        result = FuseDecoderLayers().run(gm)
        gm.graph.lint()
        gm.recompile()
        got = _decode(model, gm, ids, attn)
    assert result.matches == 3 and result.modified
    assert torch.equal(got, ref)
    fused = gm.get_submodule("leapfx_fused.layer_1")
    assert isinstance(fused, FusedDecoderLayer) and fused.layer is model.model.layers[1]


def test_phi3_is_not_fused():
    gm = capture(tiny_model("phi3", layers=2))
    result = FuseDecoderLayers().run(gm)
    assert result.matches == 0 and not result.modified


def test_fusing_twice_does_not_match():
    gm = capture(tiny_model("llama", layers=2))
    assert FuseDecoderLayers().run(gm).matches == 2
    assert FuseDecoderLayers().run(gm).matches == 0


def test_fused_layers_share_weights():
    model = tiny_model("llama", layers=2)
    gm = capture(model)
    FuseDecoderLayers().run(gm)
    n_model = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in gm.parameters()) == n_model
