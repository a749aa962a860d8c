"""Where a drafter's training text comes from: ``--data stdlib|self|FILE``.

- ``stdlib``: the Python standard library's source, split by file (``data.stdlib_corpus``, the
  reference model's corpus and split);
- ``self``: instruction/response pairs the model writes itself (``self_data``), generated once
  and cached (``<cache_dir>/self-<key>.jsonl``, keyed by the model's weights, the settings and
  the benchmark prompts it was checked against); every 20th pair is held out;
- a path: a ``.jsonl`` file (one object a line: ``{"text": ...}``, ``{"instruction"/"prompt":
  ..., "response": ...}`` or ``{"messages": [...]}``, the last two through the model's chat
  template), a text file or a folder of text files. Documents are held out by the hash of
  their name (as the stdlib split); fewer than 20 documents: the last 5% of the tokens.

Every source gives token ids: the training stream, the held-out stream (at most
``held_out_tokens``) and a description for reports (kind, documents, tokens, sha256).

    >>> data = training_data("self", model, tokenizer, cache_dir=..., exclude=benchmark_texts())
    >>> data.train.shape, data.held_out.shape, data.info["kind"]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from leapfx.files import write_text_atomic
from leapfx.options import check_int
from leapfx.train.data import Document, encode_documents, is_held_out, load_text_documents
from leapfx.train.features import tokens_digest, weights_digest

DATA_KINDS = ("stdlib", "self")
HELD_OUT_FRACTION = 0.05
MIN_SPLIT_DOCUMENTS = 20  # fewer documents: hold out the stream's tail instead


@dataclass(frozen=True)
class SelfDataOptions:
    """``--data self``: how many pairs, of how many tokens (``self_data.self_pairs``)."""

    pairs: int = 256
    instruction_tokens: int = 48
    response_tokens: int = 192
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("pairs", self.pairs, 1)
        check_int("instruction_tokens", self.instruction_tokens, 1)
        check_int("response_tokens", self.response_tokens, 1)
        check_int("seed", self.seed, 0)


@dataclass(frozen=True)
class TrainingData:
    """Token ids to train on and to report on, and what they are."""

    train: torch.Tensor  # [N] int64
    held_out: torch.Tensor  # [M] int64
    info: dict[str, Any] = field(default_factory=dict)


def check_data(data: str) -> str:
    """``data`` unless it is neither a kind nor an existing path (ValueError naming --data)."""
    if data in DATA_KINDS or Path(data).exists():
        return data
    raise ValueError(
        f"--data: {data!r} is neither {' nor '.join(map(repr, DATA_KINDS))} nor an existing file "
        "or folder; allowed: stdlib, self, or a .jsonl / text file or a folder of text files"
    )


def _split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    held = [d for d in docs if is_held_out(d.name, HELD_OUT_FRACTION)]
    train = [d for d in docs if not is_held_out(d.name, HELD_OUT_FRACTION)]
    return train, held


def _streams(tokenizer, docs: list[Document]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(docs) >= MIN_SPLIT_DOCUMENTS:
        train, held = _split(docs)
        if train and held:
            return encode_documents(tokenizer, train).long(), encode_documents(
                tokenizer, held
            ).long()
    stream = encode_documents(tokenizer, docs).long()
    cut = stream.numel() - max(2, int(stream.numel() * HELD_OUT_FRACTION))
    return stream[:cut], stream[cut:]


def _conversation(messages: list[dict], tokenizer) -> str:
    from leapfx.models.chat import has_chat_template

    if not has_chat_template(tokenizer):
        return "\n".join(str(m.get("content", "")) for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False)


def jsonl_documents(path: Path, tokenizer) -> list[Document]:
    """The documents of a ``.jsonl`` file (see the module docstring)."""
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--data: {str(path)!r} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is not JSON ({exc})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object, got {type(item).__name__}")
        if "text" in item:
            text = str(item["text"])
        elif "messages" in item:
            text = _conversation(item["messages"], tokenizer)
        elif "response" in item and ("instruction" in item or "prompt" in item):
            user = item.get("instruction", item.get("prompt"))
            messages = [{"role": "user", "content": user},
                        {"role": "assistant", "content": item["response"]}]  # fmt: skip
            text = _conversation(messages, tokenizer)
        else:
            raise ValueError(
                f"{where}: allowed keys: text; messages; instruction (or prompt) and response"
            )
        docs.append(Document(f"{path.name}:{number}", text))
    if not docs:
        raise ValueError(f"--data: {str(path)!r} holds no objects")
    return docs


def self_documents(
    model, tokenizer, options: SelfDataOptions, *, cache_dir: Path, exclude: Sequence[str],
    progress: bool,
) -> tuple[list[Document], dict[str, Any]]:  # fmt: skip
    """The model's own pairs as documents (cached), and what the generation did."""
    from leapfx.train.self_data import pair_text, self_pairs

    key = {
        "model": weights_digest(model),
        "options": options.__dict__,
        "exclude": hashlib.sha256("\0".join(exclude).encode()).hexdigest(),
        "format": 1,
    }
    text = json.dumps(key, sort_keys=True)
    file = cache_dir / f"self-{hashlib.sha256(text.encode()).hexdigest()[:24]}.jsonl"
    if file.is_file():
        lines = file.read_text(encoding="utf-8").splitlines()
        head = json.loads(lines[0])
        if head.get("key") == key:
            pairs = [json.loads(line) for line in lines[1:]]
            info = {**head["generation"], "cached": str(file)}
            return [
                Document(f"self:{i}", pair_text(p, tokenizer)) for i, p in enumerate(pairs)
            ], info
    generated = self_pairs(model, tokenizer, pairs=options.pairs, seed=options.seed,
                           instruction_tokens=options.instruction_tokens,
                           response_tokens=options.response_tokens, exclude=exclude,
                           progress=progress)  # fmt: skip
    info = {"pairs": len(generated.pairs), "dropped_benchmark": generated.dropped,
            "generated_tokens": generated.generated_tokens,
            "seconds": round(generated.seconds, 1)}  # fmt: skip
    body = [json.dumps({"key": key, "generation": info})]
    body += [json.dumps(p) for p in generated.pairs]
    write_text_atomic(file, "\n".join(body) + "\n")
    docs = [Document(f"self:{i}", pair_text(p, tokenizer)) for i, p in enumerate(generated.pairs)]
    return docs, {**info, "cached": str(file)}


