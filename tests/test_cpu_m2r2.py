"""``leapfx_cpu::m2r2_gate`` (leapfx/kernels/cpu_m2r2.cpp): an ARLA exit gate in one call.

The torch gate stage (``exit_stages``' ``gate_j``) is the reference: the op must give its
score and logits (to float rounding) on every architecture it covers, leave the others on the
torch path, and ``m2r2_exit`` with the op must make the same exits and emit the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from leapfx import rewrite
from leapfx.kernels import cpu_m2r2
from leapfx.modules.m2r2_kernels import KernelGate
from tests.conftest import tiny_model
from tests.greedy_check import check_random_prompts
from tests.test_m2r2 import _randomize


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_m2r2.available(), "leapfx_cpu::m2r2_gate did not build (see the warning)"


def _exit_model(arch: str, threshold: float, **kw):
    """m2r2_exit on a tiny model with random accelerators, routers and norm weights."""
    model = tiny_model(arch, layers=4, **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # away from their init, so weight/offset matter
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    sm = rewrite.apply(model, "m2r2_exit", gates=(2,), threshold=threshold)
    _randomize(sm.graph_module, seed=2, scale=0.3)
    return model, sm.use_cpu_kernels()


def _compare_calls(sm) -> list[float]:
    """Decode with every KernelGate call checked against the torch stage; the scores seen."""
    scores = []
    executors = dict(sm._executors)

    def checked(name, gate):
        def run(**inputs):
            got = gate(**inputs)
            want = sm.stages.modules[name](**inputs)
            torch.testing.assert_close(got["score"], want["score"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-5)
            scores.append(float(want["score"]))
            return got

        return run

    sm._executors = {
        k: checked(k, v) if isinstance(v, KernelGate) else v for k, v in executors.items()
    }
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for n in (2, 9):
            sm.generate(torch.randint(1, 128, (1, n), generator=g), max_new_tokens=12)
    sm._executors = executors
    return scores


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "phi3", "gemma"])
def test_op_computes_the_torch_gate(arch):
    _, sm = _exit_model(arch, threshold=0.8)
    assert isinstance(sm._executors["gate_1"], KernelGate), "the op covers " + arch
    scores = _compare_calls(sm)
    assert len(scores) >= 20 and min(scores) < 0.8 <= max(scores), scores  # both decisions


@pytest.mark.parametrize(("arch", "kw"), [("qwen3", {}), ("mistral", {"sliding_window": 4})])
def test_uncovered_models_keep_the_torch_gate(arch, kw):
    # q/k norms (Qwen3) and sliding windows are the torch path's: no KernelGate, same decode
    model, sm = _exit_model(arch, threshold=0.5, **kw)
    assert not isinstance(sm._executors["gate_1"], KernelGate)
    prompt = torch.arange(1, 6)[None]
    ours = sm.generate(prompt, max_new_tokens=8)
    torch.testing.assert_close(ours, sm.use_cpu_kernels(False).generate(prompt, max_new_tokens=8))


def test_same_exits_and_tokens_as_the_torch_gate():
    runs = []
    for kernel in (True, False):
        model, sm = _exit_model("llama", threshold=0.8)
        if not kernel:
            sm._executors = {
                k: v.fallback if isinstance(v, KernelGate) else v for k, v in sm._executors.items()
            }
        g = torch.Generator().manual_seed(4)
        outs = [sm.generate(torch.randint(1, 128, (1, n), generator=g), max_new_tokens=24)
                for n in (3, 10)]  # fmt: skip
        runs.append((outs, sm.last_metrics.avg_layers, sm.last_metrics.draft_calls))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert runs[0][1:] == runs[1][1:] and 0 < runs[0][2] < 24  # some exits, the same ones


def test_never_exit_with_the_op_is_greedy_identical():
    model, sm = _exit_model("llama", threshold=1.5)
    check_random_prompts(model, sm, (2, 11), 16, seed=5)
    assert sm.last_metrics.draft_calls == 0


def test_bad_inputs_are_refused_with_the_reason():
    model, sm = _exit_model("llama", threshold=0.5)
    gate = sm._executors["gate_1"]
    h, pos = torch.randn(1, 1, model.config.hidden_size), torch.tensor([[3]])
    cache = [torch.zeros(1, 2, 16, 8)] * 4
    op = torch.ops.leapfx_cpu.m2r2_gate.default
    with pytest.raises(RuntimeError, match="weights hold"):
        op(h, pos, gate.weights[:-1], gate.dims, gate.params, cache, [2, 2])
    with pytest.raises(RuntimeError, match="one row"):
        op(h.expand(1, 2, -1).contiguous(), pos, gate.weights, gate.dims, gate.params, cache,
           [2, 2])  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(h, pos, gate.weights, gate.dims, gate.params, cache, [2, 17])
    with pytest.raises(RuntimeError, match="float32"):
        op(h.double(), pos, gate.weights, gate.dims, gate.params, cache, [2, 2])


def _draft_model(arch: str, **options):
    model = tiny_model(arch, layers=4)
    sm = rewrite.apply(model, "m2r2", fast_layers=2, **options)
    _randomize(sm.graph_module, seed=6, scale=0.3)
    return model, sm.use_cpu_kernels()


@pytest.mark.parametrize(
    ("arch", "draft_vocab"),
    [("llama", None), ("qwen2", None), ("phi3", None), ("gemma", None), ("llama", 5),
     ("qwen2", 9)],
)  # fmt: skip
def test_draft_op_computes_the_torch_draft(arch, draft_vocab):
    """The op's draft equals the torch stage's; with ``draft_vocab`` the op reads the subset
    head's rows and the logits come back over the whole vocabulary, -inf off the subset."""
    from leapfx.modules.m2r2_kernels import KernelDraft
    from leapfx.modules.m2r2_scratch import FastScratch

    model, sm = _draft_model(arch, draft_vocab=draft_vocab)
    draft = sm._executors["draft"]
    assert isinstance(draft, KernelDraft), "the op covers " + arch
    calls = []

    def checked(**inputs):
        scratch = inputs["scratch"]
        copy = FastScratch(kv={k: list(v) for k, v in scratch.kv.items()})
        want = draft.fallback(**{**inputs, "scratch": copy})
        got = draft(**inputs)
        for key in ("logits", "hidden"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)
        off = torch.isneginf(got["logits"]).sum().item()
        assert off == (0 if draft_vocab is None else model.config.vocab_size - draft_vocab)
        for layer in draft.cache_layers:  # the draft's own fast keys/values, for the next drafts
            for a, b in zip(scratch.kv[layer][-1], copy.kv[layer][-1], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        calls.append(len(scratch))
        return got

    sm._executors = {**sm._executors, "draft": checked}
    check_random_prompts(model, sm, (2, 9), 16, seed=7)  # lossless: verify decides
    assert max(calls) >= 3  # later drafts of a round read the earlier drafts' keys


def test_draft_op_is_left_out_where_it_does_not_apply():
    from leapfx.modules.m2r2_kernels import KernelDraft

    model, sm = _draft_model("llama", fast_keys=4)  # top-k keys: the torch path
    assert not isinstance(sm._executors["draft"], KernelDraft)
    check_random_prompts(model, sm, (12,), 8, seed=8)
    _, sm = _draft_model("qwen3")  # q/k norms
    assert not isinstance(sm._executors["draft"], KernelDraft)
