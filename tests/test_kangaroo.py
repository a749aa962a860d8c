"""Kangaroo: the adapter pass, its KV slot and rollback, dynamic drafting, fit, save/load, options.

Losslessness properties and the sampling distribution test are in test_kangaroo_lossless.py.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from leapfx import rewrite
from leapfx.passes.adapter import ADAPTER_MODULE, InsertKangarooAdapter, adapter_of
from leapfx.passes.base import PassError
from leapfx.passes.capture import ROLE, capture, decoder_pieces
from leapfx.passes.exit_head import InsertExitHead
from leapfx.recipes.table import default_kangaroo_exit_layer
from leapfx.runtime.cache import cache_for
from leapfx.runtime.kangaroo import draft_until_unsure
from leapfx.runtime.masks import masks_for
from leapfx.runtime.sampling import SamplingParams
from leapfx.runtime.schedules import DecodeRequest
from leapfx.train.kangaroo import evaluate_loss, kangaroo_loss
from tests.conftest import ARCHS, tiny_model
from tests.greedy_check import hf_greedy
from tests.test_partition import _check_golden


def _masks(model, start, n):
    pieces = decoder_pieces(model)
    return masks_for("sdpa", pieces.attn_kinds, start, n, window=pieces.sliding_window,
                     dtype=torch.float32, device="cpu")  # fmt: skip


def _ids(n, vocab=128, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- the pass --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_pass_numerics(arch):
    """The graph's adapter = output_norm(h + attn(input_norm(h))) -> the model's own head, and
    starts as layer l's attention half plus the final norm; the final logits are untouched."""
    model = tiny_model(arch, layers=4, sliding_window=6 if arch in ("mistral", "qwen2") else None)
    ids, n, e = _ids(9), 9, 2
    gm = capture(model)
    with torch.no_grad():
        before = gm(ids, torch.arange(n)[None], _masks(model, 0, n), None)["logits"]
        result = InsertKangarooAdapter(exit_layer=e).run(gm)
        result.graph_module.graph.lint()
        result.graph_module.recompile()
        out = result.graph_module(ids, torch.arange(n)[None], _masks(model, 0, n), None)
        hf = model(ids, output_hidden_states=True)
        h = hf.hidden_states[e]
        layer = model.model.layers[e]
        kind = decoder_pieces(model).attn_kinds[e]
        rope = model.model.rotary_emb(h, torch.arange(n)[None])
        attn, _ = layer.self_attn(layer.input_layernorm(h), position_embeddings=rope,
                                  attention_mask=_masks(model, 0, n)[kind])  # fmt: skip
        expected = model.lm_head(model.model.norm(h + attn))
        adapter = adapter_of(result.graph_module)
        direct = model.lm_head(adapter(h, rope, _masks(model, 0, n)[kind]))
    assert result.modified and result.matches == 1
    assert torch.equal(out["logits"], before)
    assert torch.equal(out["exit_hidden"], h)
    assert torch.equal(out["exit_logits"], direct)  # KangarooAdapter.forward == the graph
    torch.testing.assert_close(out["exit_logits"], expected)
    assert type(adapter.attention) is type(layer.self_attn)  # the host's own class (GQA)
    assert adapter.cache_layer == 4 and adapter.attn_kind == kind


