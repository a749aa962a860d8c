"""Benchmarks: ``leapfx bench`` runs HF and leapfx systems side by side on one model.

The default model is the project's reference model, shipped in ``leapfx/assets/reference``
(trained by ``leapfx train-reference``; its model card is ``assets/reference/README.md``).
``--model moe-reference`` is the shipped MoE reference model (``assets/moe-reference``, trained
by ``leapfx train-moe-reference``), with the rate-2 M2R2 parts the offload rows' ``m2r2``
prefetch policy uses beside it.
Prompts are the first tokens of held-out Python standard-library functions. ``--random-model
SIZE`` times a Llama-shaped model with random weights instead (``leapfx.bench.random_model``).
"""

from __future__ import annotations

import torch

from ..models import MOE_REFERENCE_MODEL, REFERENCE_MODEL
from ..train.data import held_out_prompts, stdlib_corpus

REFERENCE_ADAPTER = REFERENCE_MODEL / "kangaroo_adapter"  # trained with sm.fit, see its model card
REFERENCE_M2R2 = REFERENCE_MODEL / "m2r2"  # the self-speculation drafter, `leapfx train-m2r2`
REFERENCE_M2R2_EXIT = REFERENCE_MODEL / "m2r2_exit"  # exit gates 4, 8, 12 + ARLA routers
REFERENCE_EAGLE = REFERENCE_MODEL / "eagle"  # EAGLE head parts: `leapfx train-eagle`
# Its rate-2 fast stream (`leapfx train-m2r2 --fast-layers 6`): the m2r2 prefetch policy's.
MOE_REFERENCE_M2R2 = MOE_REFERENCE_MODEL / "m2r2"


def bench_prompts(tokenizer, *, count: int, num_tokens: int, device="cpu") -> list[torch.Tensor]:
    """The first ``num_tokens`` tokens of ``count`` held-out stdlib functions."""
    if count < 1:
        raise ValueError(f"--prompts: {count} is invalid; allowed: an integer >= 1")
    if num_tokens < 2:
        raise ValueError(f"--prompt-tokens: {num_tokens} is invalid; allowed: an integer >= 2")
    prompts = held_out_prompts(tokenizer, stdlib_corpus(), num_tokens=num_tokens, count=count)
    return [torch.tensor([p.input_ids], device=device) for p in prompts]
