"""The Inductor backend: stages through torch.compile over the static cache.

Compiling costs tens of seconds per tiny model on a CPU, so the end-to-end tests are few and
each checks several things: token identity with the eager stages (and HF greedy, ties
detected), and that decoding after warm-up compiles nothing, over prompts of several lengths
and 64 new tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from greedy_check import assert_chain_is_draft_calls, assert_greedy_equal, hf_greedy
from test_batch import _check_rows
from torch._dynamo.utils import counters

from leapfx import rewrite
from leapfx.bench.harness import BenchConfig
from leapfx.lower.chain import chain_length
from leapfx.lower.inductor import CompiledStage, CompileOptions
from leapfx.lower.pure_stage import SlotKVCache
from leapfx.runtime.batch import BatchPolicy
from leapfx.runtime.masks import chunk_mask, position_mask


def _prompts(vocab: int, lengths=(5, 1, 12, 3)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in lengths]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _always_draft(policy, size: int, available: int, share: float = 1.0) -> int:
    """``BatchPolicy.choose`` that drafts all it can, whatever a round costs."""
    return available


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mask_over_every_slot_is_chunk_mask_then_nothing(impl, window):
    # What a compiled stage attends with: queries over all max_len cache slots.
    max_len = 12
    for start, length in [(0, 1), (0, 4), (3, 1), (5, 3), (8, 4)]:
        pos = torch.arange(start, start + length)[None]
        got = position_mask(pos, max_len, impl=impl, window=window, dtype=torch.float32)
        assert got.shape == (1, 1, length, max_len)
        want = chunk_mask("eager", start, length, window=window)  # always explicit
        kv = start + length
        if impl == "sdpa":
            assert torch.equal(got[..., :kv], want == 0)
            assert not got[..., kv:].any()  # slots past the newest query: never visible
        else:
            assert torch.equal(got[..., :kv], want)
            assert (got[..., kv:] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("window", [None, 3])
def test_additive_sdpa_mask_attends_bit_for_bit_like_the_boolean_one(window):
    # The eager runner hands SDPA a float 0/-inf mask, converted once per stage call.
    g = torch.Generator().manual_seed(1)
    for start, length in [(5, 3), (8, 4), (0, 6)]:
        kv = start + length
        boolean = chunk_mask("sdpa", start, length, window=window)
        additive = chunk_mask("sdpa", start, length, window=window, additive=True)
        if boolean is None:  # SDPA's is_causal path: no mask either way
            assert additive is None
            continue
        assert additive.dtype == torch.float32
        assert torch.equal(additive == 0, boolean)
        assert torch.isneginf(additive[~boolean]).all()
        q = torch.randn(1, 4, length, 8, generator=g)
        k, v = torch.randn(2, 1, 2, kv, 8, generator=g)
        attend = torch.nn.functional.scaled_dot_product_attention
        assert torch.equal(attend(q, k, v, attn_mask=boolean, enable_gqa=True),
                           attend(q, k, v, attn_mask=additive, enable_gqa=True))  # fmt: skip


def test_slot_cache_writes_at_positions_and_returns_whole_buffers():
    keys = [torch.zeros(1, 2, 8, 4)]
    values = [torch.zeros(1, 2, 8, 4)]
    cache = SlotKVCache(keys, values, {0: torch.tensor([3, 4])})
    k_new = torch.ones(1, 2, 2, 4)
    k, v = cache.update(k_new, 2 * k_new, 0)
    assert k is keys[0] and v is values[0]
    assert k[:, :, 3:5].eq(1).all() and v[:, :, 3:5].eq(2).all()
    assert k[:, :, :3].eq(0).all() and k[:, :, 5:].eq(0).all()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mode", "fast", "mode: 'fast' is invalid"),
        ("verify_shapes", "ragged", "verify_shapes: 'ragged' is invalid"),
        ("warmup", "yes", "warmup: 'yes' is invalid"),
        ("draft_chain", 1, "draft_chain: 1 is invalid; allowed: True or False"),
    ],
)
def test_compile_options_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        CompileOptions(**{field: value}).validate()


def test_apply_refuses_an_unknown_backend(llama):
    with pytest.raises(ValueError, match="backend: 'tvm' is invalid; allowed: 'eager', 'inductor'"):
        rewrite.apply(llama, "layerskip", backend="tvm")


def test_bench_takes_several_backends():
    assert BenchConfig(backend="eager,inductor").validate().backends == ("eager", "inductor")
    with pytest.raises(ValueError, match="--backend: 'eager,eager' is invalid"):
        BenchConfig(backend="eager,eager").validate()
    with pytest.raises(ValueError, match="--backend: 'tvm' is invalid"):
        BenchConfig(backend="eager,tvm").validate()


def _check_compiled(
    model, recipe: str, verify_shapes: str, cpu_kernels: bool | None = None, **options
) -> None:
    prompts = _prompts(model.config.vocab_size)
    eager = rewrite.apply(model, recipe, **options)
    expected = [eager.generate(p, max_new_tokens=64) for p in prompts]
    compiled_before = _graphs()
    sm = rewrite.apply(model, recipe, **options)
    sm.compile(verify_shapes=verify_shapes, cpu_kernels=cpu_kernels)
    assert sm.backend == "inductor"
    assert sm.cpu_kernels == (cpu_kernels is not False), "cpu_kernels did not take effect"
    before = _graphs()
    assert before > compiled_before, "compile() warmed up no graph"
    for prompt, want in zip(prompts, expected, strict=True):
        got = sm.generate(prompt, max_new_tokens=64)
        # Compiled attention sums over the whole masked buffer: equal tokens up to float ties,
        # which assert_greedy_equal detects on the HF model itself and reports.
        assert_greedy_equal(model, got, want, prompt.shape[1])
        assert_greedy_equal(model, got, hf_greedy(model, prompt, 64), prompt.shape[1])
    assert _graphs() == before, "decoding after warm-up compiled a new graph"
    assert sm.last_metrics.verify_calls > 0


@pytest.mark.slow
def test_inductor_layerskip_is_token_identical_and_never_recompiles():
    # Default options on a float32 CPU model: the leapfx_cpu kernels (auto). The shapes of the
    # batch test's model below (its vocabulary of 16), without its EOS (decoding runs the 64
    # tokens): its one-row graphs are these, which Inductor's cache then holds for it.
    model = tiny_model("llama", layers=4, vocab=16, seed=3)
    _check_compiled(model, "layerskip", "dynamic", exit_layer=2, num_speculations=3)


@pytest.mark.slow
def test_inductor_kangaroo_padded_verify_with_sliding_window():
    # Dynamic drafting varies the verify length every round; a sliding window narrower than
    # the generation exercises the window term of the in-graph mask.
    # Without the CPU kernels: the transposed-weight torch.matmul path stays covered.
    model = tiny_model("mistral", layers=4, sliding_window=6)
    _check_compiled(
        model, "kangaroo", "padded", cpu_kernels=False, exit_layer=2, max_draft_tokens=4,
        confidence_threshold=0.3,
    )  # fmt: skip


def test_every_compiled_graph_skips_the_guards_on_the_stage_modules(monkeypatch):
    # torch.compile pops "guard_filter_fn" from the options dict it is given: a dict shared by
    # a stage's two compiled callables left the second one guarding every parameter and module
    # attribute on every call (0.25 ms of a verify call on the reference model). Each graph the
    # warm-up compiles (full, draft and verify: a one-token step and a multi-token chunk,
    # verify's full-round static graph, and the draft chain) must pass through the filter.
    real = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    filtered = []

    def counting(entries):
        filtered.append(len(entries))
        return real(entries)

    monkeypatch.setattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", counting)
    torch._dynamo.reset()
    # layerskip_compiled's model (below): the same graphs, which Inductor's cache then holds
    # for whichever of the two compiles second (a cold compile is minutes on a busy 2-core CPU)
    model = tiny_model("llama", layers=3)
    graphs = _graphs()
    rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3).compile()
    assert _graphs() - graphs == 8
    assert len(filtered) == 8


@pytest.fixture(scope="module")
def layerskip_compiled():
    """layerskip (E=1, d=3) on a 3-layer Llama, compiled once (8 graphs: tens of seconds on a
    cold Inductor cache) for the tests below that decode with it, and its cache as the warm-up
    left it (the object, its lengths, its buffers' addresses). Each test spies through
    ``monkeypatch``, so the next one finds the compiled executors again. (The test above
    resets dynamo; it runs before this fixture is made, in file order.)"""
    model = tiny_model("llama", layers=3)
    sm = rewrite.apply(model, "layerskip", exit_layer=1, num_speculations=3).compile()
    cache = sm._cache
    warm = (cache, list(cache.lengths), [t.data_ptr() for t in cache.keys + cache.values])
    return model, sm, warm


def test_a_full_rounds_verify_runs_its_static_graph_and_shorter_ones_the_dynamic_graph(
    layerskip_compiled, monkeypatch
):
    model, sm, _ = layerskip_compiled
    verify = sm._executors["verify"]
    calls = {"round": [], "chunk": []}
    for name in calls:
        real = getattr(verify, f"_{name}")

        def spy(keys, values, *args, real=real, name=name):
            calls[name].append(args[verify.tensor_inputs.index("exit_hidden")].shape[1])
            return real(keys, values, *args)

        monkeypatch.setattr(verify, f"_{name}", spy)
    graphs = _graphs()
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    # 14 new tokens: full rounds of 3 drafts, and near the end rounds cut short of 3
    ours = sm.generate(prompt, max_new_tokens=14)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, 14), prompt.shape[1])
    assert calls["round"] and set(calls["round"]) == {3}  # c = max_hidden
    assert calls["chunk"] and set(calls["chunk"]) == {2}  # a round cut to 2 drafts
    assert _graphs() == graphs  # the warm-up compiled both: generate compiles nothing


def test_a_greedy_layerskip_round_drafts_through_one_chain_call(layerskip_compiled, monkeypatch):
    model, sm, _ = layerskip_compiled
    chain = sm._executors["draft_chain"]
    assert chain.chain_length == 3
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    n = prompt.shape[1]
    assert_chain_is_draft_calls(sm, prompt, lower=1)  # bitwise: the three draft calls'
    calls = []
    real = chain._fn

    def spy(*args):
        calls.append(args[2].shape)
        return real(*args)

    monkeypatch.setattr(chain, "_fn", spy)
    graphs = _graphs()
    # 14 new tokens: rounds of 3 drafts through the chain, rounds cut short near the end
    # through single draft calls; greedy decoding identical to HF's either way
    ours = sm.generate(prompt, max_new_tokens=14)
    assert_greedy_equal(model, ours, hf_greedy(model, prompt, 14), n)
    assert calls and sm.last_metrics.draft_calls > 3 * len(calls)  # some rounds were short
    assert _graphs() == graphs  # the warm-up compiled the chain
    count = len(calls)
    sm.generate(prompt, max_new_tokens=8, do_sample=True, generator=torch.manual_seed(0))
    assert len(calls) == count  # sampling drafts step by step (the chain is greedy)
    assert sm.last_metrics.draft_calls > 0


def test_only_fixed_greedy_rounds_get_a_draft_chain(llama):
    assert chain_length(rewrite.apply(llama, "layerskip", exit_layer=1, num_speculations=4)) == 4
    dynamic = rewrite.apply(
        llama, "layerskip", exit_layer=1, num_speculations=4, confidence_threshold=0.5
    )
    assert chain_length(dynamic) == 0  # rounds stop at an unsure draft
    assert chain_length(rewrite.apply(llama, "layerskip", exit_layer=1, num_speculations=1)) == 0
    assert chain_length(rewrite.apply(llama, "kangaroo", exit_layer=1)) == 0


def test_warm_up_runs_on_the_cache_generate_reuses(layerskip_compiled):
    # The graphs are compiled (on a GPU: recorded as CUDA graphs) over the buffers decoding
    # then writes: the model's own static cache, which generate() only resets.
    model, sm, (cache, lengths, pointers) = layerskip_compiled
    assert lengths == [0] * cache.num_layers  # warm-up left it reset
    graphs = _graphs()
    for prompt in _prompts(model.config.vocab_size, lengths=(5, 2)):
        sm.generate(prompt, max_new_tokens=16)
    assert sm._cache is cache and [t.data_ptr() for t in cache.keys + cache.values] == pointers
    assert _graphs() == graphs


@pytest.mark.slow
def test_inductor_batches_write_each_row_at_its_own_columns_and_equal_hf(monkeypatch):
    # Default options (the CPU kernels: a batch's attention through attention_rows over each
    # row's span of the whole buffer). Rows stop at their own EOS and leave the batch (the
    # batch size shrinks to 1), LayerSkip rounds verify through the split verify stage; every
    # row equals HF's generate on the same padded batch, up to measured float ties. With
    # batches=True, compile() compiled every graph the batches use. The policy is forced to
    # draft (it chooses by measured time), so every round verifies.
    monkeypatch.setattr(BatchPolicy, "choose", _always_draft)
    model = tiny_model("llama", layers=4, vocab=16, eos=7, seed=3)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3)
    sm.compile(batches=True)
    graphs = _graphs()
    rows = [[1, 2, 3, 4, 5, 6], [9, 8], [3, 3, 3, 3], [11, 12, 13, 14, 15, 1, 2, 3, 4]]
    _check_rows(model, sm, rows, 20)
    assert sm.last_metrics.verify_calls > 0
    _check_rows(model, sm, [[3, 4], [5, 6, 7, 5, 6, 7]], 20)
    assert _graphs() == graphs, "a batch compiled a graph that compile(batches=True) did not"


@pytest.mark.slow
def test_inductor_batches_of_any_size_share_their_graphs_under_a_sliding_window(monkeypatch):
    # Without the CPU kernels: the masks come from each row's columns over the whole buffer,
    # with a sliding window narrower than the rows. Lookup drafts vary the verify width; rows
    # leave as they finish. Two batches of different sizes and lengths equal HF, and each kind
    # of call (a stage's one-token step or its chunk, over one row or over several) compiles
    # once: the batch size is dynamic in a batch's graphs, the chunk width in its chunks. The
    # policy, which chooses by measured time, is forced to draft what lookup finds, so the
    # calls made do not depend on the machine's timings.
    monkeypatch.setattr(BatchPolicy, "choose", _always_draft)
    compiled: list[tuple[str, bool, bool]] = []
    call_rows = CompiledStage._call_rows

    def noting(self, cache, tensors):
        before = _graphs()
        out = call_rows(self, cache, tensors)
        ids = tensors["input_ids"]
        compiled.extend([(self.name, ids.shape[0] > 1, ids.shape[1] > 1)] * (_graphs() - before))
        return out

    monkeypatch.setattr(CompiledStage, "_call_rows", noting)
    model = tiny_model("mistral", layers=3, vocab=32, sliding_window=3, seed=4)
    sm = rewrite.apply(model, "lookup", num_speculations=3, max_ngram=2)
    sm.compile(cpu_kernels=False)
    _check_rows(model, sm, [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6], [7, 7, 7, 7, 7], [9, 8, 9, 8]], 24)
    assert any(sm.last_metrics.draft_lengths)
    _check_rows(model, sm, [[4, 5, 4, 5, 4], [2, 2, 3], [6, 1, 6, 1, 6, 1, 6]], 24)
    assert any(several for _, several, _ in compiled)
    assert len(set(compiled)) == len(compiled), f"a kind of call compiled twice: {compiled}"


@pytest.mark.slow
def test_inductor_batches_draft_with_eagles_head_on_each_rows_state(monkeypatch):
    # EAGLE on a batch: the head drafts from each row's own last hidden state, the target
    # verifies (its prefill's zero state [B, 1, 1] runs the graph of a row's state [B, 1, D],
    # compiled by batches=True); rows equal HF's padded batch and decoding compiles nothing.
    # The policy is forced to draft (it chooses by measured time).
    monkeypatch.setattr(BatchPolicy, "choose", _always_draft)
    model = tiny_model("qwen2", layers=3, vocab=32, seed=4)
    sm = rewrite.apply(model, "eagle", max_draft_tokens=3, confidence_threshold=0.0)
    sm.compile(batches=True)
    graphs = _graphs()
    _check_rows(model, sm, [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6], [7, 7, 7, 7, 7], [9, 8, 9, 8]], 16)
    assert sm.last_metrics.drafted_tokens > 0
    assert _graphs() == graphs, "a batch compiled a graph that compile(batches=True) did not"
