"""Batched ``generate``: [B, S] prompts with left padding, per-row acceptance over one cache.

Greedy rows are checked against HF's ``generate`` on the same padded batch (hypothesis over
architectures, row lengths, recipes and budgets; a divergence must be a measured float tie, as
everywhere else); sampled rows against each row's exact distribution; the ragged cache, the
masks and the batch policy on their own.
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import StoppingCriteriaList

from leapfx import rewrite
from leapfx.runtime import model as model_runtime
from leapfx.runtime import runner as runner_runtime
from leapfx.runtime.adaptive import PRIOR_SLOPE, PROBE_EVERY
from leapfx.runtime.batch import BatchPolicy
from leapfx.runtime.decode import decode_request
from leapfx.runtime.masks import AttentionLayout, column_masks, row_masks
from leapfx.runtime.rows import RowKVCache, row_cache_for
from leapfx.runtime.runner import StageRunner
from tests.conftest import examples, tiny_model
from tests.distribution_check import assert_sampled_from
from tests.greedy_check import assert_greedy_equal
from tests.test_lossless import model_specs
from tests.test_sampling_e2e import TEMPERATURE, TOP_K, TOP_P, VOCAB, _exact_distribution

PAD = 0  # tiny_model's pad_token_id

# (recipe, options): every recipe that batches, with the options that change how it drafts.
BATCHED = [
    ("autoregressive", {}),
    ("lookup", {"num_speculations": 4, "max_ngram": 2}),
    ("auto", {"num_speculations": 4}),
    ("layerskip", {"num_speculations": 3}),
    ("layerskip", {"num_speculations": 3, "lookup": True}),
    ("swift", {"num_speculations": 3}),
    ("kangaroo", {"max_draft_tokens": 3}),
    ("eagle", {"max_draft_tokens": 3, "confidence_threshold": 0.0}),
    ("eagle", {"max_draft_tokens": 3, "lookup": True}),
]


def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids and attention_mask [B, max len] of ``rows``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r)
        mask[b, width - len(r) :] = 1
    return ids, mask


def _new_tokens(out: torch.Tensor, b: int, width: int, eos: int | None) -> list[int]:
    """Row b's new tokens, up to and including its first EOS (the pad fill after it cut)."""
    new = out[b, width:].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos) + 1]
    return new


def _options(recipe: str, options: dict, layers: int, data) -> dict:
    options = dict(options)
    if recipe in ("layerskip", "kangaroo"):
        options["exit_layer"] = data.draw(st.integers(1, layers - 1), label="exit_layer")
    if recipe == "swift":
        skip = data.draw(st.sets(st.integers(1, layers - 1), min_size=1, max_size=layers - 1),
                         label="skip_layers")  # fmt: skip
        options["skip_layers"] = tuple(sorted(skip))
    return options


def _check_rows(model, sm, rows: list[list[int]], max_new: int) -> None:
    ids, mask = _batch(rows)
    width = ids.shape[1]
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
    ours = sm.generate(ids, attention_mask=mask, max_new_tokens=max_new)
    assert ours.shape[0] == len(rows) and torch.equal(ours[:, :width], ids)
    eos = model.generation_config.eos_token_id
    for b, r in enumerate(rows):
        mine = torch.tensor([r + _new_tokens(ours, b, width, eos)])
        theirs = torch.tensor([r + _new_tokens(ref, b, width, eos)])
        assert_greedy_equal(model, mine, theirs, len(r))
    metrics = sm.last_metrics
    assert metrics.batch_size == len(rows)
    new = [_new_tokens(ours, b, width, eos) for b in range(len(rows))]
    assert metrics.new_tokens == sum(len(t) for t in new)


def _draw_batch(spec: dict, data, *, length: int, rows: int):
    """A model of ``spec``, a batching recipe applied to it, up to ``rows`` prompts of up to
    ``length`` tokens and a budget of up to ``length`` new tokens, drawn."""
    model = tiny_model(**spec)
    prompts = data.draw(
        st.lists(st.lists(st.integers(0, spec["vocab"] - 1), min_size=1, max_size=length),
                 min_size=1, max_size=rows),
        label="rows",
    )  # fmt: skip
    recipe, options = data.draw(st.sampled_from(BATCHED), label="recipe")
    options = _options(recipe, options, spec["layers"], data)
    max_new = data.draw(st.integers(1, length), label="max_new_tokens")
    return model, rewrite.apply(model, recipe, **options), prompts, max_new


