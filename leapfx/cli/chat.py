"""``leapfx chat``: a multi-turn chat in the terminal, each answer streamed as it decodes.

Every turn sends the whole conversation through the model's chat template (the cache is
refilled each turn), decodes the answer with the recipe (``--recipe auto`` by default: the
best drafting the model has), streams it, and adds it to the conversation. ``/reset`` starts
over, ``/exit`` (or Ctrl-D) ends; Ctrl-C stops the answer being written and drops that turn.
"""

from __future__ import annotations

import argparse
import sys

from .generate import add_decoding, add_recipe_flags, decoding, load

COMMANDS_HELP = "/reset starts over, /exit or Ctrl-D ends, Ctrl-C stops an answer"


def _chat(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from ..models.chat import encode, has_chat_template
    from ..textgen import TextResult, summary

    sm, tokenizer = load(args)
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"--model: {args.model or 'reference'!r} has no chat template; allowed: a chat "
            "model (e.g. smollm2), or leapfx generate --raw for plain text"
        )
    kw = decoding(args, tokenizer)
    first = [{"role": "system", "content": args.system}] if args.system else []
    history = list(first)
    print(f"leapfx chat: {sm.recipe.name} on {args.model or 'reference'}; {COMMANDS_HELP}",
          file=sys.stderr)  # fmt: skip
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(first)
            print("(conversation cleared)", file=sys.stderr)
            continue
        turn = [*history, {"role": "user", "content": text}]
        ids = torch.tensor([encode({"messages": turn}, tokenizer)], device=args.device)
        streamer = transformers.TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        try:
            out = sm.generate(ids, streamer=streamer, **kw)
        except KeyboardInterrupt:
            print("\n(answer stopped; the turn is dropped)", file=sys.stderr)
            continue
        new = out[0, ids.shape[1] :]
        answer = tokenizer.decode(new, skip_special_tokens=True)
        history = [*turn, {"role": "assistant", "content": answer}]
        sys.stdout.flush()
        result = TextResult(answer, int(new.numel()), sm.last_metrics)
        print(summary(result, sm.recipe.name).replace("leapfx generate", "leapfx chat"),
              file=sys.stderr)  # fmt: skip


def add_parser(sub) -> None:
    chat = sub.add_parser(
        "chat", help="a multi-turn chat in the terminal through a recipe, streamed"
    )
    add_recipe_flags(chat, model="smollm2")
    add_decoding(chat, max_new_tokens=512)
    chat.add_argument("--system", default=None, help="a system turn that opens the chat")
    chat.set_defaults(func=_chat)
