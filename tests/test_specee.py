"""SpecEE: predictor features, the two-level scheduler, KV validity, the recipe and its parts.

Losslessness (verify=True) and the never-exit property are hypothesis tests at the end; the
sampling distribution test follows Kangaroo's (exact HF distribution, chi-square).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.modules.hf import cache_kwarg
from leapfx.modules.specee import ExitMLP, exit_features
from leapfx.passes.predictor import InsertExitPredictors, predictors_of
from leapfx.runtime.specee import LayerScheduler
from leapfx.train.specee import offline_subset
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from, assert_sampler_draws_from, sample_counts
from tests.greedy_check import assert_greedy_equal, hf_greedy
from tests.test_kangaroo_lossless import TEMPERATURE, TOP_K, TOP_P, _exact_distribution
from tests.test_lossless import _prompt, model_specs
from tests.test_partition import _check_golden


def test_features_match_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    normed = torch.randn(1, 6, generator=g)
    weight = torch.randn(10, 6, generator=g)
    cands = torch.tensor([7, 2, 9, 0])
    p_prev = torch.softmax(torch.randn(1, 4, generator=g), -1)
    x, p = exit_features(normed, weight, cands, p_prev)
    z = torch.stack([sum(normed[0, h] * weight[c, h] for h in range(6)) for c in cands.tolist()])
    e = torch.exp(z - z.max())
    p_hand = e / e.sum()
    expected = torch.cat([z, p_hand, p_hand - p_prev[0]])
    assert x.shape == (1, 12) and torch.allclose(x[0], expected, atol=1e-5)
    assert torch.allclose(p[0], p_hand, atol=1e-6)
    x0, _ = exit_features(normed, weight, cands, None)  # the first predicted layer: D = p
    assert torch.allclose(x0[0, 8:], p_hand, atol=1e-6)


def test_exit_check_node_is_norm_subset_softmax_mlp():
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "specee")
    check = predictors_of(sm.graph_module).exits[2]
    h = torch.randn(1, 3, 32)
    cands = torch.tensor([5, 1, 8, 3])
    prob, p = check(h, cands, None)
    normed = model.model.norm(h[:, -1])
    z = normed @ model.lm_head.weight[cands].T
    x = torch.cat([z, torch.softmax(z, -1), torch.softmax(z, -1)], -1)
    assert torch.allclose(prob, check.mlp(x)[:, 0], atol=1e-6)
    assert isinstance(check.mlp, ExitMLP) and check.mlp[0].in_features == 12
    assert check.mlp[0].out_features == 512
    assert not any(
        "lm_head" in k or "norm" in k for k in predictors_of(sm.graph_module).state_dict()
    )


def test_one_mlp_per_layer_but_the_last_and_nodes_after_the_drafter():
    sm = rewrite.apply(tiny_model("llama", layers=6), "specee", exit_layer=2)
    bank = predictors_of(sm.graph_module)
    assert len(bank.exits) == 5  # L - 1
    checks = [n for n in sm.graph_module.graph.nodes if n.meta.get("leapfx.role") == "exit_check"]
    assert [n.meta["leapfx.layer"] for n in checks] == [1, 2, 3, 4]  # E-1 .. L-2
    again = InsertExitPredictors().run(sm.graph_module)
    assert again.matches == 0 and not again.modified  # idempotent


def test_golden_specee_stage_text():
    sm = rewrite.apply(tiny_model("llama", layers=4), "specee", drafter="exit_head", exit_layer=1)
    graph = f"# rewritten graph\n{sm.graph_module.code.strip()}\n\n"
    _check_golden("specee_llama4", graph + sm.stages.code())


def test_scheduler_offline_then_online_window():
    s = LayerScheduler(offline=frozenset({9, 10}), low=3, high=14, window=2, history=5)
    assert s.active() == {9, 10}
    for e in (4, 4, 5, 4):
        s.record(e)
    assert s.active() == {9, 10}  # the online level waits for 5 exits
    s.record(13)
    assert s.active() == {3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14}  # +-2, clipped to [3, 14]
    assert s.needed() == s.active() | {8}  # D needs p at the layer below each active one
    for e in (9, 9, 9, 9, 9):  # the window slides: only the last 5 exits count
        s.record(e)
    assert s.active() == {7, 8, 9, 10, 11}


def test_offline_subset_covers_the_share_of_exits():
    assert offline_subset({3: 50, 7: 30, 9: 15, 12: 5}, 0.8) == (3, 7)
    assert offline_subset({3: 50, 7: 30, 9: 15, 12: 5}, 0.81) == (3, 7, 9)
    assert offline_subset({3: 0, 4: 0}, 0.8) == ()


def _exits(sm) -> list[int]:
    return [n - 1 for n in sm.last_metrics.layers_per_token]


def test_validity_mask_hides_exactly_the_skipped_layers():
    model = tiny_model("llama", layers=6, seed=3)
    sm = rewrite.apply(model, "specee", exit_layer=2, threshold=0.0, kv_fill="mask")
    seen = {}
    from leapfx.runtime import specee as runtime

    original = runtime.SpecEEDecoder.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen["dec"] = self

    runtime.SpecEEDecoder.__init__ = spy
    try:
        prompt = torch.tensor([[3, 1, 4, 1, 5]])
        out = sm.generate(prompt, max_new_tokens=12)
    finally:
        runtime.SpecEEDecoder.__init__ = original
    dec = seen["dec"]
    exits = _exits(sm)  # the prefill's token, then one per decode step
    assert min(exits[1:]) < 5  # some tokens exited
    cache = dec.runner.cache
    n = out.shape[1] - 1  # the last token was never run
    assert cache.lengths[:6] == [n] * 6  # positions stay global in every layer
    for step, e in enumerate(exits[1:-1]):
        pos = prompt.shape[1] + step
        for layer in range(6):
            hidden = bool(dec.bias[layer, pos] == float("-inf"))
            assert hidden == (layer > e), (pos, layer, e)
    assert torch.all(dec.bias[:, : prompt.shape[1]] == 0)  # prefill: valid everywhere
    mask = dec._mask(5, n, 1, {"full_attention": None})
    assert torch.equal(mask[0, 0, 0], dec.bias[5, : n + 1])


def test_kv_fill_next_leaves_the_exact_cache_of_the_emitted_tokens():
    """Skipped layers run with the next token: the cache then equals a full forward's K/V."""
    model = tiny_model("llama", layers=5, seed=4, dtype=torch.float64)
    sm = rewrite.apply(model, "specee", exit_layer=1, threshold=0.0, kv_fill="next")
    prompt = torch.tensor([[2, 7, 1, 8]])
    out = sm.generate(prompt, max_new_tokens=10)
    assert min(_exits(sm)) < 4
    cache = sm._cache
    from transformers import DynamicCache

    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(out[:, :-1], use_cache=True, **{cache_kwarg(model): ref})
    for layer in range(5):
        n = cache.lengths[layer]
        # Positions of the last exit's skipped layers are still pending: a suffix.
        assert n <= out.shape[1] - 1
        k_ref = ref.layers[layer].keys[:, :, :n]
        assert torch.allclose(cache.keys[layer][:, :, :n], k_ref, atol=1e-10), layer