@settings(max_examples=examples(40, 300), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_batched_greedy_equals_hf_on_a_padded_batch(spec, data):
    model, sm, rows, max_new = _draw_batch(spec, data, length=16, rows=4)
    _check_rows(model, sm, rows, max_new)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kernels", [True, False])
def test_batched_rows_stop_on_their_own_and_leave_the_batch(attn, kernels):
    # eos 7 is common under this seed: rows stop at different steps, the batch shrinks (the
    # cache keeps the live rows) and the stopped rows are filled with the pad token.
    model = tiny_model("llama", layers=4, vocab=16, eos=7, seed=3, attn=attn)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3)
    sm.use_cpu_kernels(kernels)
    rows = [[1, 2, 3, 4, 5, 6], [9, 8], [3, 3, 3, 3], [11, 12, 13, 14, 15, 1, 2, 3, 4]]
    ids, mask = _batch(rows)
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=20)
    ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(out, ref)
    lengths = [len(_new_tokens(out, b, ids.shape[1], 7)) for b in range(len(rows))]
    assert len(set(lengths)) > 1, f"the rows should stop at different steps: {lengths}"
    assert sm.last_metrics.new_tokens == sum(lengths)


def test_a_left_padded_row_and_a_batch_of_one_equal_the_unbatched_decode():
    model = tiny_model("qwen2", layers=3, vocab=64, seed=5, sliding_window=4)
    sm = rewrite.apply(model, "lookup", num_speculations=3)
    row = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = sm.generate(torch.tensor([row]), max_new_tokens=10)
    padded = sm.generate(
        torch.tensor([[PAD] * 3 + row]), attention_mask=torch.tensor([[0] * 3 + [1] * 8]),
        max_new_tokens=10,
    )  # fmt: skip
    assert sm.last_metrics.batch_size == 1
    assert torch.equal(padded[:, 3:], plain)
    batch = sm.generate(*_batch([row, [9, 9, 9]]), max_new_tokens=10)
    assert torch.equal(batch[:1], plain)


@pytest.mark.parametrize("recipe", ["layerskip", "lookup", "eagle"])
def test_batched_sampling_matches_each_rows_distribution(recipe, monkeypatch):
    # Two rows of different lengths (the second left-padded): each row's 3-token continuations
    # must follow its own exact distribution under the warpers. Every round drafts (the
    # policy, which chooses by measured time, forced to), so drafts are kept and rejected.
    monkeypatch.setattr(BatchPolicy, "choose", lambda self, size, available, share=1.0: available)
    model = tiny_model("llama", layers=3, vocab=VOCAB, heads=2, kv_heads=1, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    rows = [[1, 4, 2, 1, 4], [2, 1, 4]]
    exact = [_exact_distribution(model, torch.tensor([r]), 3) for r in rows]
    options = {
        "layerskip": {"exit_layer": 1, "num_speculations": 2},
        "lookup": {"max_ngram": 2, "num_speculations": 2},
        "eagle": {"max_draft_tokens": 2, "confidence_threshold": 0.0},
    }[recipe]
    sm = rewrite.apply(model, recipe, **options)
    ids, mask = _batch(rows)
    g = torch.Generator().manual_seed(1234)
    n = 3000
    counts = [dict.fromkeys(e, 0) for e in exact]
    drafted = rejected = 0
    for _ in range(n):
        out = sm.generate(
            ids, attention_mask=mask, do_sample=True, max_new_tokens=3, generator=g,
            temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P,
        )  # fmt: skip
        for b in range(2):
            counts[b][tuple(out[b, ids.shape[1] :].tolist())] += 1
        m = sm.last_metrics
        drafted += m.drafted_tokens
        rejected += m.drafted_tokens - m.accepted_drafts
    assert drafted > 0 and 0 < rejected < drafted  # drafts both kept and rejected
    for b in range(2):
        assert_sampled_from(counts[b], exact[b], n)


def test_batch_refusals_name_what_is_not_supported():
    model = tiny_model("llama", layers=3, vocab=32)
    ids, mask = _batch([[1, 2, 3], [4, 5]])
    sm = rewrite.apply(model, "autoregressive")
    right = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="attention_mask: row 1 is padded on the right"):
        sm.generate(ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask: row 0 has no token"):
        sm.generate(ids, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="streamer: not supported with a batch of 2 rows"):
        sm.generate(ids, attention_mask=mask, max_new_tokens=2, streamer=_Streamer())
    with pytest.raises(ValueError, match=r"stopping_criteria \(_StopAfter\) with a batch of 2"):
        sm.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None,
                    stopping_criteria=StoppingCriteriaList([_StopAfter(5)]))  # fmt: skip
    with pytest.raises(ValueError, match="output_scores/output_logits: not supported with a batch"):
        sm.generate(ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True,
                    output_scores=True)  # fmt: skip
    with pytest.raises(ValueError, match="recipe 'early_exit' .*it is lossy"):
        rewrite.apply(model, "early_exit", exit_layer=1).generate(
            ids, attention_mask=mask, max_new_tokens=2
        )
    out = sm.generate(ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 5) and out.metrics.batch_size == 2
    onnx = rewrite.apply(model, "autoregressive")
    onnx.set_executors(None, "onnxruntime")  # what lower(sm, "onnxruntime") leaves it on
    with pytest.raises(ValueError, match="stages run on 'onnxruntime' .*allowed: one unpadded row"):
        onnx.generate(ids, attention_mask=mask, max_new_tokens=2)


