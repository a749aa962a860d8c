"""Text in, text out: a prompt string through a recipe, streamed as it decodes.

``leapfx generate`` is this module on the command line. A chat model (its tokenizer has a chat
template) gets the prompt as a user turn with the assistant's turn opened, as its own
``generate`` would be used; ``raw=True`` feeds the text as it is. The decoded text streams
through HF's streamer protocol (``put``/``end``), so a round's accepted drafts appear at once.

>>> from leapfx import rewrite
>>> from leapfx.models import load_model
>>> model, tokenizer = load_model("smollm2")
>>> sm = rewrite.apply(model, "autoregressive")
>>> text = generate_text(sm, tokenizer, "Write a haiku about the sea.", max_new_tokens=64)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .models.chat import encode


@dataclass(frozen=True)
class TextResult:
    """What one ``generate_text`` call made: the new text and the decode's metrics."""

    text: str
    new_tokens: int
    metrics: Any  # DecodeMetrics


def prompt_ids(tokenizer, prompt: str, *, raw: bool = False, system: str | None = None):
    """[1, n] token ids of ``prompt``: through the chat template on a chat model (with a
    ``system`` turn first when given) unless ``raw``."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt: {prompt!r} is invalid; allowed: a non-empty string")
    if system is not None and raw:
        raise ValueError("system: a system turn needs the chat template; allowed without raw")
    item: dict = {"prompt": prompt}
    if system is not None:
        item = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": prompt}]}  # fmt: skip
    return torch.tensor([encode(item, tokenizer, raw)])


def generate_text(
    sm,
    tokenizer,
    prompt: str,
    *,
    raw: bool = False,
    system: str | None = None,
    streamer=None,
    **generate_kwargs,
) -> TextResult:
    """Decode ``prompt`` with ``sm`` (a SpeculativeModel or an OnnxModel) and return the new
    text (special tokens skipped); ``streamer`` receives the tokens as they are emitted."""
    ids = prompt_ids(tokenizer, prompt, raw=raw, system=system)
    out = sm.generate(ids, streamer=streamer, **generate_kwargs)
    new = out[0, ids.shape[1] :]
    text = tokenizer.decode(new, skip_special_tokens=True)
    return TextResult(text, int(new.numel()), sm.last_metrics)


def summary(result: TextResult, recipe: str) -> str:
    """The one line ``leapfx generate`` prints to stderr at the end."""
    m = result.metrics
    tps = result.new_tokens / m.seconds if m.seconds else float("nan")
    line = f"leapfx generate: {result.new_tokens} tokens, {tps:.1f} tok/s, recipe {recipe}"
    if m.verify_calls:
        line += (
            f", mean accepted length {m.mean_accepted_tokens:.2f}, acceptance "
            f"{m.acceptance_rate:.2f}"
        )
    return line
