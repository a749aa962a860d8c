"""M2R2: the accelerator pass, its draft stage, training, parts, and losslessness.

Unit tests pin the three properties of the fast stream the paper's shared KV cache relies on
(sec. 2.2): an untrained accelerator is the identity of the stream (the reset state), the fast
query never reads the slow state of its own position, and the fast stream writes nothing into
the shared cache. Hypothesis properties: ``m2r2`` is greedy-identical to HF over every supported
architecture with untrained, randomised and trained accelerators, and samples HF's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.modules.m2r2 import rates, target_layers
from leapfx.modules.m2r2_kernels import KernelAcceleratedLayer
from leapfx.modules.m2r2_scratch import FastScratch
from leapfx.passes.accelerator import InsertAccelerator, accelerator_of
from leapfx.passes.base import PassPipeline
from leapfx.passes.capture import capture
from leapfx.runtime.cache import cache_for
from leapfx.runtime.masks import masks_for
from tests.conftest import ARCHS, MOE_ARCHS, examples, tiny_model, tiny_moe_model
from tests.distribution_check import assert_sampled_from
from tests.greedy_check import assert_greedy_equal, check_random_prompts, hf_greedy
from tests.test_kangaroo_lossless import TEMPERATURE, TOP_K, TOP_P, _exact_distribution
from tests.test_lossless import _prompt, model_specs
from tests.test_partition import _check_golden


def _randomize(gm, seed: int = 0, scale: float = 0.3) -> None:
    """Give every accelerator parameter a random value, as training would (gate included)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in accelerator_of(gm).parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _run_full(model, gm, ids):
    n = ids.shape[1]
    cache = cache_for(model, 64)
    masks = masks_for(
        model.config._attn_implementation, ["full_attention", "sliding_attention"], 0, n,
        window=getattr(model.config, "sliding_window", None), dtype=torch.float32, device="cpu",
    )  # fmt: skip
    return gm(ids, torch.arange(n)[None], masks, cache), cache


def test_rates_and_targets_follow_eq_4():
    assert rates((4,), 16) == [4.0]
    assert rates((4, 8, 12), 16) == [4.0, 3.0, 2.0]
    t = target_layers((4, 8, 12), 16)
    assert [t[i] for i in range(4)] == [4, 8, 12, 16]
    assert [t[i] for i in range(4, 8)] == [7, 10, 13, 16]
    assert [t[i] for i in range(8, 12)] == [10, 12, 14, 16]


def test_golden_m2r2_graph_shows_branches_beside_the_layers():
    model = tiny_model("llama", layers=4)
    gm = PassPipeline([InsertAccelerator(gates=(2,))])(capture(model))
    sm = rewrite.apply(model, "m2r2", fast_layers=2)
    _check_golden("m2r2_llama4", f"# rewritten graph\n{gm.code.strip()}\n\n{sm.stages.code()}")


@pytest.mark.parametrize("arch", ARCHS)
def test_untrained_accelerator_leaves_the_fast_stream_at_its_reset_state(arch):
    model = tiny_model(arch, layers=4)
    gm = PassPipeline([InsertAccelerator(gates=(1, 3))])(capture(model))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    out, _ = _run_full(model, gm, ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    assert torch.equal(out["gate_hidden_1"], hidden[0])  # reset at E_0 = 0: the embedding
    assert torch.equal(out["gate_hidden_3"], hidden[1])  # reset at E_1 = 1: h^1
    assert torch.equal(out["logits"], model(ids).logits)  # the slow stream is untouched


@pytest.mark.parametrize("heads", [None, 4])  # 4: grouped queries (SDPA enable_gqa)
@pytest.mark.parametrize("arch", ARCHS)
def test_fast_query_never_reads_the_slow_state_of_its_own_position(arch, heads):
    """The parallel rows (slow keys of every position in the cache, the [slow | fast] mask)
    equal one-token drafting over a cache that holds only positions < t; and changing the
    slow keys/values at positions >= t changes nothing for row t."""
    model = tiny_model(arch, layers=3, sliding_window=4 if arch in ("mistral", "qwen2") else None)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, fuse_layers=False, heads=heads)
    _randomize(sm.graph_module)
    assert accelerator_of(sm.graph_module).layers["0"].gqa == (heads == 4)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    out, cache = _run_full(model, sm.graph_module, ids)
    parallel = out["gate_hidden_2"]  # [1, 8, H]
    layer0 = accelerator_of(sm.graph_module).layers["0"]
    rope = model.model.rotary_emb(parallel, torch.arange(8)[None])
    full = list(cache.lengths)
    for t in (0, 3, 7):
        cache.crop(t)  # only the slow keys of positions < t remain
        draft = sm.stages["draft"](ids[:, t : t + 1], torch.tensor([[t]]), cache, FastScratch())[
            "hidden"
        ]
        torch.testing.assert_close(draft[:, 0], parallel[:, t], rtol=1e-5, atol=1e-5)
        cache.lengths = list(full)  # crop moved lengths only: the keys are still there
    # Poison the slow keys/values of positions >= 5 of layer 0: fast row 5 must not move.
    _, cache = _run_full(model, sm.graph_module, ids)
    x = model.model.embed_tokens(ids)
    before = layer0(x, rope, torch.arange(8)[None], cache)[:, 5]
    cache.keys[0][:, :, 5:8] = 1e3
    cache.values[0][:, :, 5:8] = -1e3
    after = layer0(x, rope, torch.arange(8)[None], cache)[:, 5]
    torch.testing.assert_close(after, before)


