"""Acceptance rules: greedy cases, the exactness proof by enumeration, uniforms, Monte Carlo."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from torch.fx.experimental.proxy_tensor import make_fx

from leapfx.kernels.reference import (
    acceptance,
    greedy_accept,
    speculative_accept,
    speculative_accept_random,
)
from leapfx.runtime.sampling import sample
from tests.conftest import examples

# ---------------------------------------------------------------- greedy


@settings(max_examples=examples(80, 300), deadline=None)
@given(d=st.integers(1, 8), V=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_greedy_acceptance_on_the_host_is_the_device_rule(d, V, seed):
    # small V: the drafts often match, and the logits often tie (argmax takes the first)
    from leapfx.runtime.sampling import SamplingParams
    from leapfx.runtime.schedules import DecodeRequest, accept_rows

    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (1, d + 1, V), generator=g).float()
    drafts = torch.randint(0, V, (1, d), generator=g)
    n, nxt = greedy_accept(drafts, logits)
    request = DecodeRequest(8, frozenset(), SamplingParams())
    emitted, kept = accept_rows(drafts, [d], None, [False], logits, [request])
    assert kept == [int(n)] and emitted == [[*drafts[0, : int(n)].tolist(), int(nxt)]]


def one_hot_logits(tokens: list[list[int]], V: int = 8) -> torch.Tensor:
    """[B, d+1, V] logits whose argmax is ``tokens``, with noise so argmax is not trivial."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(tokens), len(tokens[0]), V, generator=g)
    return logits.scatter(-1, torch.tensor(tokens)[..., None], 10.0)


@pytest.mark.parametrize(
    "draft, target, n, nxt",
    [
        ([3, 1, 4], [3, 1, 4, 7], 3, 7),  # all accepted -> bonus token
        ([2, 1, 4], [3, 1, 4, 7], 0, 3),  # first rejected -> correction
        ([3, 5, 4], [3, 1, 4, 7], 1, 1),  # middle rejected; a later match does not count
        ([3, 1, 5], [3, 1, 4, 7], 2, 4),  # last rejected
        ([], [6], 0, 6),  # d = 0: plain greedy step
    ],
)
def test_greedy_accept_cases(draft, target, n, nxt):
    logits = one_hot_logits([target])
    draft_tokens = torch.tensor([draft], dtype=torch.long).reshape(1, len(draft))
    n_accepted, next_token = greedy_accept(draft_tokens, logits)
    assert n_accepted.dtype == next_token.dtype == torch.long
    assert n_accepted.tolist() == [n]
    assert next_token.tolist() == [nxt]


def test_greedy_accept_batch():
    target = [[3, 1, 4, 7], [0, 0, 0, 0], [5, 6, 2, 1]]
    draft = torch.tensor([[3, 1, 4], [0, 2, 0], [4, 6, 2]])
    n_accepted, next_token = greedy_accept(draft, one_hot_logits(target))
    assert n_accepted.tolist() == [3, 1, 0]
    assert next_token.tolist() == [7, 0, 5]


def test_greedy_accept_shape_errors():
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_accept(torch.zeros(3, dtype=torch.long), torch.zeros(1, 4, 5))


# ---------------------------------------------------------------- the exactness proof
#
# Real speculative decoding has q_i = q(. | prefix, x_<i) and p_i = p(. | prefix, x_<i). We model
# both as functions of the whole token prefix (a lazily filled table), enumerate every draft
# sequence, and push the probabilities through `acceptance` analytically. The emitted tokens of
# the whole process (including the next speculative rounds after a rejection) must then be
# distributed exactly as sampling from p token by token.


