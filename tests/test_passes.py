"""Per-pass unit tests (lint, numerics before/after, match counts, a case that must not match)
and the pass pipeline (ordering, missing prerequisites, cycles, error context, counters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from leapfx.passes.base import GraphPass, PassError, PassPipeline, PassResult
from leapfx.passes.capture import ROLE, capture, decoder_pieces
from leapfx.passes.exit_head import InsertExitHead
from leapfx.runtime.masks import masks_for
from tests.conftest import tiny_model


def _inputs(model, n=9):
    pieces = decoder_pieces(model)
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(0))
    masks = masks_for("sdpa", pieces.attn_kinds, 0, n, window=None, dtype=torch.float32,
                      device="cpu")  # fmt: skip
    return ids, torch.arange(n)[None], masks


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_insert_exit_head_numerics(exit_layer):
    model = tiny_model("llama", layers=4)
    ids, pos, masks = _inputs(model)
    gm = capture(model)
    with torch.no_grad():
        before = gm(ids, pos, masks, None)["logits"]
        result = InsertExitHead(layer=exit_layer).run(gm)
        result.graph_module.graph.lint()
        result.graph_module.recompile()
        out = result.graph_module(ids, pos, masks, None)
        hf = model(ids, output_hidden_states=True)
    assert result.modified and result.matches == 1
    assert torch.equal(out["logits"], before)  # the final output is unchanged
    # hidden_states[e] is the residual stream after e layers (index 0 = embeddings)
    assert torch.equal(out["exit_hidden"], hf.hidden_states[exit_layer])
    expected = model.lm_head(model.model.norm(hf.hidden_states[exit_layer]))
    assert torch.equal(out["exit_logits"], expected)


def test_insert_exit_head_adds_no_parameters():
    model = tiny_model("llama", layers=4)
    gm = InsertExitHead(layer=2).run(capture(model)).graph_module
    n_model = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in gm.parameters()) == n_model
    heads = [n for n in gm.graph.nodes if n.meta.get(ROLE) == "exit_head"]
    assert [n.target for n in heads] == ["lm_head"]


def test_insert_exit_head_does_not_match_twice():
    model = tiny_model("llama", layers=4)
    gm = InsertExitHead(layer=2).run(capture(model)).graph_module
    n_nodes = len(gm.graph.nodes)
    again = InsertExitHead(layer=2).run(gm)
    assert not again.modified and again.matches == 0
    assert len(again.graph_module.graph.nodes) == n_nodes
    with pytest.raises(ValueError, match="already exits at layer 2"):
        InsertExitHead(layer=1).run(gm)


@pytest.mark.parametrize("bad", [0, 4, -1])
def test_insert_exit_head_out_of_range(bad):
    gm = capture(tiny_model("llama", layers=4))
    with pytest.raises(ValueError, match=rf"exit_layer: {bad} is out of range.*1\.\.3"):
        InsertExitHead(layer=bad).run(gm)


@dataclass(frozen=True)
class _Needs(GraphPass):
    name: ClassVar[str] = "needs-b"
    requires: ClassVar[frozenset[str]] = frozenset({"b"})
    provides: ClassVar[frozenset[str]] = frozenset({"a"})

    def run(self, gm):
        gm.meta.setdefault("log", []).append(self.name)
        return PassResult(gm, modified=False)


@dataclass(frozen=True)
class _ProvidesB(GraphPass):
    name: ClassVar[str] = "provides-b"
    requires: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset({"b"})

    def run(self, gm):
        gm.meta.setdefault("log", []).append(self.name)
        return PassResult(gm, modified=False, matches=2)


@dataclass(frozen=True)
class _NeedsA(_ProvidesB):
    name: ClassVar[str] = "needs-a"
    requires: ClassVar[frozenset[str]] = frozenset({"a"})


@dataclass(frozen=True)
class _Boom(GraphPass):
    name: ClassVar[str] = "boom"

    def run(self, gm):
        raise RuntimeError("kaput")


def test_pipeline_orders_by_requirements():
    pipeline = PassPipeline([_Needs(), _ProvidesB()])
    assert [p.name for p in pipeline.passes] == ["provides-b", "needs-b"]
    gm = pipeline(capture(tiny_model("llama", layers=2)))
    assert gm.meta["log"] == ["provides-b", "needs-b"]
    assert pipeline.counters == {"provides-b": 2, "needs-b": 0}
    assert {"a", "b", "decoder-graph"} <= gm.meta["leapfx.facts"]


def test_pipeline_missing_prerequisite_fails_before_running():
    with pytest.raises(ValueError, match="'needs-b' requires 'b', which no pass"):
        PassPipeline([_Needs()])


def test_pipeline_cycle_fails_before_running():
    with pytest.raises(ValueError, match="dependency cycle"):
        PassPipeline([_Needs(), _NeedsA()])


def test_pipeline_reraises_with_passes_run_before():
    pipeline = PassPipeline([_ProvidesB(), _Boom()])
    with pytest.raises(PassError, match=r"boom\(\) failed \(passes run before it: provides-b\)"):
        pipeline(capture(tiny_model("llama", layers=2)))


def test_pipeline_lints_after_each_pass():
    @dataclass(frozen=True)
    class Breaks(GraphPass):
        name: ClassVar[str] = "breaks-graph"

        def run(self, gm):
            node = next(n for n in gm.graph.nodes if n.meta.get(ROLE) == "norm")
            node.target = "no.such.module"  # lint must catch this
            return PassResult(gm, modified=True)

    with pytest.raises(PassError, match="breaks-graph"):
        PassPipeline([Breaks()])(capture(tiny_model("llama", layers=2)))


@pytest.mark.parametrize("recipe", ["autoregressive", "eagle"])
def test_head_at_last_gives_the_last_rows_logits_and_the_rest_unchanged(recipe):
    """The prefill copy of a ``full`` stage: logits of the last position only, equal to the
    stage's; its other outputs (EAGLE's hidden states) and cache writes the stage's own."""
    from leapfx import rewrite
    from leapfx.passes.last_logits import head_at_last
    from leapfx.runtime.cache import cache_for
    from leapfx.runtime.executor import prefill_stage

    model = tiny_model("llama")
    sm = rewrite.apply(model, recipe)
    full = sm.stages.modules["target" if recipe == "eagle" else "full"]
    prefill = head_at_last(full)
    assert prefill is not None and prefill_stage(full) is prefill_stage(full)  # made once
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    outs, caches = [], []
    for stage in (full, prefill):
        cache = cache_for(model, 16, extra_layers=sm.recipe.extra_cache_layers)
        signature = stage.code.split(")")[0]
        extra = {"prev_hidden": torch.zeros(1, 1, 1)} if "prev_hidden" in signature else {}
        masks = masks_for(model.config._attn_implementation, ["full_attention"], 0, 7,
                          window=None, dtype=torch.float32, device="cpu")  # fmt: skip
        outs.append(stage(input_ids=ids, position_ids=torch.arange(7)[None], masks=masks,
                          cache=cache, **extra))  # fmt: skip
        caches.append(cache)
    assert outs[1]["logits"].shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(outs[1]["logits"], outs[0]["logits"][:, -1:])
    for name in outs[0]:
        if name != "logits":
            torch.testing.assert_close(outs[1][name], outs[0][name])
    for a, b in zip(caches[0].keys, caches[1].keys, strict=True):
        torch.testing.assert_close(a, b)


def test_head_at_last_leaves_other_heads_alone():
    """A head that is not one module call on one tensor (here soft-capped) gives None, and the
    runner then runs the stage as it is."""
    from torch import fx

    from leapfx.passes.last_logits import head_at_last
    from leapfx.runtime.executor import prefill_stage

    class Capped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 8)

        def forward(self, h):
            return {"logits": torch.tanh(self.lm_head(h))}

    gm = fx.symbolic_trace(Capped())
    assert head_at_last(gm) is None
    assert prefill_stage(gm) is gm