def test_the_fast_stream_writes_nothing_into_the_shared_cache():
    model = tiny_model("qwen3", layers=4)
    sm = rewrite.apply(model, "m2r2", fast_layers=3)
    _randomize(sm.graph_module)
    ids = torch.randint(0, 128, (1, 6))
    _, cache = _run_full(model, sm.graph_module, ids)
    keys = [k.clone() for k in cache.keys]
    values = [v.clone() for v in cache.values]
    lengths = list(cache.lengths)
    scratch = FastScratch()
    for i, token in enumerate([3, 5, 7]):
        sm.stages["draft"](torch.tensor([[token]]), torch.tensor([[6 + i]]), cache, scratch)
    assert cache.lengths == lengths
    assert all(torch.equal(a, b) for a, b in zip(keys, cache.keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(values, cache.values, strict=True))
    assert len(scratch) == 3  # the round's fast keys live in the scratch only
    assert sorted(scratch.kv) == [0, 1, 2]


def test_fast_attention_uses_the_chosen_heads():
    model = tiny_model("llama", layers=3, heads=8, kv_heads=8)
    gm = InsertAccelerator(gates=(2,), heads=2).run(capture(model)).graph_module
    layer = accelerator_of(gm).layers["0"]
    assert layer.q_heads == [0, 4] and layer.kv_heads == [0, 4]
    assert layer.kv_index == slice(0, 8, 4)  # a view of the cache, no copy
    gqa = InsertAccelerator(gates=(2,)).run(capture(tiny_model("llama", layers=3))).graph_module
    layer = accelerator_of(gqa).layers["1"]
    assert layer.q_heads == [0, 2] and layer.kv_heads == [0, 1]  # one query head per KV group
    # Only trainable tensors are the accelerator's state: the host stays shared.
    assert all(
        k.split(".")[-1] in {"q_a", "q_b", "o_a", "o_b", "gate", "down", "up"}
        for k in accelerator_of(gqa).state_dict()
    )


def test_fast_keys_drafts_read_exactly_the_chosen_slow_keys():
    """Sec. 2.5: with ``fast_keys`` k a draft equals a draft without it over a cache that holds
    only the k slow keys the round's first draft chose (one KV head, two pooled query heads);
    the choice is fixed for the round, and with at most k cached keys every key is read."""
    model = tiny_model("llama", layers=3, kv_heads=1)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    drafts = [torch.tensor([[5]]), torch.tensor([[9]])]

    def draft(sm, cache, scratch):
        outs = []
        for i, token in enumerate(drafts):
            outs.append(sm.stages["draft"](token, torch.tensor([[10 + i]]), cache, scratch))
        return torch.cat([o["hidden"] for o in outs], dim=1)

    chosen = rewrite.apply(model, "m2r2", fast_layers=2, fuse_layers=False, heads=2, fast_keys=3)
    _randomize(chosen.graph_module)
    every = rewrite.apply(model, "m2r2", fast_layers=2, fuse_layers=False, heads=2)
    every.graph_module.m2r2_accelerator.load_state_dict(accelerator_of(chosen.graph_module)
                                                        .state_dict())  # fmt: skip
    _, cache = _run_full(model, chosen.graph_module, ids)
    scratch = FastScratch()
    got = draft(chosen, cache, scratch)
    assert sorted(scratch.top) == [0, 1]
    assert all(t[0].shape == (1, 1, 3) for t in scratch.top.values())
    assert not torch.allclose(got, draft(every, cache, FastScratch()))  # it does read fewer
    for slot, (top, _, _) in scratch.top.items():  # keep only the chosen keys, in order
        idx = top[0, 0]
        cache.keys[slot][:, :, :3] = cache.keys[slot][:, :, idx].clone()
        cache.values[slot][:, :, :3] = cache.values[slot][:, :, idx].clone()
        cache.lengths[slot] = 3
    torch.testing.assert_close(got, draft(every, cache, FastScratch()), rtol=1e-5, atol=1e-5)
    # Three cached keys, k = 3: nothing to choose, every key is read.
    scratch = FastScratch()
    torch.testing.assert_close(draft(chosen, cache, scratch), draft(every, cache, FastScratch()))
    assert scratch.top == {}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"fast_keys": 0}, "fast_keys"),
        ({"fast_keys": True}, "fast_keys"),
        ({"fast_layers": 4}, "fast_layers"),
        ({"fast_layers": 0}, "fast_layers"),
        ({"rank": 0}, "rank"),
        ({"heads": 9}, "heads"),
        ({"num_speculations": 0}, "num_speculations"),
        ({"confidence_threshold": 1.0}, "confidence_threshold"),
        ({"parts": 3}, "parts"),
    ],
)
def test_m2r2_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        rewrite.apply(tiny_model("llama", layers=4), "m2r2", **options)


