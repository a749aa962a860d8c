"""Token-identity check against HF greedy that detects float ties instead of hiding them.

Two decoders that compute the same function can still pick different tokens where the top two
logits tie within float error (a verify pass over several tokens sums in a different order than
one-token steps). ``assert_greedy_equal`` accepts a divergence only at such a tie, as measured
on the HF model's own full forward pass, reports it, and then requires the rest of our output to
equal HF greedy continued from our choice (the tie-broken alternative). Anything else fails.
The measurement (``logit_gap``, the per-dtype tolerance) lives in ``leapfx.bench.ties``, which
the bench uses to explain its differences the same way.
"""

from __future__ import annotations

import torch
from hypothesis import event, note
from hypothesis.control import currently_in_test_context

from leapfx.bench.ties import is_near_tie, logit_gap


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """HF greedy decoding. The mask is explicit: HF would otherwise treat prompt tokens equal to
    pad_token_id as left padding."""
    return model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )


def assert_greedy_equal(model, ours: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> int:
    """Assert ``ours`` equals HF greedy ``ref`` up to detected ties; returns the tie count."""
    ties = 0
    dtype = next(model.parameters()).dtype
    while not torch.equal(ours, ref):
        n = min(ours.shape[1], ref.shape[1])
        diff = (ours[0, :n] != ref[0, :n]).nonzero()
        if len(diff) == 0:
            raise AssertionError(
                f"lengths differ ({ours.shape[1]} vs HF {ref.shape[1]}) with equal prefixes:\n"
                f"ours {ours.tolist()}\nHF   {ref.tolist()}"
            )
        t = int(diff[0])
        assert t >= prompt_len, "the prompt itself differs"
        a, b = int(ours[0, t]), int(ref[0, t])
        gap, scale = logit_gap(model, ours[:, :t], a, b)
        if not is_near_tie(gap, scale, dtype):
            raise AssertionError(
                f"greedy output differs at new token {t - prompt_len}: ours {a}, HF {b}, "
                f"logit gap {gap:.3g} (not a tie)\nours {ours.tolist()}\nHF   {ref.tolist()}"
            )
        ties += 1
        if currently_in_test_context():  # hypothesis tests count and show them
            event("float tie between top logits (compared against the tie-broken alternative)")
            note(f"tie at new token {t - prompt_len}: ours {a} vs HF {b}, gap {gap:.3g}")
        remaining = ours.shape[1] - (t + 1)
        if remaining <= 0:
            break
        eos = model.generation_config.eos_token_id
        if eos is not None and a == eos:
            break
        ref = hf_greedy(model, ours[:, : t + 1], remaining)
    return ties


def check_random_prompts(model, sm, lengths, max_new_tokens: int, seed: int) -> None:
    """``sm`` decodes random prompts of each length in ``lengths`` (drawn from ``seed``) equal
    to HF greedy up to detected ties (``assert_greedy_equal``)."""
    g = torch.Generator().manual_seed(seed)
    for length in lengths:
        prompt = torch.randint(1, model.config.vocab_size, (1, length), generator=g)
        got = sm.generate(prompt, max_new_tokens=max_new_tokens)
        assert_greedy_equal(model, got, hf_greedy(model, prompt, max_new_tokens), length)


def assert_chain_is_draft_calls(sm, prompt: torch.Tensor, lower: int) -> None:
    """``sm``'s ``draft_chain`` executor against as many ``draft`` calls from the same cache
    state (after ``prompt``): the same tokens, exit states and cache slots, bit for bit, with
    only the ``lower`` layers below the exit advanced."""
    from leapfx.runtime.runner import StageRunner

    d = sm._executors["draft_chain"].chain_length
    n = prompt.shape[1]
    with torch.inference_mode():
        runner = StageRunner(sm._executors, sm._cache_for(n + 2 * d), sm._layout)
        runner.full(prompt, 0)
        x = torch.tensor([[7]])
        tokens, hidden = runner.draft_chain(x, n)
        lengths = list(runner.cache.lengths)
        chained = [t[:, :, n : n + d].clone() for t in runner.cache.keys + runner.cache.values]
        runner.cache.crop(n)
        steps, states, token = [], [], x
        for i in range(d):
            logits, h = runner.draft(token, n + i)
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
            steps.append(token)
            states.append(h)
        assert torch.equal(tokens, torch.cat(steps, dim=1))
        assert torch.equal(hidden, torch.cat(states, dim=1))
        layers = runner.cache.num_layers
        assert runner.cache.lengths == lengths == [n + d] * lower + [n] * (layers - lower)
        stepped = [t[:, :, n : n + d] for t in runner.cache.keys + runner.cache.values]
        assert all(torch.equal(a, b) for a, b in zip(chained, stepped, strict=True))
