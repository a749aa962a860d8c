"""A drafter's token ranking on disk: the vocabulary of its training data, most frequent first.

Saved beside a drafter's own files (EAGLE's head, Kangaroo's adapter, M2R2's accelerator)::

    draft_vocab.safetensors   {"ranking": [V] int64}

Parts written before the ranking existed have no such file and load as before
(``read_ranking`` gives None); ``passes.draft_vocab.SubsetDraftHead`` drafts over its first N.

    >>> write_ranking("parts/", token_ranking(tokens, vocab_size))
    >>> read_ranking("parts/").shape
    torch.Size([vocab_size])
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

RANKING_FILE = "draft_vocab.safetensors"


def write_ranking(directory: str | os.PathLike, ranking: torch.Tensor) -> None:
    """Write ``ranking`` [V] into ``directory`` (which exists; the caller renames it in place)."""
    save_file({"ranking": ranking.detach().long().cpu().contiguous()},
              str(Path(directory) / RANKING_FILE), metadata={"format": "1"})  # fmt: skip


def read_ranking(path: str | os.PathLike) -> torch.Tensor | None:
    """The ranking saved in the parts directory ``path``, or None when it has none."""
    file = Path(path) / RANKING_FILE
    if not file.is_file():
        return None
    tensors = load_file(str(file))
    if set(tensors) != {"ranking"} or tensors["ranking"].dim() != 1:
        raise ValueError(f"parts: {str(file)!r} is not a token ranking (one 1-D 'ranking')")
    return tensors["ranking"].long()
