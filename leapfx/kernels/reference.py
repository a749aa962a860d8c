"""Acceptance rules for speculative decoding, as pure batched functions: the torch references
of the acceptance ops (``leapfx.kernels.greedy``, ``leapfx.kernels.speculative``).

Notation follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and HF's ``_speculative_sampling``: the draft proposes ``x_1..x_d`` with
``x_i ~ q_i = q(. | prefix, x_<i)``; one target pass gives ``p_1..p_{d+1}``. Then

    accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the first rejection;
    at a rejection k emit a sample of normalize(max(p_k - q_k, 0)) and stop;
    if all d are accepted emit a bonus sample of p_{d+1}.

The emitted tokens are distributed exactly as d+1 steps of sampling from p (tests enumerate this).
Greedy verification is the same rule with one-hot p and q: accept while draft == argmax.

Everything here works on whole batches and never syncs with the host: no ``.item()``, no branch
on tensor values, so a step can be captured in a CUDA graph. Random numbers come in as
arguments (``u_accept``, ``u_sample``), which makes a step a deterministic function of them;
:func:`speculative_accept_random` draws them for callers that do not care.
"""

from __future__ import annotations

import torch


def _check_draft(draft_tokens: torch.Tensor, target: torch.Tensor, target_name: str) -> None:
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"draft_tokens must be [B, d] and {target_name} [B, d+1, V]; got "
            f"{tuple(draft_tokens.shape)} and {tuple(target.shape)}"
        )
    B, d = draft_tokens.shape
    if target.shape[:2] != (B, d + 1):
        raise ValueError(
            f"{target_name} must be [B, d+1, V] = [{B}, {d + 1}, V] for draft_tokens "
            f"{tuple(draft_tokens.shape)}; got {tuple(target.shape)}"
        )


