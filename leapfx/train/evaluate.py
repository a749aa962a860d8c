"""Held-out measurements of an early-exit model: loss, bits per byte, per-exit agreement, loops.

Exit convention: ``E`` is the number of decoder layers run before the shared norm and LM head
(HuggingFace's ``assistant_early_exit=E``); ``E = L`` is the full model. The agreement at ``E``
is the fraction of held-out positions where the exit's top-1 token equals the full model's.

Example::

    >>> report = evaluate_exits(model, held_out_ids, byte_lengths=token_byte_lengths(tok))
    >>> report.agreement[4]        # top-1 agreement of the exit after 4 layers with the last
"""

# ruff: noqa: E741  -- ``l`` is the paper's layer index.

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leapfx.passes.capture import decoder_pieces
from leapfx.train.layerskip import exit_logits, run_decoder


@dataclass(frozen=True)
class ExitReport:
    """Held-out metrics; dicts are keyed by the exit ``E`` (layers run), ``1 .. L``."""

    tokens: int  # target tokens scored
    bytes: int  # bytes of text those targets stand for (special tokens count 0)
    loss: dict[int, float]  # mean cross-entropy, nats per token
    accuracy: dict[int, float]  # top-1 next-token accuracy against the data
    agreement: dict[int, float]  # top-1 agreement with the last layer

    @property
    def last(self) -> int:
        return max(self.loss)

    @property
    def bits_per_token(self) -> float:
        return self.loss[self.last] / math.log(2)

    @property
    def bits_per_byte(self) -> float:
        return self.loss[self.last] * self.tokens / math.log(2) / max(1, self.bytes)


def eval_windows(tokens: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens spread evenly over ``tokens``: [N, S+1]."""
    available = (tokens.numel() - 1) // seq_len
    if available < 1:
        raise ValueError(f"seq_len: got {seq_len}; the held-out stream has {tokens.numel()} tokens")
    count = max(1, min(available, max_tokens // seq_len))
    starts = torch.linspace(0, (available - 1) * seq_len, count).long()
    starts = (starts // seq_len) * seq_len  # keep windows on the seq_len grid: never overlapping
    return tokens[starts[:, None] + torch.arange(seq_len + 1)].long()


@torch.no_grad()
def evaluate_exits(
    model: nn.Module,
    tokens: torch.Tensor,
    *,
    seq_len: int = 256,
    max_tokens: int = 32768,
    batch_size: int = 8,
    byte_lengths: torch.Tensor | None = None,
) -> ExitReport:
    """Loss, accuracy and last-layer agreement of every exit on held-out ``tokens`` (1-D).

    Runs on the model's device; the sums stay there until the end (no host sync per layer).
    """
    parts = decoder_pieces(model)
    n = parts.num_layers
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    windows = eval_windows(tokens.cpu(), seq_len, max_tokens)
    nll = torch.zeros(n, dtype=torch.float64, device=device)
    correct = torch.zeros(n, dtype=torch.int64, device=device)
    agree = torch.zeros(n, dtype=torch.int64, device=device)
    lengths = byte_lengths.cpu() if byte_lengths is not None else None
    count = 0
    nbytes = 0
    for chunk in windows.split(batch_size):
        if lengths is not None:
            nbytes += int(lengths[chunk[:, 1:]].sum())  # on the host: the windows are there
        chunk = chunk.to(device)
        inputs, targets = chunk[:, :-1], chunk[:, 1:]  # [b, S] each
        hidden = run_decoder(model, inputs, parts=parts)
        last_top1 = exit_logits(model, hidden[-1], parts=parts).argmax(-1)
        for l in range(n):
            logits = exit_logits(model, hidden[l], parts=parts).float()  # [b, S, V]
            nll[l] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            top1 = logits.argmax(-1)
            correct[l] += (top1 == targets).sum()
            agree[l] += (top1 == last_top1).sum()
        count += targets.numel()
    model.train(was_training)
    sums = {"nll": nll.tolist(), "correct": correct.tolist(), "agree": agree.tolist()}
    return ExitReport(
        tokens=count,
        bytes=nbytes,
        loss={l + 1: sums["nll"][l] / count for l in range(n)},
        accuracy={l + 1: sums["correct"][l] / count for l in range(n)},
        agreement={l + 1: sums["agree"][l] / count for l in range(n)},
    )


def is_looping(ids: list[int], *, tail: int = 24, max_period: int = 12) -> bool:
    """True when the last ``tail`` tokens repeat with a period of at most ``max_period``."""
    if len(ids) < tail:
        return False
    end = ids[-tail:]
    return any(all(end[i] == end[i - p] for i in range(p, tail)) for p in range(1, max_period + 1))


@torch.no_grad()
def greedy_continuations(
    model: nn.Module,
    stream: torch.Tensor,
    *,
    count: int,
    prompt_tokens: int,
    new_tokens: int,
    seed: int = 0,
    batch_size: int = 64,
) -> torch.Tensor:
    """``count`` windows of ``prompt_tokens`` at random offsets of the 1-D ``stream``, each
    followed by the model's own ``new_tokens`` greedy tokens: [count, prompt + new] (CPU).

    Training data for a drafter on what decoding shows it: a prompt, then the model's own
    output (for the reference model much of it repeats earlier text)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - prompt_tokens + 1, (count,), generator=generator)
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, count, batch_size):
        ids = torch.stack([stream[s : s + prompt_tokens] for s in starts[i : i + batch_size]])
        ids = ids.long().to(device)
        out.append(model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False,
            pad_token_id=model.config.pad_token_id or 0,
        ).cpu())  # fmt: skip
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def greedy_loop_stats(model: nn.Module, prompts: list[list[int]], *, new_tokens: int = 64) -> dict:
    """Greedy continuations of ``prompts``: how many end in a loop, and their distinct 4-grams.

    Runs on the model's device.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    looping = 0
    distinct = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids], device=device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id or 0,
        )
        cont = out[0, len(ids) :].tolist()
        looping += is_looping(cont)
        grams = [tuple(cont[i : i + 4]) for i in range(len(cont) - 3)]
        distinct.append(len(set(grams)) / max(1, len(grams)))
    model.train(was_training)
    return {
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "looping": looping,
        "mean_distinct_4gram": sum(distinct) / max(1, len(distinct)),
    }
