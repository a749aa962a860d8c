"""SpecEE's trained parts on disk, and the pass that loads them into a rewritten graph.

A parts directory (``SpeculativeModel.save_parts``; ``rewrite.apply(..., "specee", parts=dir)``)::

    predictors.safetensors  the L - 1 exit MLPs and the offline layer subset (``offline``)
    specee.json             {"format", "recipe", "options", "host", "report"}
    adapter/                the Kangaroo adapter, when the drafter is "kangaroo"
    eagle/                  the EAGLE head, when the drafter is "eagle"

``options`` hold what the predictors were trained with (``drafter``, ``exit_layer``) and the
offline subset as a list (``offline_layers``); ``report`` the training's held-out per-layer
accuracy/precision and the exit frequencies the subset came from. Written to a temporary
directory beside the target and renamed into place, like the Kangaroo adapter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file, save_file
from torch import fx

from .adapter_checkpoint import write_adapter
from .base import GraphPass, PassResult
from .parts_io import read_meta, write_dir_atomic
from .predictor import predictors_of

FORMAT = 1
WEIGHTS = "predictors.safetensors"
CONFIG = "specee.json"
ADAPTER_DIR = "adapter"
EAGLE_DIR = "eagle"


def write_parts(
    gm: fx.GraphModule,
    path: str | os.PathLike,
    *,
    options: dict[str, Any],
    host: dict[str, Any],
    report: dict[str, Any] | None = None,
) -> Path:
    """Write the predictors of ``gm`` (and its Kangaroo adapter, if any) to ``path``."""
    bank = predictors_of(gm)
    tensors = {k: v.detach().contiguous().cpu() for k, v in bank.state_dict().items()}
    meta = {"format": FORMAT, "recipe": "specee", "options": options, "host": host,
            "report": report or {}}  # fmt: skip

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": str(FORMAT)})
        (tmp / CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        head = getattr(gm, "eagle_head", None)
        if head is not None:
            from .eagle_checkpoint import write_eagle_files

            (tmp / EAGLE_DIR).mkdir()
            write_eagle_files(head, tmp / EAGLE_DIR, recipe="eagle", options={}, host=host)
        adapter = getattr(gm, "kangaroo_adapter", None)
        if adapter is not None:
            write_adapter(
                adapter, tmp / ADAPTER_DIR, recipe="kangaroo",
                options={"exit_layer": options["exit_layer"]}, host=host,
            )  # fmt: skip

    return write_dir_atomic(path, write)


def read_parts_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of the parts at ``path``; ValueError naming ``parts`` if bad."""
    root = Path(path)
    missing = [name for name in (WEIGHTS, CONFIG) if not (root / name).is_file()]
    if missing:
        raise ValueError(
            f"parts: {str(path)!r} is not a SpecEE parts directory (missing "
            f"{', '.join(missing)}); pass a directory written by SpeculativeModel.save_parts"
        )
    meta = read_meta(root, CONFIG, option="parts", fmt=FORMAT)
    if meta.get("recipe") != "specee":
        raise ValueError(
            f"parts: {root / CONFIG} holds parts of recipe {meta.get('recipe')!r}, not 'specee'"
        )
    return meta


@dataclass(frozen=True)
class LoadSpecEEParts(GraphPass):
    """Load trained exit predictors and the offline subset into the graph's predictors."""

    name: ClassVar[str] = "load-specee-parts"
    requires: ClassVar[frozenset[str]] = frozenset({"exit-predictors"})
    provides: ClassVar[frozenset[str]] = frozenset({"exit-predictor-weights"})

    path: str

    def run(self, gm: fx.GraphModule) -> PassResult:
        bank = predictors_of(gm)
        meta = read_parts_config(self.path)
        head = bank.exits[0]._host[1] if len(bank.exits) else None
        saved = meta.get("host", {})
        if head is not None and saved.get("vocab_size") not in (None, head.weight.shape[0]):
            raise ValueError(
                f"parts: {self.path!r} were trained for a vocabulary of {saved['vocab_size']}, "
                f"not {head.weight.shape[0]}"
            )
        tensors = load_file(str(Path(self.path) / WEIGHTS))  # safetensors: no unpickling
        own = bank.state_dict()
        if set(tensors) != set(own) or any(tensors[k].shape != own[k].shape for k in own):
            raise ValueError(
                f"parts: the tensors in {self.path!r} do not fit this model's predictors "
                f"(expected {len(own)} tensors for {bank.num_layers - 1} layers)"
            )
        bank.load_state_dict(tensors)
        if head is not None:
            bank.to(head.weight.device)
        return PassResult(gm, modified=True, matches=len(tensors))
