"""Vocabulary-subset drafting (``draft_vocab=N``): the subset head, its ranking, losslessness.

The drafter's LM head computes N rows only (``leapfx.modules.draft_vocab``); verification is
the full head, so greedy output stays HF's and sampling stays HF's distribution (the draft q is
zero off the subset, which rejection sampling handles exactly).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.modules.draft_vocab import SubsetLMHead
from leapfx.parts.draft_vocab import RANKING_FILE, read_ranking, write_ranking
from leapfx.passes.draft_vocab import token_ranking
from leapfx.runtime.masks import masks_for
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from, sample_counts
from tests.greedy_check import hf_greedy
from tests.test_eagle_lossless import _spy_rounds as eagle_spy
from tests.test_kangaroo import _spy_rounds as kangaroo_spy
from tests.test_kangaroo_lossless import (
    TEMPERATURE,
    TOP_K,
    TOP_P,
    _exact_distribution,
    check_chain_rounds,
)
from tests.test_lossless import _prompt, model_specs


def test_subset_head_logits_equal_the_full_heads_on_the_subset_rows():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True).double()
    hidden = torch.randn(2, 3, 16, dtype=torch.float64)
    indices = torch.tensor([7, 0, 49, 3, 21])
    sub = SubsetLMHead.from_head(head, indices)(hidden)  # [2, 3, 50]
    full = head(hidden)
    assert sub.shape == full.shape
    torch.testing.assert_close(sub[..., indices], full[..., indices], rtol=0, atol=1e-12)
    off = torch.ones(50, dtype=torch.bool)
    off[indices] = False
    assert torch.isneginf(sub[..., off]).all()
    # the argmax over the subset, mapped back to full-vocabulary ids
    assert torch.equal(sub.argmax(-1), indices[full[..., indices].argmax(-1)])


def test_the_kernel_subset_head_computes_the_modules_logits_and_follows_a_new_ranking():
    """KernelSubsetHead (the cpu_kernels lowering's) equals SubsetLMHead, and after
    set_ranking (a fit's new ranking, written in place) it computes the new subset's."""
    from leapfx.kernels import cpu
    from leapfx.modules.draft_vocab import KernelSubsetHead

    if not cpu.available():
        pytest.skip("the leapfx_cpu kernels did not build here")
    torch.manual_seed(0)
    head = torch.nn.Linear(24, 70, bias=True)
    module = SubsetLMHead.from_head(head, torch.tensor([7, 0, 69, 3, 21, 40, 41, 5, 9, 11,
                                                        12, 13, 14, 15, 16, 17, 18]))  # fmt: skip
    kernel = KernelSubsetHead(module)
    with torch.no_grad():
        for shape in ((1, 1, 24), (2, 3, 24)):
            hidden = torch.randn(shape)
            want, got = module(hidden), kernel(hidden)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        module.set_ranking(head, torch.arange(50, 67))
        hidden = torch.randn(1, 1, 24)
        got = kernel(hidden)
    torch.testing.assert_close(got[..., 50:67], head(hidden)[..., 50:67], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(got[..., :50]).all()


def test_the_graphs_draft_logits_are_the_full_heads_on_the_subset():
    """The head stage with draft_vocab computes the full head stage's logits on the subset."""
    model = tiny_model("llama", layers=3, vocab=40, dtype=torch.float64, seed=4)
    text = hf_greedy(model, torch.tensor([[3, 5, 7]]), 40)[0]
    sm = rewrite.apply(model, "eagle", cpu_kernels=False)
    sm.fit(text, steps=2, batch_size=2, seq_len=16, progress=False)
    full_gm = sm.graph_module
    sub = rewrite.apply(model, "eagle", cpu_kernels=False, draft_vocab=9)
    sub.graph_module.eagle_head.load_state_dict(full_gm.eagle_head.state_dict())
    sub.graph_module.draft_vocab_head.set_ranking(model.lm_head, full_gm.meta[
        "leapfx.token_ranking"][:9])  # fmt: skip
    ids = text[None, :12]
    pos = torch.arange(12)[None]
    masks = masks_for("sdpa", ["full_attention"], 0, 12, window=None, dtype=torch.float64,
                      device="cpu")  # fmt: skip
    with torch.no_grad():
        a = full_gm(ids, pos, masks, None)["eagle_logits"]
        b = sub.graph_module(ids, pos, masks, None)["eagle_logits"]
    idx = sub.graph_module.draft_vocab_head.indices
    torch.testing.assert_close(b[..., idx], a[..., idx], rtol=0, atol=1e-12)
    assert torch.isneginf(b).sum() == 12 * (40 - 9)


def test_token_ranking_is_by_frequency_then_id():
    ranking = token_ranking(torch.tensor([3, 1, 3, 1, 2, 3]), 6)
    assert ranking.tolist() == [3, 1, 2, 0, 4, 5]
    with pytest.raises(ValueError, match="vocab_size is 3"):
        token_ranking(torch.tensor([5]), 3)


@settings(max_examples=examples(40, 150), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_subset_drafting_greedy_identical_to_hf(spec, data):
    model = tiny_model(**spec)
    prompt = _prompt(data, spec["vocab"])
    recipe = data.draw(st.sampled_from(["eagle", "kangaroo"]), label="recipe")
    options = dict(
        max_draft_tokens=data.draw(st.integers(1, 6), label="d"),
        confidence_threshold=data.draw(
            st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True)), label="threshold"
        ),
        draft_vocab=data.draw(st.integers(1, spec["vocab"]), label="draft_vocab"),
    )
    if recipe == "kangaroo":
        options["exit_layer"] = data.draw(st.integers(1, spec["layers"] - 1), label="exit")
    max_new = data.draw(st.integers(1, 20), label="max_new_tokens")
    sm = rewrite.apply(model, recipe, **options)
    spy = eagle_spy if recipe == "eagle" else kangaroo_spy
    trained = data.draw(st.booleans(), label="trained")
    check_chain_rounds(sm, model, prompt, max_new, options, spy, trained=trained)


# Two drafts a round, no confidence stop, for each drafter
SAMPLING_OPTIONS = {
    "eagle": {"max_draft_tokens": 2, "confidence_threshold": 0.0},
    "kangaroo": {"max_draft_tokens": 2, "confidence_threshold": 0.0, "exit_layer": 1},
    "m2r2": {"num_speculations": 2, "fast_layers": 1},
}


@pytest.mark.parametrize("recipe", ["eagle", "kangaroo", "m2r2"])
def test_subset_drafting_samples_the_target_distribution(recipe):
    """Chi-square of 3000 sampled 4-token continuations against HF's exact distribution, with a
    draft vocabulary of 2 of the 4 tokens: drafts never propose the other two, which the
    target still emits (as corrections)."""
    vocab, length = 4, 4
    model = tiny_model("llama", layers=3, vocab=vocab, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # a flatter target: every token is likely
    prompt = torch.tensor([[1, 3, 2]])
    exact = _exact_distribution(model, prompt, vocab, length)
    sm = rewrite.apply(model, recipe, draft_vocab=2, **SAMPLING_OPTIONS[recipe])
    tokens = torch.tensor([2, 0, 2, 0, 2, 1, 3, 2] * 8)  # ranking: 2, 0, then 1, 3
    sm.fit(tokens, steps=3, batch_size=2, seq_len=16, lr=1e-2, progress=False)
    assert sm.graph_module.draft_vocab_head.indices.tolist() == [2, 0]
    n = 3000
    counts, rejections, drafted = sample_counts(
        sm, prompt, exact, length, n, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P
    )
    assert 0 < rejections < drafted
    assert_sampled_from(counts, exact, n)
    # the continuations hold tokens 1 and 3, which were never drafted
    assert any(1 in c or 3 in c for c, k in counts.items() if k)


def test_ranking_is_saved_and_old_parts_still_load(tmp_path):
    model = tiny_model("llama", layers=3, vocab=32, seed=2)
    prompt = torch.tensor([[4, 8, 1]])
    text = hf_greedy(model, prompt, 60)[0]
    sm = rewrite.apply(model, "eagle", max_draft_tokens=3)
    sm.fit(text, steps=2, batch_size=2, seq_len=16, progress=False)
    sm.save_parts(tmp_path / "p")
    ranking = read_ranking(tmp_path / "p")
    assert torch.equal(ranking, token_ranking(text, 32))
    # any N chosen at apply time; draft_vocab is not taken from the parts
    small = rewrite.apply(model, "eagle", parts=tmp_path / "p", draft_vocab=5)
    assert torch.equal(small.graph_module.draft_vocab_head.indices, ranking[:5])
    plain = rewrite.apply(model, "eagle", parts=tmp_path / "p")
    assert not hasattr(plain.graph_module, "draft_vocab_head")
    ref = hf_greedy(model, prompt, 20)
    assert torch.equal(small.generate(prompt, max_new_tokens=20), ref)
    # saving a loaded model again keeps the ranking
    plain.save_parts(tmp_path / "again")
    assert torch.equal(read_ranking(tmp_path / "again"), ranking)
    # parts written before the ranking existed: load as before, refuse draft_vocab
    (tmp_path / "p" / RANKING_FILE).unlink()
    old = rewrite.apply(model, "eagle", parts=tmp_path / "p")
    assert torch.equal(old.generate(prompt, max_new_tokens=20), ref)
    with pytest.raises(ValueError, match="draft_vocab: 5 needs a token ranking"):
        rewrite.apply(model, "eagle", parts=tmp_path / "p", draft_vocab=5)


def test_kangaroo_adapter_saves_its_ranking(tmp_path):
    model = tiny_model("qwen2", layers=3, vocab=32, seed=5)
    tokens = torch.randint(0, 32, (80,), generator=torch.Generator().manual_seed(0))
    sm = rewrite.apply(model, "kangaroo", exit_layer=1, draft_vocab=7)
    sm.fit(tokens, steps=2, batch_size=2, seq_len=16, progress=False)
    sm.save_adapter(tmp_path / "a")
    meta = json.loads((tmp_path / "a" / "adapter.json").read_text())
    assert meta["options"]["draft_vocab"] == 7
    loaded = rewrite.apply(model, "kangaroo", adapter=tmp_path / "a", draft_vocab=3)
    assert torch.equal(loaded.graph_module.draft_vocab_head.indices,
                       token_ranking(tokens, 32)[:3])  # fmt: skip


def test_m2r2_parts_save_their_ranking_and_draft_over_the_subset(tmp_path):
    """M2R2's fit measures the ranking, its parts keep it (not draft_vocab: a decoding choice),
    and drafts over the subset stay lossless, greedy."""
    model = tiny_model("llama", layers=4, vocab=32, seed=5)
    prompt = torch.tensor([[4, 8, 1]])
    text = hf_greedy(model, prompt, 60)[0]
    sm = rewrite.apply(model, "m2r2", fast_layers=2, draft_vocab=6)
    sm.fit(text, steps=3, batch_size=2, seq_len=16, lr=1e-2, ce_target="model", progress=False)
    ranking = token_ranking(text, 32)
    assert torch.equal(sm.graph_module.draft_vocab_head.indices, ranking[:6])
    sm.save_parts(tmp_path / "p")
    assert torch.equal(read_ranking(tmp_path / "p"), ranking)
    meta = json.loads((tmp_path / "p" / "adapter.json").read_text())
    assert "draft_vocab" not in meta["options"]
    loaded = rewrite.apply(model, "m2r2", parts=tmp_path / "p", draft_vocab=3)
    assert torch.equal(loaded.graph_module.draft_vocab_head.indices, ranking[:3])
    ref = hf_greedy(model, prompt, 30)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=30), ref)
    assert loaded.last_metrics.drafted_tokens > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "draft_vocab: 0 is invalid; allowed: None or an integer >= 1"),
        (2.5, "draft_vocab: 2.5 is invalid"),
        (33, "draft_vocab: 33 is invalid; allowed: None (the full head) or an integer in 1..32"),
    ],
)
@pytest.mark.parametrize("recipe", ["eagle", "kangaroo", "m2r2"])
def test_draft_vocab_errors(recipe, value, message):
    model = tiny_model("llama", layers=3, vocab=32)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rewrite.apply(model, recipe, draft_vocab=value)


