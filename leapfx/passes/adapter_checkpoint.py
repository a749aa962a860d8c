"""The Kangaroo adapter on disk, and the pass that loads it into a rewritten graph.

A checkpoint is a directory with two files, nothing pickled::

    adapter.safetensors  the KangarooAdapter's state dict (input_norm.*, attention.*, output_norm.*)
    adapter.json         {"format", "recipe", "options", "host", "parameters"}

and, when the adapter was fitted, ``draft_vocab.safetensors`` (the training data's token
ranking, ``passes.draft_vocab``); older checkpoints have none and load the same.

``options`` are the recipe options it was trained with (``rewrite.apply(..., adapter=path)``
takes any it is not given from here); ``host`` describes the model it fits, and loading refuses
another. The directory is written under a temporary name beside the target and renamed into
place, so a directory with the final name is always complete.

Example::

    >>> write_adapter(adapter_of(gm), "kangaroo-adapter/", recipe="kangaroo",
    ...               options={"exit_layer": 2}, host=host_signature(hf_model.config))
    >>> gm = LoadKangarooAdapter(path="kangaroo-adapter/").run(gm).graph_module
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import fx

from .adapter import KangarooAdapter, adapter_of
from .draft_vocab import write_ranking
from .parts_io import (
    LoadParts,
    check_host,
    module_tensors,
    read_parts_meta,
    write_dir_atomic,
    write_parts_files,
)

FORMAT = 1
WEIGHTS = "adapter.safetensors"
CONFIG = "adapter.json"


def host_signature(config) -> dict[str, Any]:
    """What an adapter checkpoint must match in the model it is loaded into."""
    heads = config.num_attention_heads
    return {
        "model_type": config.model_type,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "vocab_size": config.vocab_size,
    }


def write_adapter(
    adapter: KangarooAdapter,
    path: str | os.PathLike,
    *,
    recipe: str,
    options: dict[str, Any],
    host: dict[str, Any],
    ranking=None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``adapter`` and its metadata to the directory ``path`` (replaced if it exists),
    and the token ranking [V] (``passes.draft_vocab``) when given."""
    tensors = module_tensors(adapter)
    meta = {
        "format": FORMAT,
        "recipe": recipe,
        "options": options,
        "host": host,
        "parameters": sum(t.numel() for t in tensors.values()),
        **(extra or {}),
    }

    def write(tmp: Path) -> None:
        write_parts_files(tmp, WEIGHTS, CONFIG, tensors, meta)
        if ranking is not None:
            write_ranking(tmp, ranking)

    return write_dir_atomic(path, write)


def read_adapter_config(path: str | os.PathLike, *, recipe: str = "kangaroo") -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``path``; ValueError naming ``adapter`` if bad."""
    missing = (
        "is not an adapter checkpoint (missing {files}); pass a directory written by "
        "SpeculativeModel.save_adapter, or None"
    )
    meta = read_parts_meta(path, (WEIGHTS, CONFIG), CONFIG, option="adapter", fmt=FORMAT,
                           missing=missing)  # fmt: skip
    if meta.get("recipe") != recipe:
        raise ValueError(
            f"adapter: {str(path)!r} was saved by recipe {meta.get('recipe')!r}, not {recipe!r}"
        )
    return meta


@dataclass(frozen=True)
class LoadKangarooAdapter(LoadParts):
    """Load trained adapter weights from a checkpoint directory into the graph's adapter."""

    name: ClassVar[str] = "load-kangaroo-adapter"
    requires: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter"})
    provides: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter-weights"})
    weights: ClassVar[str] = WEIGHTS

    def module_of(self, gm: fx.GraphModule) -> KangarooAdapter:
        return adapter_of(gm)

    def read(self, path: str) -> dict[str, Any]:
        return read_adapter_config(path)

    def check(self, adapter: KangarooAdapter, meta: dict[str, Any]) -> None:
        host = host_signature(adapter.attention.config)
        check_host("adapter", self.path, host, meta.get("host", {}))
        saved_exit = meta.get("options", {}).get("exit_layer")
        if saved_exit != adapter.exit_layer:
            raise ValueError(
                f"exit_layer: the adapter at {self.path!r} was trained after layer {saved_exit}, "
                f"not {adapter.exit_layer}"
            )

    def misfit(self, adapter: KangarooAdapter, meta: dict[str, Any]) -> str:
        return (
            f"adapter: the tensors in {self.path!r} do not fit this model's adapter "
            f"(expected {sorted(adapter.state_dict())})"
        )