class Lm:
    """A random language model over V tokens: prefix tuple -> distribution (float64)."""

    def __init__(self, V: int, rng: np.random.Generator, kind: str, ref: Lm | None = None):
        self.V, self.rng, self.kind, self.ref = V, rng, kind, ref
        self.table: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in self.table:
            self.table[prefix] = self._draw(prefix)
        return self.table[prefix]

    def _draw(self, prefix: tuple[int, ...]) -> np.ndarray:
        rng, V = self.rng, self.V
        kind = self.kind
        if kind == "mixed":  # a draft that is sometimes equal, one-hot, or sparse
            kind = rng.choice(["dense", "sparse", "same", "one_hot"])
        if kind == "same":
            return self.ref(prefix).copy()
        if kind == "one_hot":  # e.g. a greedy draft; may put all mass where p has none
            return np.eye(V)[rng.integers(V)]
        w = rng.dirichlet(np.full(V, 0.7))
        if kind == "sparse":
            w = w * (rng.random(V) < 0.5)
            w[rng.integers(V)] += 0.3
        return w / w.sum()


def step_distribution(p: Lm, q: Lm, prefix: tuple, d: int, accept_fn=acceptance) -> dict:
    """Exact distribution of the tokens emitted by one speculative step from ``prefix``."""
    drafts = list(itertools.product(range(p.V), repeat=d))
    weight = [np.prod([q(prefix + x[:i])[x[i]] for i in range(d)]) for x in drafts]
    draft_tokens = torch.tensor(drafts, dtype=torch.long).reshape(len(drafts), d)
    q_rows = [[q(prefix + x[:i]) for i in range(d)] for x in drafts]
    p_rows = [[p(prefix + x[:i]) for i in range(d + 1)] for x in drafts]
    draft_probs = torch.tensor(np.array(q_rows)).reshape(len(drafts), d, p.V)
    target_probs = torch.tensor(np.array(p_rows))
    accept_prob, residual = accept_fn(draft_tokens, draft_probs, target_probs)
    assert accept_prob.dtype == residual.dtype == torch.float64
    assert torch.isfinite(accept_prob).all() and torch.isfinite(residual).all()
    accept_prob, residual = accept_prob.tolist(), residual.tolist()

    out: dict[tuple, float] = defaultdict(float)
    for row, (x, w) in enumerate(zip(drafts, weight, strict=True)):
        reach = w  # probability that x was drafted and x_1..x_k were accepted
        for k in range(d):
            for y in range(p.V):
                out[x[:k] + (y,)] += reach * (1 - accept_prob[row][k]) * residual[row][k][y]
            reach *= accept_prob[row][k]
        for y in range(p.V):
            out[x + (y,)] += reach * p(prefix + x)[y]  # bonus token
    return out


def emitted_distribution(p: Lm, q: Lm, prefix: tuple, d: int, n: int, accept_fn=acceptance):
    """Exact distribution of the next ``n`` tokens emitted by repeated speculative steps."""
    out: dict[tuple, float] = defaultdict(float)
    for seq, pr in step_distribution(p, q, prefix, d, accept_fn).items():
        if len(seq) >= n:
            out[seq[:n]] += pr
        else:
            rest = emitted_distribution(p, q, prefix + seq, d, n - len(seq), accept_fn)
            for tail, pr_tail in rest.items():
                out[seq + tail] += pr * pr_tail
    return out


def target_distribution(p: Lm, prefix: tuple, n: int) -> dict:
    out = {}
    for ys in itertools.product(range(p.V), repeat=n):
        pr = 1.0
        for i in range(n):
            pr *= p(prefix + ys[:i])[ys[i]]
        out[ys] = pr
    return out


def assert_same_distribution(got: dict, want: dict) -> None:
    keys = sorted(set(got) | set(want))
    got_v = np.array([got.get(k, 0.0) for k in keys])
    want_v = np.array([want.get(k, 0.0) for k in keys])
    assert abs(got_v.sum() - 1) < 1e-9
    np.testing.assert_allclose(got_v, want_v, rtol=0, atol=1e-6)


@settings(max_examples=examples(200, 300), deadline=None)
@given(
    V=st.integers(2, 6),
    d=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
    p_kind=st.sampled_from(["dense", "sparse"]),
    q_kind=st.sampled_from(["dense", "sparse", "one_hot", "mixed"]),
)
def test_speculative_sampling_is_exact(V, d, seed, p_kind, q_kind):
    rng = np.random.default_rng(seed)
    p = Lm(V, rng, p_kind)
    q = Lm(V, rng, q_kind, ref=p)
    for n in (1, 2):
        got = emitted_distribution(p, q, (), d, n)
        assert_same_distribution(got, target_distribution(p, (), n))