def _n_accepted(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of ``accepted: [B, d]`` (bool) -> ``[B]`` long."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix where the draft equals the target argmax.

    Returns ``(n_accepted [B], next_token [B])``; ``next_token`` is the target argmax after the
    accepted prefix (the correction, or the bonus token when all ``d`` are accepted).

    >>> logits = torch.eye(4)[[1, 2, 3]][None]  # target argmax: 1, 2, 3
    >>> greedy_accept(torch.tensor([[1, 0]]), logits)
    (tensor([1]), tensor([2]))
    """
    _check_draft(draft_tokens, target_logits, "target_logits")
    d = draft_tokens.shape[1]
    target_tokens = target_logits.argmax(dim=-1)  # [B, d+1]
    n_accepted = _n_accepted(draft_tokens == target_tokens[:, :d])  # [B]
    next_token = target_tokens.gather(1, n_accepted[:, None]).squeeze(1)  # [B]
    return n_accepted, next_token


def acceptance(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position accept probability and rejection (residual) distribution.

    ``accept_prob[b, i] = min(1, p_i(x_i) / q_i(x_i))`` and ``residual[b, i] =
    normalize(max(p_i - q_i, 0))``, falling back to ``p_i`` where that is all zero (p_i == q_i,
    so rejection cannot happen anyway). A draft token with ``q_i(x_i) = 0`` (which a sampling
    draft never proposes) is accepted iff ``p_i(x_i) > 0``.

    Shapes: ``draft_tokens [B, d]``, ``draft_probs [B, d, V]``, ``target_probs [B, d+1, V]`` ->
    ``(accept_prob [B, d], residual [B, d, V])``, in the dtype of the probs.

    >>> q = torch.tensor([[[0.5, 0.5]]]); p = torch.tensor([[[0.25, 0.75], [1.0, 0.0]]])
    >>> acceptance(torch.tensor([[0]]), q, p)
    (tensor([[0.5000]]), tensor([[[0., 1.]]]))
    """
    _check_draft(draft_tokens, target_probs, "target_probs")
    if draft_probs.shape != target_probs[:, :-1].shape:
        raise ValueError(
            f"draft_probs must be [B, d, V] = {tuple(target_probs[:, :-1].shape)}; "
            f"got {tuple(draft_probs.shape)}"
        )
    d = draft_tokens.shape[1]
    q = draft_probs  # [B, d, V]
    p = target_probs[:, :d]  # [B, d, V]
    x = draft_tokens[..., None]  # [B, d, 1]
    q_x = q.gather(-1, x).squeeze(-1)  # [B, d]
    p_x = p.gather(-1, x).squeeze(-1)  # [B, d]
    safe_q_x = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    accept_prob = torch.where(q_x > 0, (p_x / safe_q_x).clamp(max=1), (p_x > 0).to(p_x.dtype))

    residual = (p - q).clamp(min=0)  # [B, d, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, d, 1]
    safe_mass = torch.where(mass > 0, mass, torch.ones_like(mass))
    residual = torch.where(mass > 0, residual / safe_mass, p)
    return accept_prob, residual


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling step with explicit uniforms in [0, 1).

    Draft ``i`` is accepted while ``u_accept[b, i] < accept_prob[b, i]`` (strict, so a token the
    target gives zero mass is never accepted). ``next_token`` is ``sample(residual_k, u_sample)``
    at the first rejection ``k``, or ``sample(p_{d+1}, u_sample)`` when all are accepted.

    Shapes: ``u_accept [B, d]``, ``u_sample [B]`` -> ``(n_accepted [B], next_token [B])``.
    """
    accept_prob, residual = acceptance(draft_tokens, draft_probs, target_probs)
    if u_accept.shape != accept_prob.shape or u_sample.shape != accept_prob.shape[:1]:
        raise ValueError(
            f"u_accept must be [B, d] = {tuple(accept_prob.shape)} and u_sample [B]; got "
            f"{tuple(u_accept.shape)} and {tuple(u_sample.shape)}"
        )
    d = draft_tokens.shape[1]
    n_accepted = _n_accepted(u_accept < accept_prob)  # [B]
    # Row k of `emit` is the distribution emitted after k acceptances: residual_k, or p_{d+1}.
    emit = torch.cat([residual, target_probs[:, d:]], dim=1)  # [B, d+1, V]
    index = n_accepted[:, None, None].expand(-1, 1, emit.shape[-1])  # [B, 1, V]
    next_dist = emit.gather(1, index).squeeze(1)  # [B, V]
    return n_accepted, sample(next_dist, u_sample)


def speculative_accept_random(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`speculative_accept` with uniforms from ``torch.rand`` (``u_accept`` drawn first).

    ``generator`` must live on the device of ``target_probs``.
    """
    B, d = draft_tokens.shape
    kw = dict(generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    u_accept = torch.rand((B, d), **kw)  # [B, d]
    u_sample = torch.rand((B,), **kw)  # [B]
    return speculative_accept(draft_tokens, draft_probs, target_probs, u_accept, u_sample)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample from ``probs: [..., V]`` with uniforms ``u: [...]`` in [0, 1).

    Returns the first token whose cumulative probability exceeds ``u * total`` (long, shape of
    ``u``). ``probs`` need not be normalised. A token of probability zero is never returned, even
    for ``u`` outside [0, 1): such ``u`` is clamped, and ``u >= 1`` gives the last token with mass.

    >>> sample(torch.tensor([0.5, 0.0, 0.5]), torch.tensor(0.5))
    tensor(2)
    """
    cdf = probs.cumsum(dim=-1)  # [..., V]
    # Scaling u by the float total (not 1) keeps x below the top of the CDF for every u < 1, so
    # the tail of zero-mass tokens is unreachable; zero-mass tokens inside the CDF are never the
    # first to exceed x since their CDF equals their predecessor's.
    x = u.to(cdf.dtype).clamp(min=0) * cdf[..., -1]  # [...]
    idx = torch.searchsorted(cdf.contiguous(), x.unsqueeze(-1).contiguous(), right=True)
    # u >= 1 would land past the last token with mass (or past V); clamp back to that token.
    V = probs.shape[-1]
    last_nonzero = V - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)  # [...]
    return torch.minimum(idx.squeeze(-1), last_nonzero)