class _Streamer:
    """HF's streamer protocol, recording what it is handed."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())

    def end(self) -> None:
        self.ended += 1


class _StopAfter:
    """A stopping criterion a row at a time (HF's protocol: a bool a row): stop once the
    sequence ends in ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return input_ids[:, -1] == self.token


# processors beyond the replayed warpers, which a batch applies a row at a time
PROCESSORS = [
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 4, "repetition_penalty": 1.2},
    {"suppress_tokens": [3, 5], "begin_suppress_tokens": [7]},
]


@settings(max_examples=examples(20, 150), deadline=None)
@given(spec=model_specs(), data=st.data())
def test_batched_logits_processors_equal_hf_on_a_padded_batch(spec, data):
    model, sm, rows, max_new = _draw_batch(spec, data, length=12, rows=3)
    processors = data.draw(st.sampled_from(PROCESSORS), label="processors")
    ids, mask = _batch(rows)
    kw = dict(attention_mask=mask, max_new_tokens=max_new, **processors)
    ref = model.generate(ids, do_sample=False, **kw)
    ours = sm.generate(ids, **kw)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("recipe", ["autoregressive", "layerskip", "eagle"])
def test_batched_stopping_criteria_stop_each_row_as_hf_does(recipe):
    model = tiny_model("llama", layers=4, vocab=16, seed=3)
    options = {"layerskip": {"exit_layer": 2}, "eagle": {"max_draft_tokens": 3}}.get(recipe, {})
    sm = rewrite.apply(model, recipe, **options)
    rows = [[1, 2, 3, 4, 5, 6], [9, 8], [3, 3, 3, 3], [11, 12, 13, 14, 15, 1, 2, 3, 4]]
    ids, mask = _batch(rows)
    stop = StoppingCriteriaList([_StopAfter(5)])
    # with an EOS set, HF fills a row a criterion stopped with the pad token (without one, its
    # rows decode on to the longest row's end)
    kw = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=PAD, eos_token_id=15)
    ref = model.generate(ids, do_sample=False, stopping_criteria=stop, **kw)
    ours = sm.generate(ids, stopping_criteria=stop, **kw)
    assert torch.equal(ours, ref)
    ends = [out[ids.shape[1] :].tolist() for out in ours]
    assert any(5 in e and e.index(5) < len(e) - 1 for e in ends), "a row should stop early"


