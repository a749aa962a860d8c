"""Sampling parameters and HF-exact logits warping.

Self-speculative decoding is lossless only if the target distribution we verify against is the
one HF ``generate`` would sample from. So :func:`warp_logits` replays HF's sampling warpers
(``transformers/generation/logits_process.py``) with the same tensor ops, in the order that
``GenerationMixin._get_logits_processor`` appends them, and with the same skip rules:

1. ``TemperatureLogitsWarper`` -- ``logits / temperature``; skipped when ``temperature == 1.0``.
2. ``TopKLogitsWarper`` -- drop every token whose logit is *strictly below* the k-th largest, so
   ties at the k-th value are all kept (more than k tokens may survive); skipped when
   ``top_k`` is None or 0; ``top_k >= V`` keeps everything.
3. ``TopPLogitsWarper`` -- sort ascending, drop tokens whose cumulative probability is
   ``<= 1 - top_p``, always keep the largest one (``min_tokens_to_keep=1`` outside beam search);
   skipped when ``top_p`` is None or 1.0. The skip matters: at ``top_p < 1`` the rule also drops
   tokens whose float32 probability underflows to 0, which ``top_p == 1.0`` must not do.

Filtered logits become ``-inf``. With ``do_sample=False`` HF applies no warper at all, and neither
do we (the greedy token is the argmax of the raw logits). Logits are upcast to float32 first, as
HF does before running its processors.

:func:`sample` is inverse-CDF sampling from explicit uniforms, so that a decode step is a pure
function of its random numbers (tests replay them; the verify step draws them in one batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.reference import sample  # noqa: F401  (the inverse-CDF draw)
from ..options import is_int, is_number

# HF's global generation defaults (``GenerationConfig._get_default_generation_params()``), used
# when neither the model's generation config nor the user sets a field. top_k=50 is the one that
# bites: ``do_sample=True`` alone samples from the top 50 tokens in HF, so it must here too.
HF_DEFAULT_DO_SAMPLE = False
HF_DEFAULT_TEMPERATURE = 1.0
HF_DEFAULT_TOP_K = 50
HF_DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is formed from logits; mirrors HF ``GenerationConfig``.

    ``top_k`` None or 0 and ``top_p`` None or 1.0 mean "off". Only ``do_sample=True`` warps.

    >>> SamplingParams(do_sample=True, temperature=0.7, top_p=0.9).top_k is None
    True
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad option, its value and the allowed range."""
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample={self.do_sample!r} is not allowed; use True or False")
        t = self.temperature
        if not is_number(t):
            raise ValueError(f"temperature={t!r} is not allowed; it must be a float > 0")
        # A greedy decode never reads the temperature (HF only warns), so only sampling checks it.
        if self.do_sample and not (t > 0 and math.isfinite(t)):
            raise ValueError(
                f"temperature={t!r} is not allowed with do_sample=True; it must be a finite "
                "float > 0 (for greedy decoding set do_sample=False instead of temperature=0)"
            )
        k = self.top_k
        if k is not None and not (is_int(k) and k >= 0):
            raise ValueError(
                f"top_k={k!r} is not allowed; it must be an int >= 1, or 0 / None to disable it"
            )
        p = self.top_p
        if p is not None and not (is_number(p) and 0 < p <= 1):
            raise ValueError(
                f"top_p={p!r} is not allowed; it must be a float with 0 < top_p <= 1 "
                "(1.0 or None disables it)"
            )

    @classmethod
    def from_generation_config(
        cls,
        generation_config=None,
        *,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> SamplingParams:
        """Params HF ``generate`` would use: overrides > ``generation_config`` > HF defaults.

        Like ``generate(**kwargs)``, a None override means "not given", so use ``top_k=0`` (not
        None) to switch top-k off. The caller's config is only read, never written.

        >>> from transformers import GenerationConfig
        >>> SamplingParams.from_generation_config(GenerationConfig(), do_sample=True).top_k
        50
        """

        def pick(name: str, override, default):
            if override is not None:
                return override
            value = getattr(generation_config, name, None)
            return default if value is None else value

        return cls(
            do_sample=pick("do_sample", do_sample, HF_DEFAULT_DO_SAMPLE),
            temperature=pick("temperature", temperature, HF_DEFAULT_TEMPERATURE),
            top_k=pick("top_k", top_k, HF_DEFAULT_TOP_K),
            top_p=pick("top_p", top_p, HF_DEFAULT_TOP_P),
        )


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's temperature -> top-k -> top-p warping of ``logits: [..., V]``, as float32.

    >>> warp_logits(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(do_sample=True, top_k=2))
    tensor([2., 1., -inf])
    """
    scores = logits.to(torch.float32)
    if not params.do_sample:
        return scores
    shape = scores.shape
    scores = scores.reshape(-1, shape[-1])  # [N, V]: HF's warpers assume 2-D scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:  # None and 0 are off
        top_k = min(params.top_k, scores.size(-1))
        kth = torch.topk(scores, top_k)[0][..., -1, None]  # [N, 1]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)  # [N, V]
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative_probs <= (1 - params.top_p)
        sorted_remove[..., -1:] = False  # min_tokens_to_keep = 1
        remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -float("inf"))
    return scores.reshape(shape)


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution ``softmax(warp_logits(logits))``, float32, shape of ``logits``."""
    return torch.softmax(warp_logits(logits, params), dim=-1)
