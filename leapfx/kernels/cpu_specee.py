"""SpecEE's exit check as one C++ custom op for CPU decoding: ``leapfx_cpu::exit_check``.

The exit check of layer ``l`` (``modules.specee.LayerExit``) runs at every active layer of
every decoded token, between two layers, so its latency adds to the token's. As torch ops it is
about fifteen dispatches (the final RMSNorm, the gather of the k LM-head rows, their logits and
softmax, the features, two linears, ReLU, sigmoid) around ~12k multiply-adds: ~70 us on a
2-core CPU for the reference model, as much as half a decoder layer. ``cpu_specee.cpp`` does
the same arithmetic in one call (a few us):

=============================  ==================================================================
op                             signature
=============================  ==================================================================
``leapfx_cpu::exit_check``     ``(hidden, norm_w [H], head_w [V, H], candidates [k] int64,
                               p_prev [B, k] or None, mlp (pack_mlp), eps, offset, with_mlp,
                               threshold) -> (prob [B], p [B, k], logits)`` for the last
                               position of ``hidden`` ([B, H] or [B, S, H]): with
                               ``n = h * rsqrt(mean(h^2) + eps) * (offset + norm_w)``,
                               ``z = n . head_w[candidates]^T``, ``p = softmax(z)``,
                               ``prob = MLP(cat([z, p, p - p_prev]))`` (``[0]`` when
                               ``with_mlp`` is False) and ``logits = n . head_w^T`` [B, V] when
                               a ``prob`` is above ``threshold`` (else ``[0, V]``): the global
                               check of sec. 4.3.3 needs them exactly then
=============================  ==================================================================

float32 only. The numbers equal the torch path's up to summation order (a test holds them to
1e-5); :func:`rms_offset` checks on a probe that a norm is an RMSNorm the op reproduces.
Built like :mod:`leapfx.kernels.cpu`'s kernels (its own extension, on first use).
"""

from __future__ import annotations

import functools

import torch

from . import cpu


@functools.cache
def available() -> bool:
    """True once ``leapfx_cpu::exit_check`` is built and registered (built on the first call)."""
    return cpu.load_ops("specee", "exit_check", "using the torch exit check", _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("leapfx_cpu::exit_check")
    def _fake(hidden, norm_w, head_w, candidates, p_prev, mlp, eps, offset, with_mlp, threshold):
        b, k = hidden.shape[0], candidates.shape[0]
        # The logits' rows (B or 0) depend on the probabilities: a data-dependent size.
        rows = torch.library.get_ctx().new_dynamic_size()
        prob = hidden.new_empty((b if with_mlp else 0,))
        return prob, hidden.new_empty((b, k)), hidden.new_empty((rows, head_w.shape[0]))


def pack_mlp(first: torch.Tensor, first_bias: torch.Tensor, last: torch.Tensor,
             last_bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """An exit MLP (``Linear(F, W)``, ReLU, ``Linear(W, 1)``) as the op's one float32 tensor:
    ``[first.T (F x W) | first_bias (W) | last (W) | last_bias (1)]``.

    The hidden layer then accumulates W-wide rows, one per feature (vectorised in C++).

    >>> pack_mlp(torch.ones(3, 2), torch.zeros(3), torch.ones(1, 3), torch.zeros(1)).shape
    torch.Size([13])
    """
    parts = (first.detach().t(), first_bias.detach(), last.detach(), last_bias.detach())
    return torch.cat([t.reshape(-1).float() for t in parts])


def norm_epsilon(norm: torch.nn.Module) -> float | None:
    """The epsilon of an HF RMSNorm (``variance_epsilon`` or ``eps``), None if it has none."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def exit_check(
    hidden: torch.Tensor,
    norm: tuple[torch.Tensor, float, float],
    head_weight: torch.Tensor,
    candidates: torch.Tensor,
    p_prev: torch.Tensor | None,
    mlp: torch.Tensor,
    with_mlp: bool = True,
    threshold: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(prob [B], p [B, k], logits [B, V] or None)`` for the last position of ``hidden``
    ([B, H] or [B, S, H]); ``norm`` is (weight, eps, offset). The logits come back where a
    probability is above ``threshold`` (2.0: never)."""
    weight, eps, offset = norm
    prob, p, logits = torch.ops.leapfx_cpu.exit_check(
        hidden, weight, head_weight, candidates, p_prev, mlp, eps, offset, with_mlp, threshold
    )
    return prob, p, logits if logits.shape[0] else None


def rms_offset(norm: torch.nn.Module, head_weight: torch.Tensor) -> float | None:
    """0.0 (``w * n``, Llama's) or 1.0 (``(1 + w) * n``, Gemma's): the scale of ``norm`` as
    the op computes it, checked on a probe against ``norm.forward``; None when neither
    matches (not an RMSNorm the op reproduces: keep the torch path).
    """
    weight, eps = getattr(norm, "weight", None), norm_epsilon(norm)
    if eps is None or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(1, weight.shape[0], generator=gen)
    cands = torch.arange(min(4, head_weight.shape[0]))
    with torch.no_grad():
        want = torch.nn.functional.linear(norm.forward(probe), head_weight[cands])
        for offset in (0.0, 1.0):
            norm_args = (weight, eps, offset)
            _, p, _ = exit_check(probe, norm_args, head_weight, cands, None, probe, False)
            if torch.allclose(p, torch.softmax(want, -1), rtol=1e-4, atol=1e-6):
                return offset
    return None
