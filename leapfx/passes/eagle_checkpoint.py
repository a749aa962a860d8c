"""The EAGLE head on disk, and the pass that loads it into a rewritten graph.

Trained parts are a directory; the head's two files in it, nothing pickled::

    eagle_head.safetensors  the EagleHead's state dict (fc.*, layer.*)
    eagle_head.json         {"format", "recipe", "options", "host", "init_layer", "parameters",
                             "eval"}

The names are the head's own, so a recipe with more parts (SpecEE's predictors) can write its
files beside them in the same directory. ``options`` are the recipe options it was saved with
(``rewrite.apply(..., parts=path)`` takes any it is not given from there); ``host`` describes
the model it fits, and loading refuses another. The directory is written under a temporary
name beside the target and renamed into place (``parts_io.write_dir_atomic``), so a directory
with the final name is always complete.

Example::

    >>> write_eagle_head(eagle_head_of(gm), "eagle-parts/", recipe="eagle", options={},
    ...                  host=host_signature(hf_model.config))
    >>> gm = LoadEagleHead(path="eagle-parts/").run(gm).graph_module
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file, save_file
from torch import fx

from .adapter_checkpoint import host_signature
from .base import GraphPass, PassResult
from .eagle_head import EagleHead, eagle_head_of
from .parts_io import check_host, read_meta, write_dir_atomic

FORMAT = 1
WEIGHTS = "eagle_head.safetensors"
CONFIG = "eagle_head.json"


def write_eagle_files(
    head: EagleHead,
    directory: Path,
    *,
    recipe: str,
    options: dict[str, Any],
    host: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the head's two files into ``directory`` (which exists; not atomic by itself)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    meta = {
        "format": FORMAT,
        "recipe": recipe,
        "options": options,
        "host": host,
        "init_layer": head.init_layer,
        "parameters": sum(t.numel() for t in tensors.values()),
        **(extra or {}),
    }
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": str(FORMAT)})
    (directory / CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def write_eagle_head(head: EagleHead, path: str | os.PathLike, **meta: Any) -> Path:
    """Write ``head`` and its metadata to the directory ``path`` (replaced if it exists)."""
    return write_dir_atomic(path, lambda tmp: write_eagle_files(head, tmp, **meta))


def read_eagle_config(path: str | os.PathLike, *, option: str = "parts") -> dict[str, Any]:
    """The JSON metadata of the head at ``path``; ValueError naming ``option`` if bad."""
    root = Path(path)
    missing = [name for name in (WEIGHTS, CONFIG) if not (root / name).is_file()]
    if missing:
        raise ValueError(
            f"{option}: {str(path)!r} holds no EAGLE head (missing {', '.join(missing)}); pass "
            "a directory written by SpeculativeModel.save_parts of an 'eagle' model, or None"
        )
    return read_meta(root, CONFIG, option=option, fmt=FORMAT)


@dataclass(frozen=True)
class LoadEagleHead(GraphPass):
    """Load trained head weights from a parts directory into the graph's EAGLE head."""

    name: ClassVar[str] = "load-eagle-head"
    requires: ClassVar[frozenset[str]] = frozenset({"eagle-head"})
    provides: ClassVar[frozenset[str]] = frozenset({"eagle-head-weights"})

    path: str

    def run(self, gm: fx.GraphModule) -> PassResult:
        head = eagle_head_of(gm)
        meta = read_eagle_config(self.path)
        host = host_signature(head.layer.self_attn.config)
        check_host("parts", self.path, host, meta.get("host", {}))
        tensors = load_file(str(Path(self.path) / WEIGHTS))  # safetensors: no unpickling
        own = head.state_dict()
        if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
            raise ValueError(
                f"parts: the tensors in {self.path!r} do not fit this model's EAGLE head "
                f"(expected {sorted(own)})"
            )
        head.load_state_dict(tensors)  # copies into the head's own dtype and device
        return PassResult(gm, modified=True, matches=len(tensors))