def test_a_ranking_of_another_vocabulary_is_refused(tmp_path):
    model = tiny_model("llama", layers=3, vocab=32)
    sm = rewrite.apply(model, "eagle")
    sm.fit(torch.arange(32), steps=1, batch_size=1, seq_len=8, progress=False)
    sm.save_parts(tmp_path / "p")
    write_ranking(tmp_path / "p", torch.arange(20))
    with pytest.raises(ValueError, match="ranks 20 ids and this model's vocabulary has 32"):
        rewrite.apply(model, "eagle", parts=tmp_path / "p", draft_vocab=4)


@pytest.mark.slow
def test_bench_adds_the_vocabulary_subset_row(tmp_path):
    """``leapfx bench --recipe eagle`` with parts that hold a ranking, on a vocabulary large
    enough: leapfx_eagle_vocab beside leapfx_eagle, then the head composed with prompt
    lookup (leapfx_eagle_lookup), all lossless."""
    from leapfx.bench.systems import EAGLE_DRAFT_VOCAB
    from leapfx.cli import main
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    vocab = 4 * EAGLE_DRAFT_VOCAB  # the byte tokenizer uses the first 259 ids
    model = tiny_model("llama", layers=3, vocab=vocab, eos=tok.eos_token_id, heads=2, head_dim=8)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    sm = rewrite.apply(model, "eagle", max_draft_tokens=3)
    sm.fit(torch.randint(0, 259, (200,)), steps=2, batch_size=2, seq_len=16, progress=False)
    sm.save_parts(tmp_path / "parts")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tmp_path / "ckpt"), "--recipe", "eagle", "--prompts", "1",
            "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--quiet",
            "--eagle-parts", str(tmp_path / "parts"), "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    assert list(rows)[-3:] == ["leapfx_eagle", "leapfx_eagle_vocab", "leapfx_eagle_lookup"]
    assert rows["leapfx_eagle_vocab"]["identical_to_greedy"]
    assert rows["leapfx_eagle_lookup"]["identical_to_greedy"]