@settings(max_examples=examples(40, 160))
@given(spec=model_specs(), data=st.data())
def test_threshold_one_never_exits_and_is_greedy(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    max_new = data.draw(st.integers(1, 16), label="max_new_tokens")
    drafter = data.draw(st.sampled_from(["eagle", "exit_head", "kangaroo"]), label="drafter")
    sm = rewrite.apply(model, "specee", drafter=drafter, threshold=1.0)
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    assert set(sm.last_metrics.layers_per_token) == {spec["layers"]}


@settings(max_examples=examples(60, 240))
@given(spec=model_specs(), data=st.data())
def test_verified_specee_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    layers = spec["layers"]
    options = dict(
        drafter=data.draw(st.sampled_from(["eagle", "exit_head", "kangaroo"]), label="drafter"),
        exit_layer=data.draw(st.integers(1, layers - 1), label="exit_layer"),
        threshold=data.draw(st.sampled_from([0.0, 0.3, 0.5, 0.7]), label="threshold"),
        max_draft_tokens=data.draw(st.integers(1, 6), label="max_draft_tokens"),
        window=data.draw(st.integers(0, 2), label="window"),
        history=data.draw(st.integers(1, 5), label="history"),
        verify=True,
    )
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    sm = rewrite.apply(model, "specee", **options)
    if data.draw(st.booleans(), label="trained"):
        tokens = torch.randint(0, spec["vocab"], (64,), generator=torch.Generator().manual_seed(1))
        sm.fit(tokens, prompts=3, prompt_len=4, new_tokens=6, epochs=2, progress=False,
               draft_steps=2)  # fmt: skip
    ours = sm.generate(prompt, max_new_tokens=max_new)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, max_new), prompt.shape[1])
    m = sm.last_metrics
    assert m.new_tokens == ours.shape[1] - prompt.shape[1]
    assert len(m.layers_per_token) == m.new_tokens or m.new_tokens < len(m.layers_per_token)


