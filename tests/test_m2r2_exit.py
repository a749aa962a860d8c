"""M2R2's ARLA dynamic early exit (``m2r2_exit``, sec. 2.3.1): stages, cache completeness,
never-exit identity with greedy, routers' training, and parts shared with ``m2r2``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.bench.agreement import teacher_forced_agreement
from leapfx.passes.accelerator import accelerator_of
from leapfx.recipes.table import default_exit_gates
from leapfx.runtime.cache import cache_for
from leapfx.runtime.masks import masks_for
from leapfx.runtime.runner import StageRunner
from tests.conftest import examples, tiny_model
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_lossless import _prompt, model_specs
from tests.test_m2r2 import _randomize


def test_default_gates_are_the_quarter_points():
    assert default_exit_gates(16) == (4, 8, 12)
    assert default_exit_gates(4) == (1, 2, 3)
    assert default_exit_gates(2) == (1,)


def test_exit_stages_and_options():
    model = tiny_model("llama", layers=8)
    sm = rewrite.apply(model, "m2r2_exit")
    assert sm.options.gates == (2, 4, 6)
    assert sorted(sm.stages.modules) == [
        "full", "gate_1", "gate_2", "gate_3", "slow_0", "slow_1", "slow_2", "slow_3", "tail",
    ]  # fmt: skip
    for bad, match in [({"gates": (3, 2)}, "gates"), ({"gates": (8,)}, "gates"),
                       ({"threshold": -1}, "threshold"), ({"rank": 0}, "rank")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            rewrite.apply(model, "m2r2_exit", **bad)


@settings(max_examples=examples(60, 240))
@given(spec=model_specs(), data=st.data())
def test_never_exit_is_token_identical_to_greedy(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    threshold = data.draw(st.floats(1.0, 10.0, exclude_min=True), label="threshold")
    sm = rewrite.apply(model, "m2r2_exit", threshold=threshold)
    _randomize(sm.graph_module, seed=data.draw(st.integers(0, 99), label="seed"))
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    m = sm.last_metrics
    assert m.avg_layers == spec["layers"] and m.draft_calls == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_lazy_fill_keeps_every_read_slot_complete(arch, monkeypatch):
    """The lazy KV fill: whenever a stage reads a layer (a gate's fast stream reads the slow
    keys of its interval before its position; a slow segment its own layers), the layer holds
    every earlier position, and after decoding every written slot equals a full forward's.
    Some fills wait for several tokens (a run of exits) before a deeper pass batches them."""
    model = tiny_model(arch, layers=6, sliding_window=5 if arch == "qwen2" else None)
    sm = rewrite.apply(model, "m2r2_exit", threshold=0.5)
    _randomize(sm.graph_module, scale=0.5)
    edges = (0, *sm.options.gates, 6)
    seen = {"lag": 0}
    real = StageRunner.rows

    def rows(self, name, start, length, **kw):
        lengths = self.cache.lengths
        if name.startswith("gate_"):  # reads layers E_{j-1}..E_j - 1 at positions < start
            j = int(name.split("_")[1])
            for layer in range(edges[j - 1], edges[j]):
                assert lengths[layer] >= start, (name, layer, lengths, start)
            seen["lag"] = max(seen["lag"], start - min(lengths))
        elif name.startswith("slow_"):  # appends rows start.. to every layer it runs
            j = int(name.split("_")[1])
            for layer in range(edges[j], edges[j + 1]):
                assert lengths[layer] == start, (name, layer, lengths, start)
        return real(self, name, start, length, **kw)

    monkeypatch.setattr(StageRunner, "rows", rows)
    prompt = torch.tensor([[3, 17, 9, 4]])
    out = sm.generate(prompt, max_new_tokens=24)
    hist = sm.last_metrics.exit_histogram
    assert len(hist) > 1 and min(hist) < 6, hist  # tokens exited at several depths
    assert seen["lag"] > 1, seen  # a fill waited past the next token
    cache = sm._cache
    n = out.shape[1] - 1
    ref = cache_for(model, 64)
    masks = masks_for(
        model.config._attn_implementation, ["full_attention", "sliding_attention"], 0, n,
        window=getattr(model.config, "sliding_window", None), dtype=torch.float32, device="cpu",
    )  # fmt: skip
    with torch.inference_mode():
        sm.stages["full"](out[:, :n], torch.arange(n)[None], masks, ref)
    for layer in range(6):
        m = cache.lengths[layer]
        torch.testing.assert_close(cache.keys[layer][:, :, :m], ref.keys[layer][:, :, :m])
        torch.testing.assert_close(cache.values[layer][:, :, :m], ref.values[layer][:, :, :m])
    assert cache.lengths[0] == n  # the first segment runs for every token


def test_routers_train_after_the_adapters_and_parts_serve_both_recipes(tmp_path):
    model = tiny_model("llama", layers=4, vocab=64)
    sm = rewrite.apply(model, "m2r2_exit")
    tokens = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(0))
    result = sm.fit(tokens, steps=4, router_steps=5, batch_size=2, seq_len=16, lr=1e-2,
                    progress=False)  # fmt: skip
    assert len(result.router_losses) == 5
    acc = accelerator_of(sm.graph_module)
    assert sorted(acc.routers) == ["1", "2", "3"]
    sm.save_parts(tmp_path / "parts")
    again = rewrite.apply(model, "m2r2_exit", parts=tmp_path / "parts", threshold=0.3)
    assert again.options.gates == (1, 2, 3)
    for k, v in accelerator_of(again.graph_module).state_dict().items():
        assert torch.equal(v, acc.state_dict()[k])
    spec = rewrite.apply(model, "m2r2", parts=tmp_path / "parts")  # the first interval
    assert spec.options.fast_layers == 1
    assert torch.equal(accelerator_of(spec.graph_module).layers["0"].up, acc.layers["0"].up)
    with pytest.raises(ValueError, match="gates"):
        rewrite.apply(model, "m2r2_exit", parts=tmp_path / "parts", gates=(2,))
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[7, 8]])]
    greedy = [hf_greedy(model, p, 8) for p in prompts]
    res = teacher_forced_agreement(again, prompts, greedy)
    assert res.positions == 16 and 1 <= res.avg_layers <= 4


def test_bench_m2r2_rows_and_threshold_curve(tmp_path, capsys):
    from leapfx.bench.harness import BenchConfig, run_bench
    from leapfx.cli import main
    from leapfx.models import load_model
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    tiny_model("llama", layers=4, vocab=len(tok), eos=tok.eos_token_id).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok = load_model(tmp_path)
    prompts = [torch.tensor([tok("class A:\n    def")["input_ids"]])]
    config = BenchConfig(recipe="m2r2", exit_layer=2, num_speculations=3, max_new_tokens=10,
                         repeats=1)  # fmt: skip
    by = {r.system: r for r in run_bench(model, prompts, config, progress=False)}
    assert list(by)[-4:] == ["leapfx_layerskip", "leapfx_kangaroo", "leapfx_m2r2",
                             "leapfx_m2r2_exit"]  # fmt: skip
    assert by["leapfx_m2r2"].identical_to_greedy and len(by["leapfx_m2r2"].ctar) == 3
    assert "draft_cost" in by["leapfx_m2r2"].extra
    ex = by["leapfx_m2r2_exit"]
    assert ex.agreement is not None and 1 <= ex.avg_layers <= 4
    code = main([
        "bench", "--model", str(tmp_path), "--prompts", "1", "--prompt-tokens", "8",
        "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--exit-layer", "2",
        "--recipe", "m2r2", "--sweep-threshold", "--sweep-thresholds", "0.3,2",
        "--sweep-exit-layers", "1,2", "--plot", str(tmp_path / "curve.png"),
    ])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "tau=2" in out and "E=1" in out
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_exit_gates_run_only_the_deciding_gates(monkeypatch):
    model = tiny_model("llama", layers=4)
    for bad in [(5,), (2, 1), (), (1, 1)]:
        with pytest.raises(ValueError, match="exit_gates"):
            rewrite.apply(model, "m2r2_exit", exit_gates=bad)
    sm = rewrite.apply(model, "m2r2_exit", threshold=0.5, exit_gates=(2,))
    assert sm.options.gates == (1, 2, 3) and sm.options.exit_gates == (2,)
    _randomize(sm.graph_module, scale=0.5)
    called = []
    real = StageRunner.rows

    def rows(self, name, *args, **kw):
        called.append(name)
        return real(self, name, *args, **kw)

    monkeypatch.setattr(StageRunner, "rows", rows)
    sm.generate(torch.arange(1, 7)[None], max_new_tokens=12)
    gates = {n for n in called if n.startswith("gate_")}
    assert gates == {"gate_2"}  # gate_j ends at E_j: only E = 2 decides
    exits = sm.last_metrics.draft_calls
    assert 0 < exits and sm.last_metrics.avg_layers < 4  # it exited, at layer 2


def test_exit_gates_are_recorded_in_the_parts(tmp_path):
    """Parts saved with ``exit_gates`` decode with them (what ``train-m2r2 --exit-gates``
    records); ``apply(..., exit_gates=)`` overrides, and parts without the entry decide at every
    gate."""
    model = tiny_model("llama", layers=4)
    rewrite.apply(model, "m2r2_exit", exit_gates=(2,)).save_parts(tmp_path / "two")
    rewrite.apply(model, "m2r2_exit").save_parts(tmp_path / "all")
    assert rewrite.apply(model, "m2r2_exit", parts=tmp_path / "two").options.exit_gates == (2,)
    again = rewrite.apply(model, "m2r2_exit", parts=tmp_path / "two", exit_gates=(1, 3))
    assert again.options.exit_gates == (1, 3)
    assert rewrite.apply(model, "m2r2_exit", parts=tmp_path / "all").options.exit_gates == (1, 2, 3)