@pytest.mark.slow
def test_bench_adds_kangaroo_and_m2r2_subset_rows(tmp_path):
    """``leapfx bench --recipe kangaroo,m2r2`` with parts that hold a ranking, on a vocabulary
    large enough: each drafter over the subset and composed with prompt lookup, lossless."""
    from leapfx.bench.systems import EAGLE_DRAFT_VOCAB
    from leapfx.cli import main
    from leapfx.train.data import byte_tokenizer

    tok = byte_tokenizer()
    vocab = 4 * EAGLE_DRAFT_VOCAB
    model = tiny_model("llama", layers=4, vocab=vocab, eos=tok.eos_token_id, heads=2, head_dim=8)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    data = torch.randint(0, 259, (200,), generator=torch.Generator().manual_seed(0))
    fit = {"steps": 2, "batch_size": 2, "seq_len": 16, "progress": False}
    kangaroo = rewrite.apply(model, "kangaroo", exit_layer=1)
    kangaroo.fit(data, **fit)
    kangaroo.save_adapter(tmp_path / "adapter")
    m2r2 = rewrite.apply(model, "m2r2", fast_layers=2)
    m2r2.fit(data, **fit)
    m2r2.save_parts(tmp_path / "m2r2")
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(tmp_path / "ckpt"), "--recipe", "kangaroo,m2r2",
            "--prompts", "1", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
            "--quiet", "--adapter", str(tmp_path / "adapter"), "--parts", str(tmp_path / "m2r2"),
            "--kangaroo-exit-layer", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())}
    added = ["leapfx_kangaroo_vocab", "leapfx_kangaroo_lookup", "leapfx_m2r2_vocab",
             "leapfx_m2r2_lookup"]  # fmt: skip
    assert set(added) <= set(rows)
    assert all(rows[name]["identical_to_greedy"] for name in added)