@pytest.mark.parametrize("drafter", ["eagle", "exit_head", "kangaroo"])
def test_verified_specee_float64_exact_with_exits(drafter):
    model = tiny_model("qwen2", layers=6, vocab=64, dtype=torch.float64, seed=5, sliding_window=6)
    prompt = torch.tensor([[5, 9, 1, 33, 2]])
    sm = rewrite.apply(model, "specee", drafter=drafter, exit_layer=2, threshold=0.0, verify=True)
    ours = sm.generate(prompt, max_new_tokens=48)
    assert torch.equal(ours, hf_greedy(model, prompt, 48))
    m = sm.last_metrics
    assert m.verify_calls > 0 and m.drafted_tokens > m.verify_calls


def _sampled_counts(sm, prompt, exact, length: int, n: int, seed: int) -> tuple[dict, int, int]:
    return sample_counts(sm, prompt, exact, length, n, seed=seed, temperature=TEMPERATURE,
                         top_k=TOP_K, top_p=TOP_P)  # fmt: skip


def test_verified_specee_sampling_matches_target_distribution():
    vocab, length = 4, 4
    model = tiny_model("llama", layers=3, vocab=vocab, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 3, 2]])
    exact = _exact_distribution(model, prompt, vocab, length)
    # threshold 0: every pass exits at the first predicted layer (S is the whole vocabulary).
    sm = rewrite.apply(model, "specee", exit_layer=1, threshold=0.0, verify=True,
                       max_draft_tokens=2)  # fmt: skip
    n = 3000
    counts, rejections, drafted = _sampled_counts(sm, prompt, exact, length, n, 1234)
    assert 0 < rejections < drafted
    assert_sampled_from(counts, exact, n)


@settings(max_examples=examples(3, 12))
@given(spec=model_specs(), data=st.data())
def test_verified_specee_sampling_distribution_over_architectures(spec, data):
    """verify=True samples the target's distribution on every architecture and drafter.

    A 4-token vocabulary (S is all of it, so a fired predictor always passes the global check)
    and 3-token continuations keep the exact distribution small; threshold 0 or 0.5 makes
    passes exit (drafts) at the drawn layer or deeper. Thorough profile: more architectures.
    """
    vocab, length = 4, 3
    spec = dict(spec, vocab=vocab, eos=None, layers=min(spec["layers"], 4))
    model = tiny_model(**spec)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # a flat target: rejections happen
    prompt = torch.tensor([data.draw(st.lists(st.integers(0, vocab - 1), min_size=1,
                                              max_size=4), label="prompt")])  # fmt: skip
    options = dict(
        drafter=data.draw(st.sampled_from(["eagle", "exit_head", "kangaroo"]), label="drafter"),
        exit_layer=data.draw(st.integers(1, spec["layers"] - 1), label="exit_layer"),
        threshold=data.draw(st.sampled_from([0.0, 0.5]), label="threshold"),
        max_draft_tokens=data.draw(st.integers(1, 3), label="max_draft_tokens"),
    )
    sm = rewrite.apply(model, "specee", verify=True, **options)
    exact = _exact_distribution(model, prompt, vocab, length)
    assert_sampler_draws_from(
        lambda n, seed: _sampled_counts(sm, prompt, exact, length, n, seed)[0],
        exact,
        1000,
        spec["seed"],
    )