def test_fit_trains_only_the_accelerator_and_parts_round_trip(tmp_path):
    model = tiny_model("llama", layers=4, vocab=64)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, rank=4)
    host = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    result = sm.fit(tokens, steps=6, batch_size=2, seq_len=16, lr=1e-2, progress=False)
    assert len(result.losses) == 6 and all(np.isfinite(result.losses))
    assert all(torch.equal(host[k], v) for k, v in model.state_dict().items())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    acc = accelerator_of(sm.graph_module)
    assert float(acc.layers["0"].gate.detach().abs().sum()) > 0
    sm.save_parts(tmp_path / "parts")
    again = rewrite.apply(model, "m2r2", parts=tmp_path / "parts")
    assert again.options.fast_layers == 2 and again.options.rank == 4
    for k, v in accelerator_of(again.graph_module).state_dict().items():
        assert torch.equal(v, acc.state_dict()[k])
    with pytest.raises(ValueError, match="fast_layers"):
        rewrite.apply(model, "m2r2", parts=tmp_path / "parts", fast_layers=3)
    with pytest.raises(ValueError, match="parts"):
        rewrite.apply(model, "m2r2", parts=tmp_path / "missing")
    with pytest.raises(ValueError, match="another model"):
        rewrite.apply(tiny_model("llama", layers=4, vocab=80), "m2r2", parts=tmp_path / "parts")


def test_parts_carry_their_draft_length_and_confidence_stop(tmp_path):
    model = tiny_model("llama", layers=4, vocab=64)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, num_speculations=5, confidence_threshold=0.4)
    assert (sm.options.num_speculations, sm.options.confidence_threshold) == (5, 0.4)
    sm.save_parts(tmp_path / "parts")
    again = rewrite.apply(model, "m2r2", parts=tmp_path / "parts")
    assert (again.options.num_speculations, again.options.confidence_threshold) == (5, 0.4)
    mine = rewrite.apply(model, "m2r2", parts=tmp_path / "parts", num_speculations=2,
                         confidence_threshold=0.0)  # fmt: skip
    assert (mine.options.num_speculations, mine.options.confidence_threshold) == (2, 0.0)
    plain = rewrite.apply(model, "m2r2")  # no parts: the paper's g = 3, no stop
    assert (plain.options.num_speculations, plain.options.confidence_threshold) == (3, 0.0)


def test_evaluate_reports_cosine_and_agreement_per_gate():
    from leapfx.train.m2r2 import evaluate

    model = tiny_model("llama", layers=4, vocab=64)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, num_speculations=3)
    report = evaluate(sm, torch.randint(0, 64, (40,)), seq_len=16)
    assert report["tokens"] == 40
    assert set(report["cosine"]) == {"2"} and 0 <= report["agreement"]["2"] <= 1
    chain = report["chain"]  # the draft chain: step 1 is the gate itself
    assert chain["steps"] == 3 and chain["agreement"][0] == report["agreement"]["2"]
    assert 0 <= chain["accepted"] <= 3


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: a sliding window of 3
def test_training_chain_step_is_the_draft_that_decoding_runs(arch):
    """Chain step j + 1 at row t (ChainScratch, all rows at once) is draft j + 1 of the round
    that starts at t - j: the draft stage over a cache of positions < t - j, after j drafts
    fed the same tokens -- the drafting that training with teacher-forced slow keys misses."""
    from leapfx.modules.m2r2_scratch import ChainScratch
    from leapfx.train.m2r2 import draft_chain, fast_states, gate_logits, slow_pass

    model = tiny_model(arch, layers=3, sliding_window=3 if arch == "mistral" else None)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, fuse_layers=False)
    _randomize(sm.graph_module)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        slow = slow_pass(sm, ids)
        chain = ChainScratch()
        first = gate_logits(sm, fast_states(sm, slow, chain)[1])
        steps = [first, *draft_chain(sm, slow, chain, 4)]
        cache, full = slow.cache, list(slow.cache.lengths)
        for s in (0, 2, 5):
            cache.crop(s)
            scratch = FastScratch()
            for j in range(4):
                t = s + j
                out = sm.stages["draft"](ids[:, t : t + 1], torch.tensor([[t]]), cache, scratch)
                torch.testing.assert_close(out["logits"][:, 0], steps[j][:, t], rtol=1e-5,
                                           atol=1e-5)  # fmt: skip
            cache.lengths = list(full)