def test_a_left_padded_row_streams_what_the_unpadded_row_streams():
    model = tiny_model("llama", layers=3, vocab=64, seed=5)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    row = [5, 6, 7, 5, 6, 7, 5, 6]
    plain, padded = _Streamer(), _Streamer()
    sm.generate(torch.tensor([row]), max_new_tokens=10, streamer=plain)
    sm.generate(torch.tensor([[PAD] * 3 + row]), streamer=padded, max_new_tokens=10,
                attention_mask=torch.tensor([[0] * 3 + [1] * 8]))  # fmt: skip
    assert padded.puts[0] == [PAD] * 3 + row and plain.puts[0] == row  # the prompt first
    flat = [t for put in padded.puts[1:] for t in put]
    assert flat == [t for put in plain.puts[1:] for t in put] and len(flat) == 10
    assert padded.ended == plain.ended == 1


@pytest.mark.parametrize("recipe", ["autoregressive", "lookup", "layerskip", "eagle"])
def test_each_row_of_a_batch_decodes_its_own_request_as_it_would_alone(recipe):
    # One batch whose rows have their own budget, EOS and streamer (what a server batches):
    # each row's tokens are its solo decode's, each streamer ends when its row does.
    model = tiny_model("llama", layers=4, vocab=32, seed=7)
    options = {
        "lookup": {"num_speculations": 3, "max_ngram": 2},
        "layerskip": {"exit_layer": 2, "num_speculations": 3},
        "eagle": {"max_draft_tokens": 3},
    }.get(recipe, {})
    sm = rewrite.apply(model, recipe, **options)
    rows = [[1, 2, 3, 1, 2, 3], [9, 8], [4, 4, 5, 4, 4, 5, 4]]
    budgets, eos = [3, 12, 7], [None, 6, 2]
    solo = [
        sm.generate(torch.tensor([r]), max_new_tokens=m, eos_token_id=e)[0, len(r) :].tolist()
        for r, m, e in zip(rows, budgets, eos, strict=True)
    ]
    ids, mask = _batch(rows)
    pads = [ids.shape[1] - len(r) for r in rows]
    streamers = [_Streamer() for _ in rows]
    requests = [
        decode_request(
            model.generation_config,
            ids.shape[1],
            max_new_tokens=m,
            eos_token_id=e if e is not None else [],
            sampling={"do_sample": False},
            generator=None,
            streamer=s,
        )  # fmt: skip
        for m, e, s in zip(budgets, eos, streamers, strict=True)
    ]
    tokens, metrics = sm._generate_batch(ids, pads, requests)
    assert tokens == solo
    for s, t, r in zip(streamers, tokens, rows, strict=True):
        assert s.ended == 1 and [x for put in s.puts[1:] for x in put] == t
        assert s.puts[0][-len(r) :] == r
    assert metrics.new_tokens == sum(map(len, solo))


@settings(max_examples=examples(15, 100), deadline=None)
@given(data=st.data())
def test_rows_that_join_a_running_batch_decode_as_they_would_alone(data):
    # Continuous batching: requests join between rounds, each with its own budget and EOS, and
    # leave as they finish (or are cancelled); each greedy row equals its solo decode.
    recipe, options = data.draw(st.sampled_from(BATCHED), label="recipe")
    model = tiny_model("llama", layers=4, vocab=32, seed=7)
    options = _options(recipe, options, 4, data)
    sm = rewrite.apply(model, recipe, **options)
    n = data.draw(st.integers(1, 5), label="requests")
    prompts = [data.draw(st.lists(st.integers(0, 31), min_size=1, max_size=10), label="prompt")
               for _ in range(n)]  # fmt: skip
    budgets = [data.draw(st.integers(1, 10), label="budget") for _ in range(n)]
    arrivals = sorted(data.draw(st.integers(0, 6), label="arrival round") for _ in range(n))
    cancel = data.draw(st.sampled_from([None, *range(n)]), label="cancelled")
    solo = [
        sm.generate(torch.tensor([p]), max_new_tokens=m, eos_token_id=6)[0, len(p) :].tolist()
        for p, m in zip(prompts, budgets, strict=True)
    ]
    # a growing cache (as a server's): from 4 columns, doubling as rows need
    grow = data.draw(st.booleans(), label="grow")
    with patch.object(model_runtime, "GROW_FROM", 4):
        decode = sm.batch_decode(max(map(len, prompts)) + max(budgets), grow=grow)
    streamers = [_Streamer() for _ in range(n)]
    waiting, rounds = list(range(n)), 0
    while waiting or decode.rows:
        while waiting and arrivals[waiting[0]] <= rounds:
            i = waiting.pop(0)
            request = decode_request(model.generation_config, len(prompts[i]),
                                     max_new_tokens=budgets[i], eos_token_id=6,
                                     sampling={"do_sample": False}, generator=None,
                                     streamer=streamers[i])  # fmt: skip
            decode.admit(torch.tensor([prompts[i]]), request, i)
        if cancel is not None and rounds == 1:
            decode.cancel(cancel)
        if decode.rows:
            decode.round()
        rounds += 1
    for i in range(n):
        tokens = decode.finished.pop(i)
        assert streamers[i].ended == 1 and [t for p in streamers[i].puts[1:] for t in p] == tokens
        if i == cancel:
            assert tokens == solo[i][: len(tokens)]  # a prefix: it stopped when cancelled
        else:
            assert tokens == solo[i]
    assert not decode.finished and decode.runner.cache.batch_size == 0