def test_lossy_teacher_forcing_counts_agreement():
    model = tiny_model("llama", layers=4, seed=2)
    prompt = torch.tensor([[1, 2, 3]])
    ref = hf_greedy(model, prompt, 12)
    sm = rewrite.apply(model, "specee", threshold=1.0)
    sm.generate(prompt, max_new_tokens=12, teacher_tokens=ref[0, 3:])
    assert sm.last_metrics.agreement == 1.0
    lossy = rewrite.apply(model, "specee", threshold=0.0)
    lossy.generate(prompt, max_new_tokens=12, teacher_tokens=ref[0, 3:])
    assert lossy.last_metrics.agreement is not None
    assert lossy.last_metrics.avg_layers < 4


def test_parts_round_trip(tmp_path):
    model = tiny_model("llama", layers=6, seed=1)
    for drafter in ("eagle", "exit_head", "kangaroo"):
        sm = rewrite.apply(model, "specee", drafter=drafter, exit_layer=2)
        tokens = torch.randint(0, 128, (256,), generator=torch.Generator().manual_seed(0))
        result = sm.fit(tokens, prompts=4, prompt_len=8, new_tokens=12, epochs=2, progress=False,
                        draft_steps=3)  # fmt: skip
        assert set(result.layers) == {1, 2, 3, 4}
        sm.save_parts(tmp_path / drafter)
        loaded = rewrite.apply(model, "specee", parts=tmp_path / drafter)
        assert loaded.options.drafter == drafter and loaded.options.exit_layer == 2
        assert loaded.options.offline_layers == result.offline_layers
        a, b = predictors_of(sm.graph_module), predictors_of(loaded.graph_module)
        for k, v in a.state_dict().items():
            assert torch.equal(v, b.state_dict()[k])
        prompt = torch.tensor([[4, 2, 8]])
        assert torch.equal(sm.generate(prompt, max_new_tokens=10),
                           loaded.generate(prompt, max_new_tokens=10))  # fmt: skip
        with pytest.raises(ValueError, match="exit_layer"):
            rewrite.apply(model, "specee", parts=tmp_path / drafter, exit_layer=3)


def test_above_early_exit_interpolates_at_equal_speed():
    """The claim is computed: specee's agreement at each early-exit point's speed."""
    from leapfx.bench.specee_sweep import CurvePoint, above_early_exit

    points = [
        CurvePoint("specee", 0.5, 0, 2.0, 0.90, 6.0),
        CurvePoint("specee", 0.9, 0, 1.0, 0.99, 10.0),
        CurvePoint("early_exit", 4, 0, 1.5, 0.80, 4.0),  # specee at 1.5x: 0.945
        CurvePoint("early_exit", 8, 0, 3.0, 0.85, 8.0),  # faster than the whole curve
    ]
    found = above_early_exit(points, "specee", "speedup")
    assert [c.exit_layer for c in found] == [4, 8]
    assert found[0].specee == pytest.approx(0.945) and found[0].above is True
    assert found[1].specee is None and found[1].above is None
    by_layers = above_early_exit(points, "specee", "avg_layers")
    assert by_layers[0].specee is None and by_layers[1].specee == pytest.approx(0.945)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"drafter": "medusa"}, "drafter"),
        ({"threshold": 1.5}, "threshold"),
        ({"kv_fill": "zeros"}, "kv_fill"),
        ({"kv_fill": "next", "verify": True}, "kv_fill"),
        ({"max_draft_tokens": 0}, "max_draft_tokens"),
        ({"offline_layers": (0, 9)}, "offline_layers"),
        ({"adapter": "x", "drafter": "exit_head"}, "adapter"),
        ({"eagle": "x", "drafter": "kangaroo"}, "eagle"),
        ({"parts": "/nonexistent"}, "parts"),
    ],
)
def test_bad_options_name_themselves(options, match):
    with pytest.raises(ValueError, match=match):
        rewrite.apply(tiny_model("llama", layers=4), "specee", **options)