def test_adapter_has_two_norms_and_one_attention_and_shares_host_weights():
    model = tiny_model("llama", layers=4)
    n_model = sum(p.numel() for p in model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sm = rewrite.apply(model, "kangaroo", exit_layer=2)
    adapter = adapter_of(sm.graph_module)
    layer = model.model.layers[2]

    def count(m):
        return sum(p.numel() for p in m.parameters())

    expected = count(layer.input_layernorm) + count(layer.self_attn) + count(model.model.norm)
    assert count(adapter) == expected
    assert not adapter.training  # follows the host's mode (eval): no attention dropout
    assert [name for name, _ in adapter.named_children()] == [
        "input_norm", "attention", "output_norm",
    ]  # fmt: skip
    # The user's model is untouched: same modules, same values, no adapter attached to it.
    assert sum(p.numel() for p in model.parameters()) == n_model
    assert not hasattr(model, ADAPTER_MODULE) and not hasattr(model.model, ADAPTER_MODULE)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # Host weights are shared by reference (same storage), adapter weights are its own.
    host_ptrs = {p.data_ptr() for p in model.parameters()}
    adapter_ptrs = {p.data_ptr() for p in adapter.parameters()}
    assert not host_ptrs & adapter_ptrs
    for name, gm in sm.stages.modules.items():
        ptrs = {p.data_ptr() for p in gm.parameters()}
        assert ptrs <= host_ptrs | adapter_ptrs, name
        assert gm.get_submodule("lm_head").weight.data_ptr() == model.lm_head.weight.data_ptr()
    draft = sm.stages["draft"]
    assert draft.get_submodule(f"{ADAPTER_MODULE}.attention") is adapter.attention
    roles = {n.meta.get(ROLE) for n in sm.graph_module.graph.nodes}
    assert {"adapter_input_norm", "adapter_attention", "adapter_residual", "adapter_norm",
            "adapter_head"} <= roles  # fmt: skip


def test_adapter_pass_does_not_match_twice():
    gm = InsertKangarooAdapter(exit_layer=2).run(capture(tiny_model("llama"))).graph_module
    code = gm.code
    again = InsertKangarooAdapter(exit_layer=2).run(gm)
    assert not again.modified and again.matches == 0
    assert again.graph_module.code == code
    with pytest.raises(ValueError, match="already has a Kangaroo adapter after layer 2"):
        InsertKangarooAdapter(exit_layer=1).run(gm)
    exit_head = InsertExitHead(layer=2).run(capture(tiny_model("llama"))).graph_module
    with pytest.raises(ValueError, match="already has an exit head"):
        InsertKangarooAdapter(exit_layer=2).run(exit_head)


@pytest.mark.parametrize("bad", [0, 4, -1])
def test_adapter_pass_out_of_range(bad):
    with pytest.raises(ValueError, match=rf"exit_layer: {bad} is out of range.*1\.\.3"):
        InsertKangarooAdapter(exit_layer=bad).run(capture(tiny_model("llama")))


def test_golden_kangaroo_stage_text():
    sm = rewrite.apply(tiny_model("llama", layers=4), "kangaroo", exit_layer=2)
    _check_golden("kangaroo_llama4", sm.stages.code())


def test_golden_kangaroo_sliding_window():
    """The adapter reads the mask kind of the layer it was copied from (here a full layer)."""
    model = tiny_model("qwen2", layers=4, sliding_window=8)
    sm = rewrite.apply(model, "kangaroo", exit_layer=2, fuse_layers=False)
    _check_golden("kangaroo_qwen2_sliding", sm.stages.code())


# --- stages and the adapter's KV slot --------------------------------------------------------


def test_stages_reproduce_the_full_model_and_fill_the_adapter_slot():
    model = tiny_model("llama", layers=5, seed=4)
    stages = rewrite.apply(model, "kangaroo", exit_layer=2).stages
    ids = _ids(10, seed=3)
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
        cache = cache_for(model, 16, extra_layers=1)
        d = stages["draft"](input_ids=ids[:, :7], position_ids=torch.arange(7)[None],
                            masks=_masks(model, 0, 7), cache=cache)  # fmt: skip
        torch.testing.assert_close(d["hidden"], hf.hidden_states[2][:, :7])
        assert cache.lengths == [7, 7, 0, 0, 0, 7]  # lower layers and the adapter (slot 5)
        logits = stages["verify"](
            input_ids=ids[:, 7:], position_ids=torch.arange(7, 10)[None],
            masks=_masks(model, 7, 3), exit_hidden=d["hidden"],
            remainder_position_ids=torch.arange(10)[None],
            remainder_masks=_masks(model, 0, 10), cache=cache,
        )["logits"]  # fmt: skip
        assert cache.lengths == [10] * 6  # verify ran the adapter's attention on 7..9 too
        fresh = cache_for(model, 16, extra_layers=1)
        full = stages["full"](input_ids=ids, position_ids=torch.arange(10)[None],
                              masks=_masks(model, 0, 10), cache=fresh)["logits"]  # fmt: skip
    torch.testing.assert_close(logits, hf.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full, hf.logits, rtol=1e-5, atol=1e-5)
    assert fresh.lengths == [10] * 6  # prefill fills the adapter's slot as well
    torch.testing.assert_close(cache.keys[5][:, :, :10], fresh.keys[5][:, :, :10])
    torch.testing.assert_close(cache.values[5][:, :, :10], fresh.values[5][:, :, :10])


def _oracle_model():
    """A model whose layers >= 1 add exact zeros, with an adapter that adds exact zeros: the
    adapter's logits equal the full model's bit for bit, so every draft is accepted and every
    round ends in the paper's Figure 2 case (the adapter has not seen the last draft)."""
    model = tiny_model("llama", layers=3, dtype=torch.float64, seed=5)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _adapter_slot_matches_a_fresh_prefill(sm, model, tokens):
    cache = sm._cache
    n = cache.length
    assert cache.lengths == [n] * cache.num_layers  # every slot rolled back to the same length
    assert n == tokens.shape[1] - 1  # all but the newest token are committed
    fresh = cache_for(model, n + 1, extra_layers=1)
    with torch.no_grad():
        sm.stages["full"](input_ids=tokens[:, :n], position_ids=torch.arange(n)[None],
                          masks=_masks(model, 0, n), cache=fresh)  # fmt: skip
    slot = cache.num_layers - 1
    torch.testing.assert_close(cache.keys[slot][:, :, :n], fresh.keys[slot][:, :, :n])
    torch.testing.assert_close(cache.values[slot][:, :, :n], fresh.values[slot][:, :, :n])


def _spy_rounds(sm) -> list[int]:
    """Record the number of drafts d of every verify call (of the stages generate runs: the
    kernel stages where rewrite.apply turned them on)."""
    rounds: list[int] = []
    stages = sm._executors if sm._executors is not None else sm.stages.modules
    verify = stages["verify"]

    def spy(**inputs):
        rounds.append(inputs["exit_hidden"].shape[1])
        return verify(**inputs)

    stages["verify"] = spy
    return rounds


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_all_accepted_rounds_keep_the_adapter_cache_complete(gamma):
    """Figure 2: after an all-accepted round the adapter already has KV for the last draft
    (computed in verify), so no position is ever run through the adapter twice."""
    model = _oracle_model()
    sm = rewrite.apply(model, "kangaroo", exit_layer=1, max_draft_tokens=gamma,
                       confidence_threshold=0.0, fuse_layers=False)  # fmt: skip
    rounds = _spy_rounds(sm)
    seen = []
    hook = adapter_of(sm.graph_module).attention.register_forward_hook(
        lambda mod, args, out: seen.append(args[0].shape[1])
    )
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    out = sm.generate(prompt, max_new_tokens=40)
    hook.remove()
    assert torch.equal(out, hf_greedy(model, prompt, 40))
    m = sm.last_metrics
    assert m.acceptance_rate == 1.0 and m.verify_calls == len(rounds) > 1
    assert all(d == gamma for d in rounds[:-1])  # eta = 0: fixed length, gamma every round
    # Every committed position went through the adapter exactly once: no catch-up pass.
    assert sum(seen) == sm._cache.length
    _adapter_slot_matches_a_fresh_prefill(sm, model, out)


def test_rejected_drafts_roll_back_the_adapter_slot():
    model = tiny_model("llama", layers=4, dtype=torch.float64, seed=2)
    sm = rewrite.apply(model, "kangaroo", exit_layer=1, max_draft_tokens=4,
                       confidence_threshold=0.0)  # fmt: skip
    prompt = torch.tensor([[7, 7, 2]])
    out = sm.generate(prompt, max_new_tokens=48)
    m = sm.last_metrics
    assert m.accepted_drafts < m.drafted_tokens  # some drafts were rejected and rolled back
    assert torch.equal(out, hf_greedy(model, prompt, 48))
    _adapter_slot_matches_a_fresh_prefill(sm, model, out)


def test_shallow_layers_are_never_recomputed():
    """Double early exit: verify reuses the draft's early features (hooks count layer calls)."""
    model = tiny_model("llama", layers=4, seed=1)
    calls = {i: 0 for i in range(4)}
    hooks = [
        layer.register_forward_hook(lambda mod, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(model.model.layers)
    ]
    sm = rewrite.apply(model, "kangaroo", exit_layer=2, max_draft_tokens=4, fuse_layers=False)
    sm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=20)
    for h in hooks:
        h.remove()
    m = sm.last_metrics
    assert calls[0] == calls[1] == m.full_calls + m.draft_calls + m.verify_calls
    assert calls[2] == calls[3] == m.full_calls + m.verify_calls


# --- dynamic drafting ------------------------------------------------------------------------


class _FakeRunner:
    """draft() returns logits whose softmax top-1 is the next scripted confidence."""

    ragged = False  # one sequence: int starts

    def __init__(self, confidences, vocab=4):
        self.confidences = list(confidences)
        self.vocab = vocab
        self.calls = 0

    def chain_length(self):
        return 0  # no draft_chain stage (StageRunner.chain_length): drafts step by step

    def draft(self, token, start):
        c = self.confidences[self.calls]
        self.calls += 1
        rest = (1 - c) / (self.vocab - 1)
        p = torch.tensor([rest] * self.vocab)
        p[self.calls % self.vocab] = c
        return p.log()[None, None], torch.full((1, 1, 2), float(start))


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize(
    ("eta", "max_tokens", "expected"),
    [
        (0.6, 6, 3),  # 0.9, 0.7 > 0.6; 0.5 <= 0.6: stop, keeping that draft
        (0.7, 6, 2),  # eq. 4 is <=: a confidence equal to eta stops
        (0.95, 6, 1),
        (0.0, 6, 6),  # eta = 0: fixed length
        (0.6, 2, 2),  # gamma caps the round
    ],
)
def test_draft_stops_at_eq4(do_sample, eta, max_tokens, expected):
    runner = _FakeRunner([0.9, 0.7, 0.5, 0.9, 0.8, 0.99])
    request = DecodeRequest(8, frozenset(), SamplingParams(do_sample=do_sample),
                            torch.Generator().manual_seed(0))  # fmt: skip
    tokens, hidden, q = draft_until_unsure(runner, torch.tensor([[0]]), 10, max_tokens, eta,
                                           request)  # fmt: skip
    assert tokens.shape == (1, expected) and runner.calls == expected
    assert hidden[0, :, 0].tolist() == [10.0 + i for i in range(expected)]  # positions
    assert (q is not None) == do_sample
    if do_sample:
        assert q.shape == (1, expected, 4)


def test_fixed_length_drafts_gamma_unless_truncated_and_dynamic_drafts_fewer():
    model = tiny_model("llama", layers=4, vocab=64, seed=6)
    prompt = torch.tensor([[9, 8, 7]])
    gamma, max_new = 5, 40
    drafted = {}
    for eta in (0.0, 0.9):
        sm = rewrite.apply(model, "kangaroo", exit_layer=1, max_draft_tokens=gamma,
                           confidence_threshold=eta)  # fmt: skip
        rounds = _spy_rounds(sm)
        out = sm.generate(prompt, max_new_tokens=max_new)
        assert torch.equal(out, hf_greedy(model, prompt, max_new))
        m = sm.last_metrics
        assert sum(rounds) == m.drafted_tokens and len(rounds) == m.verify_calls
        assert m.num_speculations == gamma and len(m.ctar_curve) == gamma
        emitted, bounds = 1, []
        for s in m.accepted_per_verify:
            bounds.append(min(gamma, max_new - emitted - 1))
            emitted += s
        if eta == 0.0:
            assert rounds == bounds  # exactly gamma per round, unless max_new_tokens truncates
        else:
            assert all(1 <= d <= b for d, b in zip(rounds, bounds, strict=True))
            assert any(d < b for d, b in zip(rounds, bounds, strict=True))
        drafted[eta] = m.drafted_tokens / m.verify_calls
    assert drafted[0.9] < drafted[0.0]


# --- fit, save, load -------------------------------------------------------------------------


def _model_text(model, n=160):
    """Tokens the model itself generates: structured data a few steps can learn from."""
    return hf_greedy(model, torch.tensor([[1, 2, 3]]), n)[0]


def test_fit_reduces_the_eq3_loss_and_trains_only_the_adapter():
    model = tiny_model("llama", layers=4, seed=3)
    sm = rewrite.apply(model, "kangaroo", exit_layer=1)
    data = _model_text(model)
    host = {k: v.clone() for k, v in model.state_dict().items()}
    before = evaluate_loss(sm, data, seq_len=64)
    frozen_head = model.lm_head.weight.clone()
    result = sm.fit(data, steps=40, batch_size=4, seq_len=32, lr=3e-3, progress=False)
    after = evaluate_loss(sm, data, seq_len=64)
    assert len(result.losses) == 40 and result.tokens == 40 * 4 * 32
    assert after < before - 0.01, (before, after)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in host.items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.lm_head.weight, frozen_head)
    assert not adapter_of(sm.graph_module).training  # back in eval mode


