"""``leapfx_cpu::attention``: causal attention over a cache for CPU decode and verify calls."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from greedy_check import assert_chain_is_draft_calls, check_random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.kernels import cpu_attention
from leapfx.modules.fused import FusedDecoderLayer
from leapfx.modules.kernel_layers import KernelDecoderLayer
from leapfx.runtime.cache import StaticKVCache
from tests.conftest import examples


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_attention.available(), "leapfx_cpu::attention did not build (see the warning)"


def _inputs(b, hq, hkv, s, length, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=gen).transpose(1, 2)  # strided, as after rotary
    k = torch.randn(b, hkv, length, d, generator=gen)
    v = torch.randn(b, hkv, length, d, generator=gen)
    return q, k, v


@settings(max_examples=examples(40, 160), deadline=None)
@given(
    b=st.integers(1, 2), hkv=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3]),
    s=st.integers(1, 9), extra=st.integers(0, 70), d=st.sampled_from([4, 16, 33, 48, 64]),
    seed=st.integers(0, 2**16), shuffle=st.booleans(),
)  # fmt: skip
def test_attention_matches_sdpa_with_the_causal_mask(b, hkv, group, s, extra, d, seed, shuffle):
    length = s + extra
    q, k, v = _inputs(b, hkv * group, hkv, s, length, d, seed)
    pos = torch.arange(length - s, length)
    if shuffle:  # padded verify rows are not in order
        pos = pos[torch.randperm(s, generator=torch.Generator().manual_seed(seed))]
    got = torch.ops.leapfx_cpu.attention(q, k, v, pos, d**-0.5)
    want = cpu_attention.attention_reference(q, k, v, pos, d**-0.5)
    assert got.shape == (b, s, hkv * group, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_slots_past_a_query_are_never_read():
    # stale keys past the positions (rejected drafts, unwritten slots): NaN there changes nothing
    q, k, v = _inputs(1, 4, 2, 3, 40, 16, 0)
    pos = torch.tensor([20, 21, 22])
    clean = torch.ops.leapfx_cpu.attention(q, k, v, pos, 0.25)
    k[:, :, 23:], v[:, :, 23:] = float("nan"), float("nan")
    assert torch.equal(torch.ops.leapfx_cpu.attention(q, k, v, pos, 0.25), clean)
    prefix = torch.ops.leapfx_cpu.attention(q, k[:, :, :23], v[:, :, :23], pos, 0.25)
    assert torch.equal(prefix, clean)  # the filled prefix or the whole buffer: same numbers


@settings(max_examples=examples(30, 120), deadline=None)
@given(
    hkv=st.sampled_from([1, 3]), group=st.sampled_from([1, 2, 3, 5]), s=st.integers(1, 12),
    extra=st.integers(0, 300), d=st.sampled_from([16, 33, 48, 64, 96, 128]),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_rows_result_does_not_depend_on_the_other_rows(hkv, group, s, extra, d, seed):
    # a verify pass's row equals the one-token step at the same position, bit for bit, however
    # the kernel tiles the rows of a kv head together (its group's heads, the verify's rows)
    q, k, v = _inputs(1, hkv * group, hkv, s, s + extra, d, seed)
    pos = torch.arange(extra, extra + s)
    together = torch.ops.leapfx_cpu.attention(q, k, v, pos, d**-0.5)
    for i in range(s):
        alone = torch.ops.leapfx_cpu.attention(q[:, :, i : i + 1], k, v, pos[i : i + 1], d**-0.5)
        assert torch.equal(alone[:, 0], together[:, i])
        for h in range(hkv * group):  # one head alone: no tile partners at all
            one = torch.ops.leapfx_cpu.attention(
                q[:, h : h + 1, i : i + 1], k[:, h // group : h // group + 1],
                v[:, h // group : h // group + 1], pos[i : i + 1], d**-0.5,
            )  # fmt: skip
            assert torch.equal(one[:, 0, 0], together[:, i, h])


@settings(max_examples=examples(40, 160), deadline=None)
@given(
    b=st.integers(1, 4), hkv=st.sampled_from([1, 3]), group=st.sampled_from([1, 3]),
    s=st.integers(1, 7), width=st.integers(8, 40), d=st.sampled_from([16, 33, 64]),
    seed=st.integers(0, 2**16), data=st.data(),
)  # fmt: skip
def test_attention_rows_matches_sdpa_over_each_rows_span(b, hkv, group, s, width, d, seed, data):
    # ragged rows: row r's queries at its own columns, reading from its first real column on;
    # a query before it (a padding column in a prefill) reads nothing and gets zeros
    q, k, v = _inputs(b, hkv * group, hkv, s, width, d, seed)
    first = torch.tensor(data.draw(st.lists(st.integers(0, width - 1), min_size=b, max_size=b)))
    ends = data.draw(st.lists(st.integers(s - 1, width - 1), min_size=b, max_size=b))
    last = torch.tensor(ends)[:, None] - s + 1 + torch.arange(s)  # [b, s]
    got = torch.ops.leapfx_cpu.attention_rows(q, k, v, first, last, d**-0.5)
    want = cpu_attention.attention_rows_reference(q, k, v, first, last, d**-0.5)
    assert got.shape == (b, s, hkv * group, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[last < first[:, None]] == 0).all()


def test_a_padded_rows_result_equals_the_row_alone():
    # a row behind 7 padding columns (garbage there): the same numbers, bit for bit, as
    # leapfx_cpu::attention gives the unpadded row (its keys read in the same order), and
    # beside another row in a batch
    q, k, v = _inputs(1, 6, 2, 3, 30, 64, 4)
    pad = 7
    kp = torch.cat([torch.randn(1, 2, pad, 64), k], dim=2)
    vp = torch.cat([torch.randn(1, 2, pad, 64), v], dim=2)
    pos = torch.tensor([27, 28, 29])
    alone = torch.ops.leapfx_cpu.attention(q, k, v, pos, 0.125)
    padded = torch.ops.leapfx_cpu.attention_rows(
        q, kp, vp, torch.tensor([pad]), (pos + pad)[None], 0.125
    )
    assert torch.equal(padded, alone)
    other = _inputs(1, 6, 2, 3, 37, 64, 5)
    batch = torch.ops.leapfx_cpu.attention_rows(
        torch.cat([other[0], q]), torch.cat([other[1], kp]), torch.cat([other[2], vp]),
        torch.tensor([0, pad]), torch.stack([pos + 5, pos + pad]), 0.125,
    )  # fmt: skip
    assert torch.equal(batch[1:], alone)


def test_bad_inputs_are_refused_with_the_reason():
    q, k, v = _inputs(1, 4, 2, 2, 10, 8, 0)
    with pytest.raises(RuntimeError, match="position 10 outside the 10 key slots"):
        torch.ops.leapfx_cpu.attention(q, k, v, torch.tensor([9, 10]), 1.0)
    with pytest.raises(RuntimeError, match="positions must be 2 int64 values"):
        torch.ops.leapfx_cpu.attention(q, k, v, torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.leapfx_cpu.attention(q.double(), k, v, torch.tensor([8, 9]), 1.0)
    with pytest.raises(RuntimeError, match="do not match q"):
        three = k[:, :1].expand(1, 3, 10, 8)  # 3 kv heads for 4 query heads
        torch.ops.leapfx_cpu.attention(q, three, three, torch.tensor([8, 9]), 1.0)
    with pytest.raises(RuntimeError, match=r"row 0 query 1 reads slots 0..10, outside 0..9"):
        torch.ops.leapfx_cpu.attention_rows(q, k, v, torch.tensor([0]), torch.tensor([[9, 10]]),
                                            1.0)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"last must be \[B, S\] int64"):
        torch.ops.leapfx_cpu.attention_rows(q, k, v, torch.tensor([0]), torch.tensor([9]), 1.0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_kernel_layer_attends_through_it_over_the_cache(arch):
    model = tiny_model(arch, layers=2)
    layer = model.model.layers[0]
    fused, kernel = FusedDecoderLayer(layer), KernelDecoderLayer(layer)
    assert kernel._kernel_attention and not fused._kernel_attention
    cfg = model.config
    outs = []
    for module in (fused, kernel):
        cache = StaticKVCache(2, cfg.num_key_value_heads, cfg.head_dim, max_len=16)
        x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        for start, n in ((0, 6), (6, 1), (7, 1)):  # a prefill, then one-token steps
            pos = torch.arange(start, start + n)[None]
            rope = model.model.rotary_emb(x, pos)
            mask = torch.full((n, start + n), float("-inf")).triu(start + 1)[None, None]
            with torch.no_grad():
                out = module(x[:, start : start + n], attention_mask=mask,
                             position_embeddings=rope, position_ids=pos,
                             past_key_values=cache)  # fmt: skip
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prefix", [0, 300])
def test_eager_layers_send_every_row_to_the_kernel(monkeypatch, prefix):
    # one row or several, over a short prefix or a long one: all through the kernel
    from leapfx.modules import fused

    model = tiny_model("llama", layers=2)
    kernel = KernelDecoderLayer(model.model.layers[0])
    cfg = model.config
    calls = []
    real = torch.ops.leapfx_cpu.attention

    def spy(*args):
        calls.append(args[0].shape[2])  # query rows
        return real(*args)

    monkeypatch.setattr(fused.torch.ops.leapfx_cpu, "attention", spy, raising=False)
    cache = StaticKVCache(2, cfg.num_key_value_heads, cfg.head_dim, max_len=prefix + 16)
    cache.lengths = [prefix, prefix]
    x = torch.randn(1, prefix + 5, cfg.hidden_size)
    for start, n in ((prefix, 4), (prefix + 4, 1)):
        pos = torch.arange(start, start + n)[None]
        mask = torch.full((n, start + n), float("-inf")).triu(start + 1)[None, None]
        with torch.no_grad():
            kernel(x[:, start : start + n], attention_mask=mask,
                   position_embeddings=model.model.rotary_emb(x, pos), position_ids=pos,
                   past_key_values=cache)  # fmt: skip
    assert calls == [4, 1]


def test_sliding_window_layers_keep_the_mask():
    model = tiny_model("mistral", layers=2, sliding_window=4)
    assert not KernelDecoderLayer(model.model.layers[0])._kernel_attention


def test_kernel_stages_skip_the_masks_their_layers_would_not_read():
    # Every mask reader of a kernel stage attends through the kernel: the runner builds no
    # mask for one row or several, over a short prefix or a long one. A sliding window keeps
    # the masks everywhere.
    from leapfx.runtime.runner import StageRunner

    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, cpu_kernels=True)
    stages = {name: stage for name, stage in sm._executors.items() if name != "draft_chain"}
    assert all(stage.mask_free is not None for stage in stages.values())  # (the chain: below)
    runner = StageRunner(sm._executors, sm._cache_for(64), sm._layout)
    assert runner._masks("verify", 10, 4) == {"full_attention": None}
    assert runner._masks("verify", 251, 6) == {"full_attention": None}  # 257 keys
    assert runner._masks("draft", 10, 1) == {"full_attention": None}
    check_random_prompts(model, sm, (1, 6), 24, seed=4)
    window = tiny_model("mistral", layers=2, sliding_window=4)
    plain = rewrite.apply(window, "layerskip", exit_layer=1, num_speculations=2, cpu_kernels=True)
    assert not any(hasattr(stage, "mask_free") for stage in plain._executors.values())
    assert "draft_chain" not in plain._executors  # its steps would need masks


def test_eager_kernel_stages_draft_a_greedy_round_in_one_chain_call():
    from leapfx.lower.cpu_kernels import EagerChain

    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, cpu_kernels=True)
    chain = sm._executors["draft_chain"]
    assert isinstance(chain, EagerChain) and chain.chain_length == 3
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    assert_chain_is_draft_calls(sm, prompt, lower=2)  # bitwise: the three draft calls'
    calls = []

    def counted(**inputs):
        calls.append(inputs["position_ids"].item())
        return chain(**inputs)

    counted.chain_length = chain.chain_length
    sm._executors["draft_chain"] = counted
    check_random_prompts(model, sm, (1, 6, 13), 40, seed=5)  # HF greedy's tokens
    assert calls, "the schedule never called draft_chain"
    count = len(calls)
    sm.generate(prompt, max_new_tokens=8, do_sample=True, generator=torch.manual_seed(0))
    assert len(calls) == count  # sampling drafts step by step (the chain is greedy)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layerskip_through_it_is_token_identical_to_hf_greedy(arch):
    model = tiny_model(arch, layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, cpu_kernels=True)
    check_random_prompts(model, sm, (1, 6, 13), 48, seed=2)
    assert sm.last_metrics.verify_calls > 0