def test_a_growing_batch_cache_grows_as_rows_need_and_decodes_the_same():
    model = tiny_model("llama", layers=3, vocab=32, seed=5)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    solo = [sm.generate(torch.tensor([p]), max_new_tokens=12, eos_token_id=[])[0, len(p) :]
            for p in prompts]  # fmt: skip
    with patch.object(model_runtime, "GROW_FROM", 4):
        decode = sm.batch_decode(6 + 12, grow=True)
    assert decode.runner.cache.max_len == 4 and decode.runner.cache.grow_to >= 18
    for i, p in enumerate(prompts):
        request = decode_request(
            model.generation_config, len(p), max_new_tokens=12, eos_token_id=[],
            sampling={"do_sample": False}, generator=None,
        )  # fmt: skip
        decode.admit(torch.tensor([p]), request, i)
        decode.round()
    while decode.rows:
        decode.round()
    assert 8 <= decode.runner.cache.max_len <= decode.runner.cache.grow_to
    assert [decode.finished[i] for i in range(3)] == [t.tolist() for t in solo]


def test_row_cache_writes_each_row_at_its_own_length_and_crops_per_row():
    cache = RowKVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_len=8, batch_size=3)
    for layer in range(2):
        cache.update(torch.ones(3, 1, 2, 1), torch.ones(3, 1, 2, 1), layer)
    cache.crop_rows([1, 2, 0])
    keys, _ = cache.update(torch.full((3, 1, 1, 1), 5.0), torch.zeros(3, 1, 1, 1), 0)
    assert cache.rows == [[2, 3, 1], [1, 2, 0]]
    assert keys.shape[2] == 3
    assert keys[:, 0, :, 0].tolist() == [[1, 5, 0], [1, 1, 5], [5, 1, 0]]
    cache.keep([2, 0])
    assert cache.rows == [[1, 2], [0, 1]] and cache.keys[0].shape[0] == 2
    assert cache.keys[0][:, 0, :2, 0].tolist() == [[5, 1], [1, 5]]
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.update(torch.zeros(2, 1, 7, 1), torch.zeros(2, 1, 7, 1), 0)


@settings(max_examples=examples(60, 300), deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
    n=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(1, 6)),
)
def test_row_masks_show_each_query_its_own_rows_columns(rows, n, window):
    # row b: pad p_b, newest column s_b >= p_b. Query i (column s_b + i) sees column j iff
    # p_b <= j <= s_b + i (and s_b + i - j < window for sliding layers).
    pads = [p for p, _ in rows]
    starts = [p + s for p, s in rows]
    layout = AttentionLayout("eager", ("full_attention", "sliding_attention"), window,
                             torch.float32, torch.device("cpu"))  # fmt: skip
    masks = row_masks(layout, starts, pads, n)
    end = max(starts) + n
    for kind, mask in masks.items():
        assert mask.shape[0] in (1, len(rows)) and mask.shape[1:] == (1, n, end)
        mask = mask.expand(len(rows), 1, n, end)  # aligned unpadded rows: one broadcast mask
        for b, (p, s) in enumerate(zip(pads, starts, strict=True)):
            for i in range(n):
                for j in range(end):
                    want = p <= j <= s + i
                    if kind == "sliding_attention" and window is not None:
                        want = want and s + i - j < window
                    assert (mask[b, 0, i, j] == 0).item() == want


