"""Device-side acceptance in the schedules: the same decisions as the host rules, no host sync.

``schedules.accept`` runs the ``leapfx::greedy_accept`` / ``leapfx::speculative_accept`` ops and
returns tensors on the logits' device; a self-speculative round then syncs once (k, the next
token and the drafts in one read). On a CPU the ops run the torch rules of ``verify``; here they
are checked against plain-Python acceptance on the host, and against the previous host path
(``verify.speculative_accept_random`` with the same generator) for sampling. On a GPU the draft
loop of fixed-length drafting and the accept step must not sync at all (``gpu`` test).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.kernels.reference import speculative_accept_random
from leapfx.runtime.runner import StageRunner
from leapfx.runtime.sampling import SamplingParams, probs
from leapfx.runtime.schedules import DecodeRequest, accept, draft
from tests.conftest import tiny_model


def _request(do_sample: bool, generator=None, **sampling) -> DecodeRequest:
    params = SamplingParams(do_sample=do_sample, **sampling)
    return DecodeRequest(32, frozenset(), params, generator)


def host_greedy(drafts: list[int], logits: list[list[float]]) -> tuple[int, int]:
    """Greedy acceptance in plain Python: argmax (first index on ties), then prefix match."""
    t = [max(range(len(row)), key=lambda v: (row[v], -v)) for row in logits]
    k = 0
    while k < len(drafts) and drafts[k] == t[k]:
        k += 1
    return k, t[k]


@given(
    seed=st.integers(0, 2**31 - 1),
    d=st.integers(1, 6),
    V=st.integers(2, 40),
    levels=st.sampled_from([3, 1000]),  # 3 levels: many exact ties between logits
)
def test_device_greedy_acceptance_equals_host(seed, d, V, levels):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (1, d + 1, V), generator=g).float()
    target = logits.argmax(-1)[0]
    # Drafts that follow the target for a random prefix, then anything.
    drafts = torch.randint(0, V, (1, d), generator=g)
    keep = int(torch.randint(0, d + 1, (1,), generator=g))
    drafts[0, :keep] = target[:keep]
    n, nxt = accept(drafts, None, logits, _request(False))
    assert isinstance(n, torch.Tensor) and n.shape == nxt.shape == (1,)
    assert n.device == nxt.device == logits.device and n.dtype == nxt.dtype == torch.long
    assert (int(n), int(nxt)) == host_greedy(drafts[0].tolist(), logits[0].tolist())


@given(seed=st.integers(0, 2**31 - 1), d=st.integers(1, 5), V=st.integers(2, 30))
def test_device_sampling_acceptance_equals_host_path(seed, d, V):
    g = torch.Generator().manual_seed(seed)
    sampling = {"temperature": 0.9, "top_k": 0, "top_p": 1.0}
    request = _request(True, torch.Generator().manual_seed(seed + 1), **sampling)
    q = probs(torch.randn(1, d, V, generator=g) * 2, request.sampling)
    drafts = torch.multinomial(q[0], 1, generator=g).T  # [1, d]
    target_logits = torch.randn(1, d + 1, V, generator=g) * 2
    n, nxt = accept(drafts, q, target_logits, request)
    p = probs(target_logits.float(), request.sampling)
    ref_n, ref_nxt = speculative_accept_random(
        drafts, q, p, generator=torch.Generator().manual_seed(seed + 1)
    )
    assert torch.equal(n, ref_n) and torch.equal(nxt, ref_nxt)


@torch.inference_mode()  # as generate() runs the stages
def _prefilled(device: str, recipe: str = "layerskip", **options):
    model = tiny_model("llama", layers=4).to(device)
    sm = rewrite.apply(model, recipe, **options)
    prompt = torch.tensor([[5, 17, 42, 9, 3]], device=device)
    runner = StageRunner(sm.stages.modules, sm._cache_for(64), sm._layout)
    logits = runner.full(prompt, 0)
    x = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
    return runner, x, prompt.shape[1]


@torch.inference_mode()
def _round(runner, x, pos, d, request):
    drafts, hidden, q = draft(runner, x, pos, d, request)
    target_logits = runner.verify(drafts[:, -1:], hidden, pos)
    return drafts, accept(drafts, q, target_logits, request)


def test_a_round_on_cpu_returns_device_tensors():
    runner, x, pos = _prefilled("cpu", exit_layer=2, num_speculations=4)
    drafts, (n, nxt) = _round(runner, x, pos, 4, _request(False))
    assert drafts.shape == (1, 4) and 0 <= int(n) <= 4 and nxt.shape == (1,)


@pytest.mark.gpu
@pytest.mark.parametrize("do_sample", [False, True])
def test_fixed_length_draft_loop_and_accept_never_sync(do_sample):
    # Fixed-length drafting (threshold 0) and device-side acceptance: no host sync at all; the
    # schedule's one sync per round is the read after accept().
    runner, x, pos = _prefilled("cuda", exit_layer=2, num_speculations=4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    request = _request(do_sample, gen if do_sample else None)
    _round(runner, x, pos, 4, request)  # warm-up: first launches may sync (lazy init)
    runner.cache.crop(pos)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _round(runner, x, pos, 4, request)
    finally:
        torch.cuda.set_sync_debug_mode("default")