def test_chain_accepted_counts_leading_agreements():
    from leapfx.train.m2r2 import chain_accepted

    t, f = True, False
    agree = [torch.tensor([[t, t, f, t]]), torch.tensor([[f, t, t, f]])]  # steps 1, 2
    # round starts 0..2: step 1 at s, step 2 at s + 1 -> accepted 2, 2, 0
    assert chain_accepted(agree) == (4, 3)


def test_greedy_continuations_are_prompts_of_the_stream_and_the_models_greedy_tokens():
    from leapfx.train.evaluate import greedy_continuations

    model = tiny_model("llama", layers=2, vocab=64)
    stream = torch.randint(0, 64, (100,), generator=torch.Generator().manual_seed(3))
    out = greedy_continuations(model, stream, count=3, prompt_tokens=5, new_tokens=4,
                               batch_size=2)  # fmt: skip
    assert out.shape == (3, 9)
    text = stream.tolist()
    for row in out:
        prompt = row[:5].tolist()
        assert any(text[i : i + 5] == prompt for i in range(96))
        assert torch.equal(row, hf_greedy(model, row[None, :5], 4)[0])


def test_fit_with_a_draft_chain_trains_and_validates():
    model = tiny_model("llama", layers=3, vocab=64)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, rank=4)
    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    result = sm.fit(tokens, steps=3, batch_size=2, seq_len=12, chain=3, ce_target="model",
                    progress=False)  # fmt: skip
    assert len(result.losses) == 3 and all(np.isfinite(result.losses))
    assert float(accelerator_of(sm.graph_module).layers["0"].gate.detach().abs().sum()) > 0
    with pytest.raises(ValueError, match="chain"):
        sm.fit(tokens, steps=1, chain=0)


@settings(max_examples=examples(120, 300))
@given(spec=model_specs(), data=st.data())
def test_m2r2_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    layers = spec["layers"]
    options = dict(
        fast_layers=data.draw(st.integers(1, layers - 1), label="fast_layers"),
        num_speculations=data.draw(st.integers(1, 6), label="gamma"),
        confidence_threshold=data.draw(
            st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)), label="eta"
        ),
        heads=data.draw(st.one_of(st.none(), st.integers(1, spec["heads"])), label="heads"),
        rank=data.draw(st.integers(1, 8), label="rank"),
        fast_keys=data.draw(st.one_of(st.none(), st.integers(1, 8)), label="fast_keys"),
        draft_vocab=data.draw(st.one_of(st.none(), st.integers(1, spec["vocab"])), label="N"),
    )
    max_new = data.draw(st.integers(1, 24), label="max_new_tokens")
    sm = rewrite.apply(model, "m2r2", **options)
    state = data.draw(st.sampled_from(["untrained", "random", "trained"]), label="accelerator")
    if state == "random":
        _randomize(sm.graph_module, seed=data.draw(st.integers(0, 99), label="seed"))
    elif state == "trained":
        tokens = torch.randint(0, spec["vocab"], (48,), generator=torch.Generator().manual_seed(1))
        sm.fit(tokens, steps=2, batch_size=2, seq_len=16, lr=1e-2, progress=False)
    ours = sm.generate(prompt, max_new_tokens=max_new)
    ref = hf_greedy(model, prompt, max_new)
    assert_greedy_equal(model, ours, ref, prompt.shape[1])
    m = sm.last_metrics
    assert m.new_tokens == ours.shape[1] - prompt.shape[1]
    assert all(1 <= s <= options["num_speculations"] + 1 for s in m.accepted_per_verify)