def training_data(
    data: str,
    model,
    tokenizer,
    *,
    cache_dir: str | Path,
    exclude: Sequence[str] | None = None,
    corpus_root: str | Path | None = None,
    self_options: SelfDataOptions | None = None,
    held_out_tokens: int = 32768,
    progress: bool = False,
) -> TrainingData:
    """The token ids of ``data`` (see the module docstring); ``exclude``: the benchmark prompts
    ``self`` data is checked against."""
    check_data(data)
    check_int("held_out_tokens", held_out_tokens, 2)
    info: dict[str, Any] = {"kind": data if data in DATA_KINDS else "file"}
    if data == "stdlib":
        from leapfx.train.reference import corpus_digest, reference_corpus

        corpus = reference_corpus(corpus_root, option="--corpus-root")
        train = encode_documents(tokenizer, corpus.train).long()
        held = encode_documents(tokenizer, corpus.held_out).long()
        info.update(files=len(corpus.train) + len(corpus.held_out),
                    corpus_sha256=corpus_digest(corpus))  # fmt: skip
    else:
        if data == "self":
            if exclude is None:
                raise ValueError(
                    "exclude: --data self needs the benchmark prompts to keep out of the "
                    "generated pairs; allowed: leapfx.bench.prompt_sets.benchmark_texts()"
                )
            docs, generation = self_documents(
                model, tokenizer, self_options or SelfDataOptions(),
                cache_dir=Path(cache_dir).expanduser(), exclude=exclude, progress=progress,
            )  # fmt: skip
            info["generation"] = generation
        else:
            path = Path(data)
            docs = (jsonl_documents(path, tokenizer) if path.suffix == ".jsonl"
                    else load_text_documents(path))  # fmt: skip
            info["path"] = str(path)
        if not docs:
            raise ValueError(f"--data: {data!r} gave no documents")
        train, held = _streams(tokenizer, docs)
        info["documents"] = len(docs)
    held = held[:held_out_tokens]
    info.update(train_tokens=int(train.numel()), held_out_tokens=int(held.numel()),
                sha256=tokens_digest(torch.cat([train, held])))  # fmt: skip
    return TrainingData(train, held, info)