def test_kangaroo_loss_is_eq3():
    target = torch.randn(3, 7)
    draft = torch.randn(3, 7)
    expected = -(target.softmax(-1) * draft.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(kangaroo_loss(draft, target), expected)
    # minimised at draft == target, where it is the target's entropy
    assert kangaroo_loss(target, target) < kangaroo_loss(draft, target)


def test_fit_accepts_texts_with_a_tokenizer_and_token_lists():
    model = tiny_model("llama", layers=2, vocab=128)
    sm = rewrite.apply(model, "kangaroo")

    class Bytes:
        def encode(self, text):
            return [b % 128 for b in text.encode()]

    r = sm.fit(["def f(x):\n    return x\n", "import os\n"], tokenizer=Bytes(), steps=2,
               batch_size=2, seq_len=8, progress=False)  # fmt: skip
    assert len(r.losses) == 2 and all(math.isfinite(x) for x in r.losses)
    r = sm.fit([[1, 2, 3, 4], torch.tensor([5, 6, 7])], steps=1, progress=False)
    assert r.tokens == 8 * 7  # windows are capped at the 7-token stream
    with pytest.raises(ValueError, match="tokenizer: texts need a tokenizer"):
        sm.fit(["text"], steps=1)
    with pytest.raises(ValueError, match=r"data: token ids must lie in 0\.\.127"):
        sm.fit(torch.tensor([1, 200, 3]), steps=1)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("steps", 0, r"steps: 0 is invalid; allowed: an integer >= 1"),
        ("batch_size", 1.5, r"batch_size: 1\.5 is invalid"),
        ("seq_len", 1, r"seq_len: 1 is invalid; allowed: an integer >= 2"),
        ("lr", 0.0, r"lr: 0\.0 is invalid; allowed: a finite number > 0"),
        ("lr", float("nan"), r"lr: nan is invalid"),
        ("grad_clip", -1.0, r"grad_clip: -1\.0 is invalid; allowed: a finite number >= 0"),
        ("progress", "yes", r"progress: 'yes' is invalid; allowed: True or False"),
        ("epochs", 3, r"'epochs' is not an option of fit; its options are: .*steps"),
    ],
)
def test_fit_options_are_validated(option, value, message):
    sm = rewrite.apply(tiny_model("llama", layers=2), "kangaroo")
    with pytest.raises(ValueError, match=message):
        sm.fit(torch.arange(10), **{option: value})


