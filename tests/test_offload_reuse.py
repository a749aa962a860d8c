"""The learned eviction order (``OffloadOptions(policy="reuse")``): the probe's fit, its file,
its checks, and what the runtime does with it. Decoding with it stays token-identical to
resident decoding (tests/test_offload.py draws it among the policies)."""

from __future__ import annotations

import pytest
import torch

from leapfx import rewrite
from leapfx.offload import OffloadOptions, ReuseProbe, fit_reuse_probe
from leapfx.offload.reuse import fit_layer, reuse_targets
from leapfx.train.reuse_probe import evaluate_reuse_probe
from tests.conftest import tiny_moe_model
from tests.test_offload import random_probe


def test_reuse_targets_look_ahead_within_a_window():
    # one window of 4 tokens, top-1 of 3 experts: 0, 1, 2, 0
    top = torch.tensor([[0], [1], [2], [0]])
    soon = reuse_targets(top, 3, horizon=2, window=4)
    assert soon.tolist() == [[0, 1, 1], [1, 0, 1], [1, 0, 0], [0, 0, 0]]
    # two windows of 2: nothing looks past its own window
    soon = reuse_targets(top, 3, horizon=2, window=2)
    assert soon.tolist() == [[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]


def test_fit_layer_learns_a_linear_rule_with_the_standardisation_folded_in():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 6, generator=g) * torch.tensor([1.0, 5.0, 0.1, 2.0, 1.0, 1.0]) + 3.0
    soon = torch.stack([x[:, 1] > 3.0, x[:, 2] < 3.0, x[:, 0] + x[:, 3] > 6.0], 1).float()
    weight, bias, loss = fit_layer(x, soon, steps=300, lr=5e-2)
    assert weight.shape == (3, 6) and bias.shape == (3,)
    logits = x @ weight.t() + bias  # the raw inputs: the folding must be right
    accuracy = ((logits > 0).float() == soon).float().mean(0)
    assert (accuracy > 0.95).all(), accuracy
    assert loss < 0.2


def test_slot_cache_evicts_the_lowest_score_and_breaks_ties_by_recency():
    from leapfx.offload import SlotCache

    cache = SlotCache(3, "reuse")
    for expert in (0, 1, 2):
        cache.release([cache.demand_one(expert).expert])
    assert cache.demand_one(3).evicted == 0  # no scores yet: LRU
    cache.release([3])
    cache.scores = [0.0, 0.5, 0.9, -1.0, 0.0]
    assert cache.demand_one(4).evicted == 3  # the lowest score, though the most recent
    cache.release([4])
    cache.scores = [0.0, 0.5, 0.5, 0.0, 0.5]
    assert cache.prefetch(0).evicted == 1  # 1, 2 and 4 tie: 1 is the least recent


def test_probe_file_round_trip_and_refusals(tmp_path):
    model = tiny_moe_model("olmoe", layers=2, experts=4)
    probe = random_probe(model, seed=3)
    probe.info = {"note": "test"}
    path = probe.save(tmp_path / "sub" / "probe.safetensors")
    assert sorted(p.name for p in path.parent.iterdir()) == ["probe.safetensors"]  # no temp
    back = ReuseProbe.load(path)
    assert back.layers == probe.layers and back.horizon == 2 and back.info == {"note": "test"}
    assert torch.equal(back.weight, probe.weight) and torch.equal(back.bias, probe.bias)
    with pytest.raises(ValueError, match="is not a file"):
        ReuseProbe.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="is not a reuse probe"):
        ReuseProbe.load(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="do not match"):
        ReuseProbe([0, 1], torch.zeros(2, 4, 8), torch.zeros(3, 4), horizon=1)
    other = tiny_moe_model("olmoe", layers=2, experts=6)
    with pytest.raises(ValueError, match="fitted for MoE layers .* 4 experts.* 6 experts"):
        rewrite.apply(other, "autoregressive",
                      offload=OffloadOptions(policy="reuse", reuse_probe=path))  # fmt: skip


