"""lower(sm, backend), the stage-executor protocol and the recipes' capabilities: lowering and
export ask what a recipe declares instead of branching on its name."""

from __future__ import annotations

import pytest
import torch

from leapfx import rewrite
from leapfx.lower import BACKENDS, lower
from leapfx.lower.chain import chain_length
from leapfx.recipes.table import RECIPES
from leapfx.runtime import executor
from leapfx.runtime.capabilities import Capabilities
from leapfx.runtime.model import SpeculativeModel
from tests.conftest import tiny_model


def test_recipes_declare_what_lowering_and_export_asked_their_names_for():
    can = {name: r.capabilities for name, r in RECIPES.items()}
    assert [n for n, c in can.items() if c.has_chain] == ["layerskip"]
    assert [n for n, c in can.items() if c.split_verify] == ["layerskip"]
    assert [n for n, c in can.items() if c.layer_segments] == ["specee"]
    assert sorted(n for n, c in can.items() if not c.exportable) == [
        "m2r2_exit",
        "qspec",
        "specee",
    ]
    # some options' models refuse: swift's online search
    assert [n for n, c in can.items() if c.export_refusal_for is not None] == ["swift"]
    assert sorted(n for n, c in can.items() if not c.compiles) == [
        "m2r2",
        "m2r2_exit",
        "qspec",
        "swift",
    ]
    with pytest.raises(ValueError, match="export_refusal"):
        Capabilities(exportable=False)


def test_the_model_carries_its_recipe_capabilities_to_lowering_and_export(tmp_path):
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3)
    assert sm.recipe.capabilities is RECIPES["layerskip"].capabilities
    assert chain_length(sm) == 3
    kangaroo = rewrite.apply(model, "kangaroo", exit_layer=2)
    assert chain_length(kangaroo) == 0  # no draft chain: not declared
    specee = rewrite.apply(model, "specee", drafter="exit_head", exit_layer=1)
    with pytest.raises(ValueError, match="'specee' cannot be exported to ONNX: its per-token"):
        specee.export_onnx(tmp_path / "specee-onnx")
    assert not (tmp_path / "specee-onnx").exists()


def test_lower_switches_eager_backends_with_the_same_tokens():
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, cpu_kernels=False)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, 7), generator=gen)
    eager = sm.generate(prompt, max_new_tokens=16)
    assert lower(sm, "cpu_kernels") is sm and sm.cpu_kernels
    # the kernel stages: a draft chain, and executors that say what they provide
    assert executor.chain_length(sm._executors["draft_chain"]) == 3
    assert executor.mask_free(sm._executors["draft"]) is not None
    assert all(isinstance(s, executor.StageExecutor) for s in sm._executors.values())
    assert lower(sm, "eager") is sm and not sm.cpu_kernels
    assert torch.equal(sm.generate(prompt, max_new_tokens=16), eager)


def test_lower_refuses_unknown_backends_and_options():
    sm = rewrite.apply(tiny_model("llama", layers=2), "autoregressive")
    assert BACKENDS == ("eager", "cpu_kernels", "inductor")
    with pytest.raises(ValueError, match=r"backend: 'onnx' is invalid; allowed: 'eager'"):
        lower(sm, "onnx")
    with pytest.raises(ValueError, match="mode: backend 'eager' takes no options"):
        lower(sm, "eager", mode="max-autotune")
    m2r2 = rewrite.apply(tiny_model("llama", layers=4), "m2r2", fast_layers=2)
    with pytest.raises(ValueError, match=r"not under Inductor \(its fast stream keeps"):
        lower(m2r2, "inductor")
    swift = rewrite.apply(tiny_model("llama", layers=4), "swift")
    with pytest.raises(ValueError, match="in onnxruntime .export_onnx., not under Inductor"):
        lower(swift, "inductor")
    online = rewrite.apply(tiny_model("llama", layers=4), "swift", search="online")
    with pytest.raises(ValueError, match="'swift' cannot be exported to ONNX: search: 'online'"):
        online.export_onnx("never-written")


def test_eager_stages_provide_the_protocol_defaults():
    sm = rewrite.apply(tiny_model("llama", layers=2), "autoregressive", cpu_kernels=False)
    full = sm.stages.modules["full"]
    assert isinstance(full, executor.StageExecutor)
    assert not executor.builds_masks(full) and executor.mask_free(full) is None
    assert executor.chain_length(full) == 0 and executor.chain_length(None) == 0


def test_the_model_lowers_through_the_lower_apply_hands_it():
    # The runtime sits below lower/ and does not import it: rewrite.apply hands the model
    # leapfx.lower.lower, which compile() and use_cpu_kernels() run.
    model = tiny_model("llama", layers=2)
    sm = rewrite.apply(model, "autoregressive", cpu_kernels=False)
    calls = []

    def recording(target, backend, **options):
        calls.append((backend, options))
        return lower(target, backend, **options)

    handed = SpeculativeModel(sm.hf_model, sm.graph_module, sm.stages, sm.recipe, lower=recording)
    assert handed.use_cpu_kernels() is handed and handed.cpu_kernels
    assert handed.use_cpu_kernels(False) is handed and not handed.cpu_kernels
    assert calls == [("cpu_kernels", {}), ("eager", {})]
    bare = SpeculativeModel(sm.hf_model, sm.graph_module, sm.stages, sm.recipe)
    with pytest.raises(ValueError, match="use_cpu_kernels: this SpeculativeModel was built "):
        bare.use_cpu_kernels()
    with pytest.raises(ValueError, match="compile: this SpeculativeModel was built without"):
        bare.compile(warmup=False)
    assert lower(bare, "cpu_kernels") is bare and bare.cpu_kernels  # lower() needs no hand-off