def wrong_residual(draft_tokens, draft_probs, target_probs):
    """A plausible bug: resample from p instead of the residual after a rejection."""
    accept_prob, _ = acceptance(draft_tokens, draft_probs, target_probs)
    return accept_prob, target_probs[:, :-1]


def wrong_ratio(draft_tokens, draft_probs, target_probs):
    """A plausible bug: the ratio upside down, min(1, q(x) / p(x))."""
    _, residual = acceptance(draft_tokens, draft_probs, target_probs)
    x = draft_tokens[..., None]
    q_x = draft_probs.gather(-1, x).squeeze(-1)
    p_x = target_probs[:, :-1].gather(-1, x).squeeze(-1)
    return (q_x / p_x).clamp(max=1), residual


@pytest.mark.parametrize("broken", [wrong_residual, wrong_ratio])
def test_exactness_check_catches_broken_rules(broken):
    rng = np.random.default_rng(1)
    p = Lm(4, rng, "dense")
    q = Lm(4, rng, "dense")
    for n in (1, 2):  # the correct rule passes on this case ...
        assert_same_distribution(
            emitted_distribution(p, q, (), 2, n), target_distribution(p, (), n)
        )
    with pytest.raises(AssertionError):  # ... and the broken one does not
        assert_same_distribution(
            emitted_distribution(p, q, (), 2, 1, broken), target_distribution(p, (), 1)
        )


def test_acceptance_edge_cases():
    # q(x) = 0 (never drafted by a sampling draft): accepted iff p(x) > 0; p == q: residual = p.
    q = torch.tensor([[[0.0, 1.0], [0.0, 1.0], [0.3, 0.7]]])
    p = torch.tensor([[[0.5, 0.5], [0.0, 1.0], [0.3, 0.7], [1.0, 0.0]]])
    accept_prob, residual = acceptance(torch.tensor([[0, 0, 1]]), q, p)
    assert accept_prob.tolist() == [[1.0, 0.0, 1.0]]
    torch.testing.assert_close(residual, torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.3, 0.7]]]))


# ---------------------------------------------------------------- explicit uniforms