def test_m2r2_float64_is_exact_with_a_trained_accelerator(tmp_path):
    """No float ties in float64: identical, full stop; and the trained drafts get accepted."""
    model = tiny_model("llama", layers=6, vocab=64, dtype=torch.float64, seed=3)
    prompt = torch.tensor([[5, 9, 1, 33, 2]])
    text = hf_greedy(model, prompt, 120)[0]
    sm = rewrite.apply(model, "m2r2", fast_layers=2)
    sm.fit(text, steps=40, batch_size=4, seq_len=32, lr=1e-2, ce_target="model", progress=False)
    sm.save_parts(tmp_path / "parts")
    for eta in (0.0, 0.5):
        sm = rewrite.apply(model, "m2r2", parts=tmp_path / "parts", confidence_threshold=eta)
        ours = sm.generate(prompt, max_new_tokens=96)
        assert torch.equal(ours, hf_greedy(model, prompt, 96))
        assert sm.last_metrics.accepted_drafts > 0


def test_m2r2_sampling_matches_target_distribution():
    """Chi-square of 3000 sampled 4-token continuations against the exact HF distribution,
    with a randomised accelerator drafting (so both branches of rejection sampling run)."""
    vocab, length = 4, 4
    model = tiny_model("llama", layers=3, vocab=vocab, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    prompt = torch.tensor([[1, 3, 2]])
    exact = _exact_distribution(model, prompt, vocab, length)
    sm = rewrite.apply(model, "m2r2", fast_layers=1, num_speculations=2)
    _randomize(sm.graph_module, seed=3)
    g = torch.Generator().manual_seed(1234)
    n = 3000
    counts = dict.fromkeys(exact, 0)
    rejections = drafted = 0
    for _ in range(n):
        out = sm.generate(
            prompt, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
            max_new_tokens=length, generator=g,
        )  # fmt: skip
        counts[tuple(out[0, 3:].tolist())] += 1
        m = sm.last_metrics
        rejections += m.drafted_tokens - m.accepted_drafts
        drafted += m.drafted_tokens
    assert 0 < rejections < drafted
    assert_sampled_from(counts, exact, n)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "qwen3", "olmoe", "qwen3_moe"])
def test_kernel_fast_layer_computes_the_fast_layer(arch):
    # qwen2: q/k/v biases; gemma: (1 + weight) norms; qwen3: q/k norms; olmoe: full-width q/k
    # norms (the rms_norm op) and clip_qkv; qwen3_moe: per-head q/k norms (the rope op).
    if arch in MOE_ARCHS:
        model = tiny_moe_model(arch, layers=3, seed=4)
        model.config.clip_qkv = 0.5 if arch == "olmoe" else None
    else:
        model = tiny_model(arch, layers=3)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, fuse_layers=False)
    _randomize(sm.graph_module)
    layer = accelerator_of(sm.graph_module).layers["0"]
    kernel = KernelAcceleratedLayer(layer)
    assert all(not hasattr(n, "__self__") for n in kernel._norms)  # F.rms_norm, not HF's
    if arch in ("qwen3", "olmoe", "qwen3_moe"):  # the rotary through leapfx_cpu::rope
        assert kernel.rope is not layer._rope
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    _, cache = _run_full(model, sm.graph_module, ids)
    x = model.model.embed_tokens(ids)
    pos = torch.arange(7)[None]
    rope = model.model.rotary_emb(x, pos)
    with torch.no_grad():  # the parallel rows (exit gates) and one drafted row
        torch.testing.assert_close(
            kernel(x, rope, pos, cache), layer(x, rope, pos, cache), rtol=1e-5, atol=1e-5
        )
        cache.crop(6)
        one = (x[:, 6:], tuple(r[:, 6:] for r in rope), pos[:, 6:], cache)
        got, want = kernel(*one, FastScratch()), layer(*one, FastScratch())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_m2r2_with_cpu_kernels_is_token_identical_to_hf_greedy():
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, cpu_kernels=True)
    _randomize(sm.graph_module, scale=0.1)
    sm.use_cpu_kernels()  # packs the randomised weights
    assert any(isinstance(m, KernelAcceleratedLayer) for m in sm._executors["draft"].modules())
    check_random_prompts(model, sm, (1, 9), 40, seed=1)
    assert sm.last_metrics.verify_calls > 0


def test_m2r2_refuses_inductor_and_says_why():
    # (its ONNX export: tests/test_export_recipes.py)
    model = tiny_model("llama", layers=3)
    with pytest.raises(ValueError, match=r"eager and in onnxruntime \(export_onnx\), not under"):
        rewrite.apply(model, "m2r2", backend="inductor")