def test_onnx_export_and_eagle_compile_refuse_clearly(tmp_path):
    sm = rewrite.apply(tiny_model("llama", layers=4), "specee")
    with pytest.raises(ValueError, match="specee"):
        sm.export_onnx(tmp_path / "x")
    with pytest.raises(ValueError, match="inductor.*eagle"):
        sm.compile()


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"kv_fill": "next", "threshold": 0.5},
        {"kv_fill": "mask", "threshold": 0.5},
        {"verify": True, "threshold": 0.3, "max_draft_tokens": 3},
    ],
)
def test_inductor_specee_matches_eager_and_never_recompiles(options):
    """Every segment the schedule calls is compiled and warmed up by compile(): decoding then
    compiles nothing (dynamo would raise), and the tokens are eager's (mixed exits, joins)."""
    from torch._dynamo.utils import counters

    # float64: lossy exit decisions compare a probability with a threshold, and float32's
    # different summation order (attention over the whole masked buffer) could flip one.
    model = tiny_model("qwen2", layers=4, seed=3, sliding_window=5, dtype=torch.float64)
    options = dict(drafter="exit_head", exit_layer=1, **options)
    prompts = [torch.tensor([[3, 1, 4, 1, 5, 9]]), torch.tensor([[7]])]
    torch.manual_seed(0)  # the same untrained predictors in both
    eager = rewrite.apply(model, "specee", **options)
    torch.manual_seed(0)
    sm = rewrite.apply(model, "specee", **options).compile()
    assert sm.backend == "inductor"
    graphs = counters["stats"]["unique_graphs"]
    for prompt in prompts:
        want = eager.generate(prompt, max_new_tokens=24)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = sm.generate(prompt, max_new_tokens=24)
        assert torch.equal(got, want)
        assert sm.last_metrics.layers_per_token == eager.last_metrics.layers_per_token
    assert counters["stats"]["unique_graphs"] == graphs, "decoding compiled a new graph"
    assert len(set(eager.last_metrics.layers_per_token)) > 1  # some tokens exited, some not


def test_bench_specee_rows_and_threshold_curve(tmp_path, capsys):
    """`leapfx bench --recipe specee --sweep-threshold --plot`: rows, JSON fields, the curve."""
    from leapfx.cli import main
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    model = tiny_model("llama", layers=4, vocab=len(tok), eos=tok.eos_token_id)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    out, plot = tmp_path / "rows.json", tmp_path / "curve.png"
    code = main([
        "bench", "--model", str(tmp_path / "ckpt"), "--recipe", "specee", "--prompts", "1",
        "--prompt-tokens", "8", "--max-new-tokens", "6", "--repeats", "1", "--quiet",
        "--specee-threshold", "0.3", "--sweep-threshold", "--sweep-thresholds", "0.2,1.0",
        "--json", str(out), "--plot", str(plot),
    ])  # fmt: skip
    assert code == 0
    import json

    doc = json.loads(out.read_text())
    rows = doc if isinstance(doc, list) else doc["rows"]
    by = {r["system"]: r for r in rows}
    assert {
        "leapfx_specee",
        "leapfx_specee_mask",
        "leapfx_specee_verified",
        "leapfx_eagle",
    } <= by.keys()
    assert by["leapfx_eagle"]["identical_to_greedy"] is True
    assert by["leapfx_specee_verified"]["identical_to_greedy"] is True
    assert "verify_cost" not in by["leapfx_specee_verified"]["extra"]  # no verify stage timed
    assert by["leapfx_specee"]["agreement"] is not None
    assert by["leapfx_specee"]["avg_layers"] is not None
    printed = capsys.readouterr().out
    assert re.search(r"specee +t=1 ", printed) and re.search(r"early_exit +E=3 ", printed)
    assert plot.is_file() and plot.stat().st_size > 0
    assert re.search(r"specee vs early_exit at equal speed: ", printed)
    assert set(rows[0]["run"]["specee_vs_early_exit"]) >= {"specee/speedup", "specee_mask/speedup"}