@settings(max_examples=examples(40, 200), deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
    n=st.integers(1, 4),
    window=st.one_of(st.none(), st.integers(1, 6)),
    impl=st.sampled_from(["sdpa", "eager"]),
    slack=st.integers(0, 3),
)
def test_a_compiled_stages_column_masks_show_each_query_what_row_masks_do(
    rows, n, window, impl, slack
):
    # A compiled stage over a batch builds its masks in the graph from each query's cache
    # column and its row's first real column, over the whole buffer: a real query sees what
    # the eager runner's row_masks shows it and no column past its own; a padding query (a
    # prefill's) sees itself alone, so no softmax row is empty.
    pads = [p for p, _ in rows]
    starts = [p + s for p, s in rows]
    layout = AttentionLayout("eager", ("full_attention", "sliding_attention"), window,
                             torch.float32, torch.device("cpu"))  # fmt: skip
    want = row_masks(layout, starts, pads, n)
    end = max(starts) + n
    columns = torch.tensor(starts)[:, None] + torch.arange(n)
    got = column_masks(columns, torch.tensor(pads), end + slack, kinds=layout.kinds, impl=impl,
                       window=window, dtype=torch.float32)  # fmt: skip
    for kind in dict.fromkeys(layout.kinds):
        seen = got[kind] if impl == "sdpa" else got[kind] == 0
        assert seen.shape == (len(rows), 1, n, end + slack)
        expected = (want[kind] == 0).expand(len(rows), 1, n, end)
        assert torch.equal(seen[..., :end], expected)
        assert not seen[..., end:].any()
    prefill = column_masks(
        torch.arange(4)[None],
        torch.tensor([2]),
        4,
        kinds=["full_attention"],
        impl="sdpa",
        window=None,
        dtype=torch.float32,
    )["full_attention"]
    assert prefill[0, 0].tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]


@pytest.mark.parametrize("recipe", ["autoregressive", "kangaroo"])
@pytest.mark.parametrize("kernels", [True, False])
def test_a_prefill_a_row_at_a_time_equals_the_padded_prefill(recipe, kernels, monkeypatch):
    # Heavily padded prompts are prefilled one row at a time over the row's own tokens: the same
    # first-token logits and the same cache on every real column as one call over the padded
    # batch (kangaroo: its adapter's cache layer too).
    model = tiny_model("llama", layers=4, vocab=64, seed=11)
    sm = rewrite.apply(model, recipe, **({"exit_layer": 2} if recipe == "kangaroo" else {}))
    sm.use_cpu_kernels(kernels)
    rows = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3], [9, 8, 7, 6]]
    ids, mask = _batch(rows)
    pads = [ids.shape[1] - len(r) for r in rows]
    stages = sm._executors or sm.stages.modules
    results = []
    for share in (0.0, 2.0):  # every padded batch a row at a time; never
        monkeypatch.setattr(runner_runtime, "ROW_PREFILL_PADDING", share)
        cache = row_cache_for(model, 32, len(rows), extra_layers=sm.recipe.extra_cache_layers)
        runner = StageRunner(stages, cache, sm._layout, pads)
        with torch.inference_mode():
            logits = runner.prefill("full", ids)["logits"]
        results.append((logits[:, -1], cache))
    (row_logits, row_cache), (padded_logits, padded_cache) = results
    torch.testing.assert_close(row_logits, padded_logits, rtol=1e-5, atol=1e-5)
    assert row_cache.rows == padded_cache.rows and row_cache.lengths == padded_cache.lengths
    for layer, ends in enumerate(padded_cache.rows):
        for b, pad in enumerate(pads):
            for got, want in ((row_cache.keys, padded_cache.keys),
                              (row_cache.values, padded_cache.values)):  # fmt: skip
                torch.testing.assert_close(got[layer][b, :, pad : ends[b]],
                                           want[layer][b, :, pad : ends[b]],
                                           rtol=1e-5, atol=1e-5)  # fmt: skip


