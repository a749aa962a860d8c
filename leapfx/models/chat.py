"""Prompts as token ids the way a model expects them: chat models through their template."""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(item: dict, tokenizer, raw: bool = False) -> list[int]:
    """Token ids of one prompt item: messages through the chat template (with the assistant's
    turn opened), a plain prompt through it too on a chat model unless ``raw``."""
    messages = item.get("messages")
    if messages is None and not (raw or item.get("raw")) and has_chat_template(tokenizer):
        messages = [{"role": "user", "content": item["prompt"]}]
    if messages is None:
        return list(tokenizer(item["prompt"])["input_ids"])
    if not has_chat_template(tokenizer):
        raise ValueError(
            "--prompt-set: a prompt with messages needs a tokenizer with a chat template; this "
            'model\'s has none (allowed: {"prompt": ...} items)'
        )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens itself: add none again.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