def test_the_runtime_scores_each_layer_from_its_token_before_placing_experts():
    model = tiny_moe_model("olmoe", layers=2, experts=4, seed=1)
    probe = random_probe(model, seed=5)
    options = OffloadOptions(slots=2, policy="reuse", reuse_probe=probe)
    sm = rewrite.apply(model, "autoregressive", offload=options)
    seen = {}
    run = sm.offload._run

    def spy(layer, module, hidden, top_k_index, top_k_weights):
        out = run(layer, module, hidden, top_k_index, top_k_weights)
        seen[layer] = (hidden[-1].clone(), list(sm.offload.caches[layer].scores))
        return out

    sm.offload._run = spy
    try:
        sm.generate(torch.tensor([[3, 1, 4, 1, 5]]), max_new_tokens=3)
    finally:
        sm.offload.close()
    assert sorted(seen) == probe.layers
    for layer, (x, scores) in seen.items():
        weight, bias = probe.for_layer(layer)
        assert scores == pytest.approx((weight @ x + bias).tolist(), rel=1e-5, abs=1e-5)


def test_a_fitted_probe_on_a_tiny_model_and_its_held_out_hit_rates():
    torch.manual_seed(0)
    model = tiny_moe_model("qwen2_moe", layers=3, experts=6, top_k=2, vocab=32,
                           dense_layers=(1,), seed=2)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 32, (6, 40), generator=g)
    probe = fit_reuse_probe(model, windows, horizon=3, steps=50)
    assert (
        probe.layers == [0, 2]
        and probe.weight.shape == (2, 6, model.config.hidden_size)
        and probe.horizon == 3
    )
    assert probe.info["tokens"] == 6 * (40 - 3)
    held = torch.randint(0, 32, (3, 40), generator=g)
    report = evaluate_reuse_probe(probe, model, held, slots=(0.5,))["0.5"]
    assert report["slots"] == 3
    # Belady's eviction bounds every demand-only order, the learned one and LRU included
    assert report["optimal_hit_rate"] >= report["reuse_hit_rate"] - 1e-9
    assert report["optimal_hit_rate"] >= report["lru_hit_rate"] - 1e-9
    with pytest.raises(ValueError, match="horizon"):
        fit_reuse_probe(model, windows, horizon=0)
    with pytest.raises(ValueError, match="windows: lengths"):
        fit_reuse_probe(model, [windows[0], windows[1][:10]], horizon=3)


def test_train_reuse_probe_command(tmp_path, capsys):
    import json

    from leapfx.cli import main
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    ckpt = tmp_path / "ckpt"
    tiny_moe_model("olmoe", layers=2, experts=4, vocab=len(tok)).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    argv = ["train-reuse-probe", "--model", str(ckpt), "--tokens", "512",
            "--held-out-tokens", "256", "--steps", "5", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out[out.index("{") :])
    path = ckpt / "reuse_probe.safetensors"  # the default: beside the model
    assert report["path"] == str(path) and report["layers"] == [0, 1]
    assert set(report["held_out"]) == {"0.5", "0.25"}
    assert ReuseProbe.load(path).info["held_out"] == report["held_out"]
    assert main([*argv, "--horizon", "0"]) == 2
    assert "--horizon: 0 is invalid" in capsys.readouterr().err


def test_bench_refuses_a_missing_reuse_probe(tmp_path, capsys):
    from leapfx.cli import main

    missing = str(tmp_path / "missing.safetensors")
    argv = ["bench", "--model", "moe-reference", "--offload-slots", "0.5",
            "--offload-reuse-probe", missing]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--offload-reuse-probe: {missing!r} is not a file; allowed: auto, none" in err


def test_a_float32_probe_serves_a_bfloat16_model_and_stays_unchanged():
    model = tiny_moe_model("qwen3_moe", layers=2, experts=4, seed=3, dtype=torch.bfloat16)
    probe = random_probe(model, seed=1)
    weight = probe.weight.clone()
    prompt = torch.tensor([[7, 2, 9, 4]])
    resident = rewrite.apply(model, "autoregressive").generate(prompt, max_new_tokens=8)
    options = OffloadOptions(slots=1, policy="reuse", reuse_probe=probe, poison=True)
    sm = rewrite.apply(model, "autoregressive", offload=options)
    try:
        assert torch.equal(sm.generate(prompt, max_new_tokens=8), resident)
    finally:
        sm.offload.close()
    assert probe.weight.dtype == torch.float32 and torch.equal(probe.weight, weight)