def test_batched_kernel_attention_reads_each_rows_own_span(monkeypatch):
    # with the CPU kernels, a batch's decode and verify calls attend through
    # leapfx_cpu::attention_rows over RowKVCache.spans (ragged rows), and the rows still equal
    # HF's padded batch
    model = tiny_model("llama", layers=3, vocab=64, seed=2)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3)
    sm.use_cpu_kernels(True)
    queries = []
    spans = RowKVCache.spans

    def counting(self, layer_idx, n):
        queries.append(n)
        return spans(self, layer_idx, n)

    monkeypatch.setattr(RowKVCache, "spans", counting)
    _check_rows(model, sm, [[1, 2, 3, 1, 2, 3, 1], [4, 5], [6, 7, 8, 9]], 12)
    assert 1 in queries and max(queries) > 1  # plain steps and verify passes


def test_batch_policy_stops_drafting_where_big_verifies_do_not_pay():
    # Batch 1: a verify of d + 1 tokens costs about one step, and 2 of 3 drafts are kept: it
    # drafts. Batch 8: a verify costs (d + 1) steps (compute-bound): it stops drafting (one
    # probe a PROBE_EVERY rounds), and the batch-1 costs are not forgotten.
    policy = BatchPolicy(max_drafts=3)
    for size, cost in ((1, lambda d: 1.0 + 0.05 * d), (8, lambda d: 1.0 + 1.0 * d)):
        for _ in range(60):
            d = policy.choose(size, 3)
            kept = [min(d, 2)] * size
            policy.observe(size, d, [(d, k) for k in kept] if d else [], cost(d))
    assert policy.choose(1, 3) > 0
    choices = [policy.choose(8, 3) for _ in range(PROBE_EVERY)]
    assert choices.count(0) >= PROBE_EVERY - 1