def test_fit_needs_a_recipe_that_trains():
    sm = rewrite.apply(tiny_model("llama", layers=2), "layerskip")
    with pytest.raises(ValueError, match="fit: recipe 'layerskip' inserts nothing that trains"):
        sm.fit(torch.arange(10))
    with pytest.raises(ValueError, match="save_adapter: recipe 'layerskip'"):
        sm.save_adapter("unused")
    with pytest.raises(ValueError, match="save_parts: recipe 'layerskip'"):
        sm.save_parts("unused")


def test_parts_is_the_generic_name_of_the_adapter_option(tmp_path):
    model = tiny_model("llama", layers=4, seed=3)
    sm = rewrite.apply(model, "kangaroo", exit_layer=2)
    sm.save_parts(tmp_path / "p")
    loaded = rewrite.apply(model, "kangaroo", parts=tmp_path / "p")
    assert loaded.options.adapter == str(tmp_path / "p") and loaded.options.exit_layer == 2
    a, b = adapter_of(sm.graph_module).state_dict(), adapter_of(loaded.graph_module).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"parts: given together with adapter="):
        rewrite.apply(model, "kangaroo", parts=tmp_path / "p", adapter=tmp_path / "p")
    with pytest.raises(ValueError, match=r"parts: recipe 'layerskip' inserts nothing .*kangaroo"):
        rewrite.apply(model, "layerskip", parts=tmp_path / "p")


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("qwen3", layers=4, seed=8)
    sm = rewrite.apply(model, "kangaroo", exit_layer=2, max_draft_tokens=4,
                       confidence_threshold=0.3)  # fmt: skip
    sm.fit(_model_text(model, 64), steps=5, batch_size=2, seq_len=16, progress=False)
    path = tmp_path / "adapter"
    sm.save_adapter(path)
    sm.save_adapter(path)  # replacing an existing checkpoint works and leaves no temp dirs
    assert sorted(os.listdir(tmp_path)) == ["adapter"]
    # the adapter's two files, and the training data's token ranking (draft_vocab)
    assert sorted(os.listdir(path)) == [
        "adapter.json", "adapter.safetensors", "draft_vocab.safetensors"
    ]  # fmt: skip
    meta = json.loads((path / "adapter.json").read_text())
    assert meta["options"]["exit_layer"] == 2 and meta["options"]["max_draft_tokens"] == 4
    assert meta["parameters"] == sum(p.numel() for p in adapter_of(sm.graph_module).parameters())

    loaded = rewrite.apply(model, "kangaroo", adapter=path)  # options come from the checkpoint
    assert loaded.options == sm.options.__class__(**{**vars(sm.options), "adapter": str(path)})
    a, b = adapter_of(sm.graph_module).state_dict(), adapter_of(loaded.graph_module).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = torch.tensor([[5, 6, 7]])
    out_a = sm.generate(prompt, max_new_tokens=30)
    out_b = loaded.generate(prompt, max_new_tokens=30)
    assert torch.equal(out_a, out_b)
    assert sm.last_metrics.accepted_per_verify == loaded.last_metrics.accepted_per_verify
    # explicit options override the checkpoint's, except a different exit layer
    shorter = rewrite.apply(model, "kangaroo", adapter=path, max_draft_tokens=2)
    assert shorter.options.max_draft_tokens == 2
    with pytest.raises(ValueError, match=r"exit_layer: 1 does not match .* after layer 2"):
        rewrite.apply(model, "kangaroo", adapter=path, exit_layer=1)


