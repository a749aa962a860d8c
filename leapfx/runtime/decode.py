"""The generate() front end shared by every backend (SpeculativeModel, OnnxModel).

Checking the prompt, filling defaults from a HF ``GenerationConfig`` the way HF does, sizing the
KV cache and running a schedule with a metrics recorder are the same whichever backend executes
the stages; each backend only supplies its stages, its cache and its generation config.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from .metrics import DecodeMetrics
from .runner import StageRunner
from .sampling import SamplingParams
from .schedules import DecodeRequest

CACHE_ROUNDING = 256  # auto-sized caches grow in steps of this many positions
# Token id dtypes a prompt may have: what torch's embedding takes (HF's own generate refuses the
# rest from deep inside the embedding, with a RuntimeError that does not name input_ids).
TOKEN_ID_DTYPES = (torch.int64, torch.int32)


def check_prompt(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int
) -> None:
    """Refuse what the runtime cannot decode, naming the argument and what is allowed."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else None
        raise ValueError(
            "input_ids: expected a LongTensor of shape [batch, seq], "
            f"got {shape or type(input_ids).__name__}"
        )
    if input_ids.dtype not in TOKEN_ID_DTYPES:
        raise ValueError(
            f"input_ids: dtype {input_ids.dtype} is invalid; allowed: integer token ids of dtype "
            "torch.int64 (long) or torch.int32 (e.g. tokenizer(text, return_tensors='pt'))"
        )
    if input_ids.shape[0] < 1:
        raise ValueError("input_ids: the batch is empty; allowed: at least 1 row")
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids: the prompt is empty; allowed: at least 1 token")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise ValueError(f"input_ids: token ids must lie in 0..{vocab_size - 1}")
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask: shape {tuple(attention_mask.shape)} does not match "
                f"input_ids {tuple(input_ids.shape)}"
            )
        left_padding(attention_mask)


def left_padding(attention_mask: torch.Tensor | None) -> list[int] | None:
    """Each row's count of left pad tokens (None: no mask); ValueError for a row padded on the
    right or in the middle, or a row with no token at all."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    pads = (~mask).long().cumprod(dim=1).sum(dim=1)  # [B]: the leading zeros of each row
    ones = mask.long().sum(dim=1)
    for b, (pad, n) in enumerate(zip(pads.tolist(), ones.tolist(), strict=True)):
        if n == 0:
            raise ValueError(
                f"attention_mask: row {b} has no token (all zeros); allowed: rows "
                "with at least one token"
            )
        if pad + n != mask.shape[1]:
            raise ValueError(
                f"attention_mask: row {b} is padded on the right or in the middle; allowed: "
                "left padding (tokenizer.padding_side = 'left'), as for HF's generate with "
                "decoder-only models"
            )
    return pads.tolist()


def decode_request(
    generation_config,
    prompt_len: int,
    *,
    max_new_tokens: int | None,
    eos_token_id: int | list[int] | None,
    sampling: dict[str, Any],
    generator: torch.Generator | None,
    streamer: Any | None = None,
) -> DecodeRequest:
    """Stop rule and sampling of a call; None arguments default to ``generation_config``."""
    if max_new_tokens is None:
        max_new_tokens = generation_config.max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = (generation_config.max_length or 20) - prompt_len
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: {max_new_tokens!r} is invalid; allowed: int >= 1")
    if eos_token_id is None:
        eos_token_id = generation_config.eos_token_id
    if eos_token_id is None:
        eos = frozenset()
    elif isinstance(eos_token_id, int):
        eos = frozenset({eos_token_id})
    else:
        eos = frozenset(int(t) for t in eos_token_id)
    params = SamplingParams.from_generation_config(generation_config, **sampling)
    return DecodeRequest(max_new_tokens, eos, params, generator, streamer=streamer)


def teacher_sequence(teacher_tokens, recipe: str, lossless: bool) -> tuple[int, ...] | None:
    """``generate``'s ``teacher_tokens`` as a tuple of ints (None: no teacher forcing)."""
    if teacher_tokens is None:
        return None
    if lossless:
        raise ValueError(
            f"teacher_tokens: recipe {recipe!r} is lossless (its tokens are the full model's); "
            "teacher forcing measures the agreement of lossy recipes (e.g. 'early_exit')"
        )
    t = torch.as_tensor(teacher_tokens)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 2 or t.numel() == 0:
        raise ValueError(
            f"teacher_tokens: dtype {t.dtype}, shape {tuple(t.shape)} is invalid; allowed: a "
            "non-empty integer sequence [m] or [1, m]"
        )
    if t.dim() == 2 and t.shape[0] != 1:
        raise ValueError(
            f"teacher_tokens: shape {tuple(t.shape)} is invalid; allowed: [m] or [1, m] "
            "(batch size 1)"
        )
    return tuple(int(x) for x in t.reshape(-1).tolist())


def with_teacher(request: DecodeRequest, teacher: tuple[int, ...] | None) -> DecodeRequest:
    """``request`` with teacher forcing (greedy only, at most one new token per teacher's)."""
    if teacher is None:
        return request
    if request.sampling.do_sample:
        raise ValueError(
            "teacher_tokens: teacher forcing measures greedy agreement; allowed only with "
            "do_sample=False"
        )
    if request.max_new_tokens > len(teacher):
        raise ValueError(
            f"max_new_tokens: {request.max_new_tokens} is more than the {len(teacher)} "
            f"teacher_tokens; allowed: at most {len(teacher)}"
        )
    return dataclasses.replace(request, teacher_tokens=teacher)


def cache_length(needed: int, fixed: int | None, lookahead: int) -> int:
    """Positions to allocate: ``fixed`` (max_cache_len) if set and large enough, else rounded."""
    if fixed is None:
        return -(-needed // CACHE_ROUNDING) * CACHE_ROUNDING
    if needed > fixed:
        raise ValueError(
            f"max_cache_len: the prompt plus max_new_tokens (and {lookahead} lookahead "
            f"positions) need {needed} cache positions but max_cache_len is {fixed}; shorten "
            "the prompt or max_new_tokens, or raise max_cache_len"
        )
    return fixed


def decode(
    schedule: Callable[..., list[int]],
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    *,
    name: str,
    num_speculations: int,
) -> tuple[list[int], DecodeMetrics]:
    """Run ``schedule`` and return the new tokens and the call's metrics.

    A streamer (``request.streamer``) gets the prompt first, then each group of new tokens as
    the schedule emits it (``Output.extend``), then ``end()``: HF ``generate``'s order."""
    metrics = DecodeMetrics(
        schedule=name, prompt_tokens=prompt.shape[1], num_speculations=num_speculations
    )
    if request.streamer is not None:
        request.streamer.put(prompt.cpu())  # [1, n]
    start = time.perf_counter()
    tokens = schedule(runner, prompt, request, metrics)
    metrics.seconds = time.perf_counter() - start
    if request.streamer is not None:
        request.streamer.end()
    metrics.stage_seconds = dict(runner.seconds)
    metrics.new_tokens = len(tokens)
    return tokens, metrics