def test_a_batch_size_rows_leave_for_starts_from_its_neighbours_costs():
    # At 8 rows a verify of d + 1 tokens costs 1 + 0.5 d plain steps, and drafts are kept half
    # the time: drafting does not pay. A row finishes: at 7 rows, with only plain steps timed,
    # the policy reads 8 rows' line, not the prior (a draft 0.1 of a step), so it does not
    # spend 7 rows' first rounds drafting.
    policy = BatchPolicy(max_drafts=3)
    for d in (0, 0, 1, 1, 2, 2, 3, 3):  # each length's first round is not counted
        policy.observe(8, d, [(d, d // 2)] * 8 if d else [], 1.0 + 0.5 * d)
    for _ in range(2):
        policy.observe(7, 0, [], 0.95)
    assert policy.at(7).prior_slope == pytest.approx(0.5)
    assert policy.choose(7, 3) == 0
    fresh = BatchPolicy(max_drafts=3)  # nothing measured anywhere: the prior
    assert fresh.at(7).prior_slope == PRIOR_SLOPE


def test_batch_policy_weighs_the_drafts_by_the_rows_that_have_them():
    # A verify of d + 1 tokens costs 1 + 0.3 d steps at batch 4, and a drafting row keeps 2 of
    # 3 drafts: worth it when every row drafts (about 2.5 tokens a row for 1.9 steps), not when
    # one row of four has a match (the other three pay the same verify for one token each).
    policy = BatchPolicy(max_drafts=3)
    for _ in range(60):
        d = policy.choose(4, 3)
        policy.observe(4, d, [(d, min(d, 2))] * 4 if d else [], 1.0 + 0.3 * d)
    assert policy.choose(4, 3, share=1.0) > 0
    choices = [policy.choose(4, 3, share=0.25) for _ in range(PROBE_EVERY)]
    assert choices.count(0) >= PROBE_EVERY - 1
    assert policy.choose(4, 3, share=0.0) == 0


@pytest.mark.parametrize("kernels", [True, False])
def test_batched_layerskip_verifies_the_drafts_exit_states_with_its_verify_stage(
    kernels, monkeypatch
):
    # Every round drafts (the policy forced to): a round the draft stage drafted whole is
    # verified by the verify stage over the draft's exit states (the upper layers on d + 1
    # tokens, the lower ones on the last draft only), rows at their own columns; the rows
    # equal HF's padded batch, and lookup rounds (copies) still take the full verify.
    model = tiny_model("llama", layers=4, vocab=32, seed=8)
    monkeypatch.setattr(BatchPolicy, "choose", lambda self, size, available, share=1.0: available)
    splits = []
    verify = StageRunner.verify

    def counting(self, ids, exit_hidden, starts):
        splits.append(exit_hidden.shape)
        return verify(self, ids, exit_hidden, starts)

    monkeypatch.setattr(StageRunner, "verify", counting)
    rows = [[1, 2, 3, 4, 5, 6], [9, 8], [3, 3, 3, 3, 7], [11, 12]]
    for lookup in (False, True):
        sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, lookup=lookup)
        sm.use_cpu_kernels(kernels)
        splits.clear()
        _check_rows(model, sm, rows, 14)
        assert splits and all(1 <= shape[1] <= 3 for shape in splits)  # c = d drafts
        metrics = sm.last_metrics
        # one verify call a round that drafted (the rows share it), d draft calls a round
        assert metrics.verify_calls == sum(1 for w in metrics.draft_lengths if w) > 0
        if not lookup:
            assert metrics.draft_calls == sum(metrics.draft_lengths)


def test_the_batch_bench_names_each_row_by_system_backend_and_batch_size():
    # One run at batch sizes 1 and 2: a row a system and size, named <system>@b<B>, every
    # leapfx row counted identical per row against HF's own padded batch, the draft lengths the
    # policy chose reported; a bad --backend is refused naming what batches.
    from leapfx.bench.batch import (
        BatchBenchConfig,
        BatchSystem,
        _size_rows,
        pad_batch,
        run_batch_bench,
    )

    model = tiny_model("llama", layers=3, vocab=32, seed=6)
    prompts = [torch.tensor([r]) for r in ([1, 2, 3, 1, 2, 3], [4, 5], [6, 7, 6, 7, 6])]
    config = BatchBenchConfig(batch_sizes=(1, 2), recipes=("lookup",), num_speculations=3,
                              max_new_tokens=6, repeats=1, warmup=0)  # fmt: skip
    rows = run_batch_bench(model, prompts, config, pad_token_id=PAD, progress=False)
    names = [r.system for r in rows]
    for size in (1, 2):
        for system in ("hf_greedy", "hf_static", "leapfx_autoregressive", "leapfx_lookup"):
            assert f"{system}@b{size}" in names
    for r in rows:
        if r.system.startswith("leapfx_"):
            assert r.identical_prompts == r.prompts == 3
        if r.system.startswith("leapfx_autoregressive"):
            assert r.speedup == 1.0
    assert "draft_lengths" in next(r for r in rows if r.system == "leapfx_lookup@b2").extra
    with pytest.raises(ValueError, match="--backend: 'onnxruntime' with --batch-size is invalid"):
        BatchBenchConfig(backends=("onnxruntime",)).validate()
    # With several backends each leapfx row is <system>@<backend>@b<B>, and its ratio is over
    # the autoregressive row on its own backend.
    ids, mask = pad_batch([prompts[0]], PAD)
    out = torch.cat([ids, torch.ones(1, 4, dtype=torch.long)], dim=1)
    systems = [BatchSystem(f"{name}@{backend}", None, suffix=f"@{backend}")
               for backend in ("eager", "inductor")
               for name in ("leapfx_autoregressive", "leapfx_lookup")]  # fmt: skip
    seconds = {"leapfx_autoregressive@eager": 1.0, "leapfx_lookup@eager": 0.5,
               "leapfx_autoregressive@inductor": 2.0, "leapfx_lookup@inductor": 1.0}  # fmt: skip
    rows = _size_rows(model, systems, 1, [(ids, mask)], {s.name: [out] for s in systems},
                      {s.name: [] for s in systems}, {n: [t] for n, t in seconds.items()},
                      set())  # fmt: skip
    assert [r.system for r in rows] == [f"{s.name}@b1" for s in systems]
    assert [r.speedup for r in rows] == [1.0, 2.0, 1.0, 2.0]
