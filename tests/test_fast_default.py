"""``rewrite.apply``'s defaults (``leapfx.rewrite.defaults``): the CPU kernels where they run
(auto), a clean fallback where they cannot be built, and a shipped model's tuned options.

The kernels are built on first use (CI has a compiler, see test_cpu_kernels.py); the missing
compiler is simulated.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from conftest import tiny_model
from greedy_check import check_random_prompts

from leapfx import rewrite
from leapfx.kernels import cpu
from leapfx.modules.kernel_layers import KernelDecoderLayer, KernelLinear
from leapfx.rewrite.defaults import DEFAULTS_FILE, read_defaults

# Every recipe, in a lossless setting where it has a lossy one (m2r2_exit never exits above a
# threshold of 1; specee verified), so each is checked against HF greedy.
RECIPES = {
    "autoregressive": {},
    "early_exit": {"exit_layer": 2},
    "layerskip": {"exit_layer": 2, "num_speculations": 3},
    "kangaroo": {"exit_layer": 2, "confidence_threshold": 0.0},
    "eagle": {},
    "specee": {"exit_layer": 2, "verify": True},
    "m2r2": {},
    "m2r2_exit": {"threshold": 2.0},
    "lookup": {},
    "auto": {},
    "swift": {"skip_layers": (1, 2)},
    "qspec": {"num_speculations": 3},
}
LOSSY = {"early_exit"}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu.available(), "the leapfx_cpu kernels did not build (see the logged warning)"


def kernel_modules(sm) -> list:
    kinds = (KernelDecoderLayer, KernelLinear)
    return [m for st in sm._executors.values() for m in st.modules() if isinstance(m, kinds)]


def test_every_recipe_is_registered_here():
    assert set(RECIPES) == set(rewrite.recipes())


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_default_apply_runs_the_kernels_on_a_float32_cpu_model(recipe, caplog):
    model = tiny_model("llama", layers=4)
    with caplog.at_level(logging.INFO, logger="leapfx.rewrite"):
        sm = rewrite.apply(model, recipe, **RECIPES[recipe])
    assert sm.backend == "eager" and sm.cpu_kernels and kernel_modules(sm)
    said = [r.message for r in caplog.records if "cpu_kernels=" in r.message]
    assert said == [f"{recipe}: cpu_kernels=True (auto: a float32 model on a CPU)"]
    if recipe in LOSSY:
        sm.generate(torch.tensor([[3, 5, 7]]), max_new_tokens=8)
    else:
        check_random_prompts(model, sm, (1, 7), 24, seed=3)
    assert sm.last_metrics.cpu_kernels is True
    assert sm.last_metrics.as_dict()["cpu_kernels"] is True


def test_false_turns_them_off_and_records_it():
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, cpu_kernels=False)
    assert not sm.cpu_kernels and sm._executors is None
    check_random_prompts(model, sm, (5,), 16, seed=0)
    assert sm.last_metrics.cpu_kernels is False


def test_unsupported_dtype_is_off_by_default_and_refused_when_forced():
    model = tiny_model("llama", layers=2, dtype=torch.bfloat16)
    sm = rewrite.apply(model, "layerskip", exit_layer=1)  # auto: never an error
    assert not sm.cpu_kernels
    sm.generate(torch.tensor([[3, 5, 7]]), max_new_tokens=4)
    assert sm.last_metrics.cpu_kernels is False
    with pytest.raises(ValueError, match=r"cpu_kernels: True .*bfloat16.*allowed there: False or"):
        rewrite.apply(model, "layerskip", exit_layer=1, cpu_kernels=True)


def test_without_a_build_the_default_falls_back_to_torch(monkeypatch):
    model = tiny_model("llama", layers=4)
    monkeypatch.setattr(cpu, "available", lambda: False)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3)
    assert not sm.cpu_kernels
    check_random_prompts(model, sm, (1, 6), 24, seed=1)
    assert sm.last_metrics.cpu_kernels is False
    with pytest.raises(ValueError, match="cpu_kernels: True but the leapfx_cpu kernels did not"):
        rewrite.apply(model, "layerskip", exit_layer=2, cpu_kernels=True)


@pytest.fixture
def fresh_tool_check():
    cpu.missing_tools.cache_clear()
    cpu._warn_missing_tools.cache_clear()
    yield
    cpu.missing_tools.cache_clear()
    cpu._warn_missing_tools.cache_clear()


def test_a_missing_compiler_gives_one_warning_naming_it(monkeypatch, caplog, fresh_tool_check):
    from torch.utils import cpp_extension

    def load(**kwargs):
        raise AssertionError("no build is attempted without a compiler")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpu, "_built", lambda name: False)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    monkeypatch.setenv("CXX", "g++-missing")
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        for stem in ("probe_a", "probe_b", "probe_a"):  # every extension: one warning in all
            assert cpu.load_extension(stem, cpu.SOURCE, "using torch.matmul") is False
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert "no C++ compiler ('g++-missing' is not on PATH" in warned[0]
    assert "torch's path instead" in warned[0]


def test_fit_trains_on_plain_stages_and_repacks_the_kernels():
    # The EAGLE head's fc is a KernelLinear on a packed copy: after fit it holds the trained
    # weights, not the initial ones.
    model = tiny_model("llama", layers=3, seed=5)
    tokens = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(0))
    sm = rewrite.apply(model, "eagle", max_draft_tokens=3)
    assert sm.cpu_kernels
    sm.fit(tokens, steps=2, batch_size=2, seq_len=16, lr=1e-1, progress=False)
    assert sm.cpu_kernels
    fc = sm.graph_module.get_submodule("eagle_head.fc")
    packed = [m for m in kernel_modules(sm) if isinstance(m, KernelLinear)]
    want = cpu.pack_weight(fc.weight.detach())
    assert any(torch.equal(m.weight_packed, want) for m in packed)
    check_random_prompts(model, sm, (4,), 16, seed=2)


def test_a_models_leapfx_defaults_fill_unset_options(tmp_path, caplog):
    model = tiny_model("llama", layers=4)
    model.save_pretrained(tmp_path)
    recipes = {"layerskip": {"exit_layer": 3, "num_speculations": 2}}
    (tmp_path / DEFAULTS_FILE).write_text(json.dumps({"recipes": recipes}))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with caplog.at_level(logging.INFO, logger="leapfx.rewrite"):
        sm = rewrite.apply(loaded, "layerskip")
    assert (sm.options.exit_layer, sm.options.num_speculations) == (3, 2)
    assert "layerskip: exit_layer=3, num_speculations=2 from" in caplog.text
    assert (
        rewrite.apply(loaded, "layerskip", exit_layer=1).options
        == rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=2).options
    )  # a given option wins; the others still come from the file
    assert rewrite.apply(loaded, "early_exit").options.exit_layer == 1  # no entry: the recipe's
    assert rewrite.apply(model, "layerskip").options.exit_layer == 1  # no folder: no file


def test_a_malformed_defaults_file_is_refused_naming_it(tmp_path):
    model = tiny_model("llama", layers=2)
    model.save_pretrained(tmp_path)
    (tmp_path / DEFAULTS_FILE).write_text(json.dumps({"recipes": {"layerskip": 6}}))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=f"{DEFAULTS_FILE}: 'recipes' must map recipe names"):
        rewrite.apply(loaded, "layerskip")


def test_the_reference_model_ships_the_benchs_setting():
    from leapfx.models import REFERENCE_MODEL

    shipped = read_defaults(REFERENCE_MODEL / DEFAULTS_FILE)
    assert shipped["recipes"]["layerskip"] == {"exit_layer": 6, "num_speculations": 4}
    assert shipped["bench"]["layerskip_dynamic_threshold"] == 0.5
