"""The Kangaroo adapter on disk, and the pass that loads it into a rewritten graph.

A checkpoint is a directory with two files, nothing pickled::

    adapter.safetensors  the KangarooAdapter's state dict (input_norm.*, attention.*, output_norm.*)
    adapter.json         {"format", "recipe", "options", "host", "parameters"}

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

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file, save_file
from torch import fx

from .adapter import KangarooAdapter, adapter_of
from .base import GraphPass, PassResult
from .parts_io import check_host, read_meta, write_dir_atomic

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
) -> Path:
    """Write ``adapter`` and its metadata to the directory ``path`` (replaced if it exists)."""
    final = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter.state_dict().items()}
    meta = {
        "format": FORMAT,
        "recipe": recipe,
        "options": options,
        "host": host,
        "parameters": sum(t.numel() for t in tensors.values()),
    }

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": str(FORMAT)})
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    return write_dir_atomic(final, write)


def read_adapter_config(path: str | os.PathLike, *, recipe: str = "kangaroo") -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``path``; ValueError naming ``adapter`` if bad."""
    root = Path(path)
    missing = [name for name in (WEIGHTS, CONFIG) if not (root / name).is_file()]
    if missing:
        raise ValueError(
            f"adapter: {str(path)!r} is not an adapter checkpoint (missing {', '.join(missing)}); "
            "pass a directory written by SpeculativeModel.save_adapter, or None"
        )
    meta = read_meta(root, CONFIG, option="adapter", fmt=FORMAT)
    if meta.get("recipe") != recipe:
        raise ValueError(
            f"adapter: {str(path)!r} was saved by recipe {meta.get('recipe')!r}, not {recipe!r}"
        )
    return meta


@dataclass(frozen=True)
class LoadKangarooAdapter(GraphPass):
    """Load trained adapter weights from a checkpoint directory into the graph's adapter."""

    name: ClassVar[str] = "load-kangaroo-adapter"
    requires: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter"})
    provides: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter-weights"})

    path: str

    def run(self, gm: fx.GraphModule) -> PassResult:
        adapter = adapter_of(gm)
        meta = read_adapter_config(self.path)
        host = host_signature(adapter.attention.config)
        check_host("adapter", self.path, host, meta.get("host", {}))
        saved_exit = meta.get("options", {}).get("exit_layer")
        if saved_exit != adapter.exit_layer:
            raise ValueError(
                f"exit_layer: the adapter at {self.path!r} was trained after layer {saved_exit}, "
                f"not {adapter.exit_layer}"
            )
        tensors = load_file(str(Path(self.path) / WEIGHTS))  # safetensors: no unpickling
        own = adapter.state_dict()
        if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
            raise ValueError(
                f"adapter: the tensors in {self.path!r} do not fit this model's adapter "
                f"(expected {sorted(own)})"
            )
        adapter.load_state_dict(tensors)  # copies into the adapter's own dtype and device
        return PassResult(gm, modified=True, matches=len(tensors))