def random_case(B: int, d: int, V: int, seed: int):
    """Full-support p, q with each draft token where q/p is largest, so 0 < accept_prob < 1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(2 * torch.randn(B, d, V, generator=g), -1)
    p = torch.softmax(2 * torch.randn(B, d + 1, V, generator=g), -1)
    draft_tokens = (q / p[:, :d]).argmax(-1)  # [B, d]
    return draft_tokens, q, p


@pytest.mark.parametrize("d", [1, 2, 4])
def test_speculative_accept_follows_accept_prob(d):
    B, V = 6, 9
    draft_tokens, q, p = random_case(B, d, V, seed=d)
    accept_prob, residual = acceptance(draft_tokens, q, p)
    assert ((accept_prob > 0) & (accept_prob < 1)).all()
    just_below = torch.nextafter(accept_prob, torch.zeros_like(accept_prob))
    just_above = torch.nextafter(accept_prob, torch.ones_like(accept_prob))
    u_sample = torch.linspace(0.05, 0.95, B)
    for k in range(d + 1):  # reject first at position k (k = d: accept all)
        for reject_u in (accept_prob, just_above):
            u_accept = torch.where(torch.arange(d) < k, just_below, reject_u)
            u_accept[:, k + 1 :] = 0.0  # later positions would accept: must not matter
            n_accepted, next_token = speculative_accept(draft_tokens, q, p, u_accept, u_sample)
            assert n_accepted.tolist() == [k] * B
            dist = residual[:, k] if k < d else p[:, d]
            assert torch.equal(next_token, sample(dist, u_sample))
            assert (dist.gather(1, next_token[:, None]) > 0).all()
            if k < d:  # a rejected position emits a token where p > q
                y = next_token[:, None]
                assert (p[:, k].gather(1, y) > q[:, k].gather(1, y)).all()


def test_speculative_accept_d0_and_shape_errors():
    p = torch.tensor([[[0.2, 0.8]], [[0.6, 0.4]]])
    empty = torch.zeros(2, 0)
    n, nxt = speculative_accept(
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, 0, 2),
        p,
        empty,
        torch.tensor([0.3, 0.3]),
    )
    assert n.tolist() == [0, 0] and nxt.tolist() == [1, 0]
    draft_tokens, q, p = random_case(2, 3, 5, seed=0)
    with pytest.raises(ValueError, match="u_accept"):
        speculative_accept(draft_tokens, q, p, torch.rand(2, 2), torch.rand(2))
    with pytest.raises(ValueError, match="draft_probs"):
        acceptance(draft_tokens, q[:, :2], p)


def test_verify_has_no_host_sync():
    """Tracing with fake tensors fails on any read of tensor values (.item(), value branches)."""
    draft_tokens, q, p = random_case(3, 2, 5, seed=3)
    u_accept, u_sample = torch.rand(3, 2), torch.rand(3)
    args = (draft_tokens, q, p, u_accept, u_sample)
    gm = make_fx(speculative_accept, tracing_mode="fake")(*args)
    for got, want in zip(gm(*args), speculative_accept(*args), strict=True):
        assert torch.equal(got, want)
    logits = torch.randn(3, 3, 5)
    gm = make_fx(greedy_accept, tracing_mode="fake")(draft_tokens, logits)
    for got, want in zip(
        gm(draft_tokens, logits), greedy_accept(draft_tokens, logits), strict=True
    ):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- Monte Carlo


def test_speculative_accept_random_first_token_chi_square():
    V, N = 6, 200_000
    g = torch.Generator().manual_seed(1234)
    q1 = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])
    p1 = torch.tensor([0.05, 0.1, 0.0, 0.25, 0.2, 0.4])  # p has a token q never drafts
    q2 = torch.softmax(torch.randn(V, V, generator=g), -1)  # q(. | x1)
    p2 = torch.softmax(torch.randn(V, V, generator=g), -1)  # p(. | x1)
    p3 = torch.softmax(torch.randn(V, V, V, generator=g), -1)  # p(. | x1, x2)
    x1 = torch.multinomial(q1, N, replacement=True, generator=g)  # [N]
    x2 = torch.multinomial(q2[x1], 1, generator=g).squeeze(1)  # [N]
    draft_tokens = torch.stack([x1, x2], 1)  # [N, 2]
    draft_probs = torch.stack([q1.expand(N, V), q2[x1]], 1)  # [N, 2, V]
    target_probs = torch.stack([p1.expand(N, V), p2[x1], p3[x1, x2]], 1)  # [N, 3, V]

    n_accepted, next_token = speculative_accept_random(
        draft_tokens, draft_probs, target_probs, generator=g
    )
    first = torch.where(n_accepted >= 1, x1, next_token)
    counts = torch.bincount(first, minlength=V).double()
    assert counts[2] == 0  # p1(2) = 0 is never emitted
    support = p1 > 0
    expected = p1[support].double() / p1[support].double().sum() * N
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
    # The check has power: the draft distribution q1 itself is rejected outright.
    q_ref = q1[:5].double() / q1[:5].double().sum() * counts[:5].sum()
    assert chisquare(counts[:5].numpy(), q_ref.numpy()).pvalue < 1e-9
    # Acceptance is not degenerate here: both outcomes happen often.
    assert 0.2 < (n_accepted >= 1).double().mean().item() < 0.8


def test_decode_metrics_count_a_rejection_only_where_a_draft_was_rejected():
    from leapfx.runtime.metrics import DecodeMetrics

    m = DecodeMetrics(schedule="self_speculative", num_speculations=4)
    m.record_verify(4, 4)  # all accepted: the bonus token follows
    m.record_verify(2, 2)  # a round cut short (eta, or max_new_tokens): all accepted
    m.record_verify(4, 1)  # the second draft rejected
    m.record_verify(3, 0)  # the first draft rejected
    assert m.rejections == 2
    assert m.accepted_per_verify == [5, 3, 2, 1]
    assert m.accepted_drafts / (m.accepted_drafts + m.rejections) == pytest.approx(7 / 9)
