"""partition(): golden graph text per recipe, and stage numerics against the full graph."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from leapfx import rewrite
from leapfx.modules.hf import cache_kwarg
from leapfx.passes.capture import decoder_pieces
from leapfx.runtime.cache import cache_for
from leapfx.runtime.masks import masks_for
from tests.conftest import tiny_model

GOLDEN = Path(__file__).parent / "golden"


def _check_golden(name: str, text: str) -> None:
    # Nodes that call HF modules pass the KV cache under HF's keyword, which transformers 5.24
    # renamed (past_key_values -> cache): the files spell it the old way, whatever is installed.
    # test_cache_keyword_matches_each_module checks the name each node uses.
    text = re.sub(r"\bcache = cache\b", "past_key_values = cache", text)
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("LEAPFX_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with LEAPFX_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"graph text of {name} changed; see {path}"


@pytest.mark.parametrize(
    ("recipe", "options"),
    [
        ("layerskip", {"exit_layer": 2}),
        ("early_exit", {"exit_layer": 1}),
        ("autoregressive", {}),
        ("lookup", {}),  # the full stage alone: drafting is on the host
    ],
)
def test_golden_stage_text(recipe, options):
    sm = rewrite.apply(tiny_model("llama", layers=4), recipe, **options)
    _check_golden(f"{recipe}_llama4", sm.stages.code())


def test_golden_sliding_window_masks():
    sm = rewrite.apply(tiny_model("qwen2", layers=4, sliding_window=8), "layerskip", exit_layer=1)
    _check_golden("layerskip_qwen2_sliding", sm.stages.code())


def _masks(model, start, n):
    pieces = decoder_pieces(model)
    return masks_for("sdpa", pieces.attn_kinds, start, n, window=pieces.sliding_window,
                     dtype=torch.float32, device="cpu")  # fmt: skip


def test_draft_and_verify_stages_reproduce_the_full_model():
    model = tiny_model("llama", layers=5, seed=4)
    stages = rewrite.apply(model, "layerskip", exit_layer=2).stages
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
        cache = cache_for(model, 16)
        # draft runs the prefix 0..6 through the lower layers (the exit-query cache) ...
        d = stages["draft"](
            input_ids=ids[:, :7], position_ids=torch.arange(7)[None],
            masks=_masks(model, 0, 7), cache=cache,
        )  # fmt: skip
        torch.testing.assert_close(d["hidden"], hf.hidden_states[2][:, :7])
        assert cache.lengths == [7, 7, 0, 0, 0]
        # ... and verify runs lower layers for 7..9 and the remainder on all of 0..9.
        logits = stages["verify"](
            input_ids=ids[:, 7:], position_ids=torch.arange(7, 10)[None],
            masks=_masks(model, 7, 3), exit_hidden=d["hidden"],
            remainder_position_ids=torch.arange(10)[None],
            remainder_masks=_masks(model, 0, 10), cache=cache,
        )["logits"]  # fmt: skip
    torch.testing.assert_close(logits, hf.logits, rtol=1e-5, atol=1e-5)
    assert cache.lengths == [10] * 5


def test_stages_share_weights_with_the_model():
    model = tiny_model("llama", layers=4)
    stages = rewrite.apply(model, "layerskip", exit_layer=2).stages
    owned = {p.data_ptr() for p in model.parameters()}
    for gm in stages.modules.values():
        assert all(p.data_ptr() in owned for p in gm.parameters())
        assert gm.get_submodule("leapfx_fused.layer_0").layer is model.model.layers[0]


def _cache_kwargs_by_module(gm) -> list[tuple[str, str, str]]:
    """(node, keyword, the module's keyword) for every call_module node given the cache."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        for key, value in node.kwargs.items():
            if getattr(value, "op", None) == "placeholder" and value.name == "cache":
                out.append((node.name, key, cache_kwarg(gm.get_submodule(node.target))))
    return out


@pytest.mark.parametrize(
    ("recipe", "options"),
    [
        ("layerskip", {"exit_layer": 2}),
        ("layerskip", {"exit_layer": 2, "fuse_layers": False}),
        ("kangaroo", {"exit_layer": 2}),
        ("eagle", {}),
        ("eagle", {"fuse_layers": False}),
        ("specee", {"drafter": "exit_head", "exit_layer": 1}),
        ("specee", {"drafter": "exit_head", "exit_layer": 1, "fuse_layers": False}),
        ("m2r2", {"fast_layers": 2}),
    ],
)
def test_cache_keyword_matches_each_module(recipe, options):
    """Every node hands the KV cache to its module under the keyword that module's forward
    names (HF's changed in transformers 5.24; leapfx's own modules keep past_key_values), so
    decoding raises no FutureWarning from HF's renaming shim, and matches the HF model."""
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, recipe, **options)
    seen = []
    for gm in (sm.graph_module, *sm.stages.modules.values()):
        seen += _cache_kwargs_by_module(gm)
    assert seen, "no node was given the cache"
    assert [(n, k) for n, k, _ in seen] == [(n, want) for n, _, want in seen]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = sm.generate(ids, max_new_tokens=6)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.tolist() == want.tolist()


def test_moe_cache_keyword_matches_each_module():
    """The same for an MoE model's split layers, fused and not."""
    from tests.conftest import tiny_moe_model

    model = tiny_moe_model("olmoe", layers=3, experts=4)
    for fuse in (True, False):
        sm = rewrite.apply(model, "layerskip", exit_layer=1, fuse_layers=fuse)
        seen = []
        for gm in (sm.graph_module, *sm.stages.modules.values()):
            seen += _cache_kwargs_by_module(gm)
        assert seen and [k for _, k, _ in seen] == [want for *_, want in seen]
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            sm.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4)