def test_loading_refuses_another_model_and_bad_files(tmp_path):
    model = tiny_model("llama", layers=4)
    path = tmp_path / "a"
    rewrite.apply(model, "kangaroo", exit_layer=1).save_adapter(path)
    other = tiny_model("llama", layers=4, head_dim=4)
    with pytest.raises(ValueError, match=r"adapter: .* was trained for another model: head_dim=8"
                       ) as info:  # fmt: skip
        rewrite.apply(other, "kangaroo", adapter=path)
    assert isinstance(info.value, PassError)  # raised inside the pipeline: with pass context
    with pytest.raises(ValueError, match=r"adapter: .* is not an adapter checkpoint"):
        rewrite.apply(model, "kangaroo", adapter=tmp_path / "missing")
    (path / "adapter.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"adapter: .*adapter.json is not valid JSON"):
        rewrite.apply(model, "kangaroo", adapter=path)


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_layers", "expected"), [(2, 1), (4, 1), (16, 1), (17, 2), (32, 2), (40, 3), (80, 5)]
)
def test_default_exit_layer_rule(num_layers, expected):
    assert default_kangaroo_exit_layer(num_layers) == expected


def test_defaults_are_the_papers():
    o = rewrite.apply(tiny_model("llama", layers=4), "kangaroo").options
    assert (o.exit_layer, o.max_draft_tokens, o.confidence_threshold) == (1, 6, 0.6)


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("exit_layer", 0, r"an integer 1\.\.3"),
        ("exit_layer", 4, r"an integer 1\.\.3"),
        ("exit_layer", 1.5, r"an integer 1\.\.3"),
        ("exit_layer", "2", r"an integer 1\.\.3"),
        ("max_draft_tokens", 0, r"an integer >= 1"),
        ("max_draft_tokens", 2.0, r"an integer >= 1"),
        ("max_draft_tokens", True, r"an integer >= 1"),
        ("confidence_threshold", -0.1, r"a number in \[0, 1\)"),
        ("confidence_threshold", 1.0, r"a number in \[0, 1\)"),
        ("confidence_threshold", float("nan"), r"a number in \[0, 1\)"),
        ("confidence_threshold", "0.5", r"a number in \[0, 1\)"),
        ("confidence_threshold", True, r"a number in \[0, 1\)"),
        ("max_cache_len", 1, r"an integer >= 2"),
        ("fuse_layers", 1, r"True or False"),
        ("adapter", 123, r"a checkpoint directory"),
    ],
)
def test_options_are_validated(option, value, allowed):
    message = rf"{option}: {re.escape(repr(value))} is invalid; allowed: {allowed}"
    with pytest.raises(ValueError, match=message):
        rewrite.apply(tiny_model("llama", layers=4), "kangaroo", **{option: value})


def test_unknown_option_lists_kangaroo_options():
    with pytest.raises(ValueError, match=r"'gamma' is not an option.*max_draft_tokens"):
        rewrite.apply(tiny_model("llama", layers=4), "kangaroo", gamma=3)
