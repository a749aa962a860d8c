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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import fx, nn

from ..files import write_atomic
from .eagle_checkpoint import write_eagle_files
from .parts_io import (
    LoadParts,
    module_tensors,
    read_parts_meta,
    write_module_parts,
    write_parts_files,
)
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
    tensors = module_tensors(bank)
    meta = {"format": FORMAT, "recipe": "specee", "options": options, "host": host,
            "report": report or {}}  # fmt: skip

    def write(tmp: Path) -> None:
        write_parts_files(tmp, WEIGHTS, CONFIG, tensors, meta)
        head = getattr(gm, "eagle_head", None)
        if head is not None:
            (tmp / EAGLE_DIR).mkdir()
            write_eagle_files(head, tmp / EAGLE_DIR, recipe="eagle", options={}, host=host)
        adapter = getattr(gm, "kangaroo_adapter", None)
        if adapter is not None:
            write_module_parts(
                adapter, tmp / ADAPTER_DIR, recipe="kangaroo",
                options={"exit_layer": options["exit_layer"]}, host=host,
            )  # fmt: skip

    return write_atomic(path, write, folder=True)


def read_parts_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of the parts at ``path``; ValueError naming ``parts`` if bad."""
    root = Path(path)
    missing = (
        "is not a SpecEE parts directory (missing {files}); pass a directory written by "
        "SpeculativeModel.save_parts"
    )
    meta = read_parts_meta(root, (WEIGHTS, CONFIG), CONFIG, option="parts", fmt=FORMAT,
                           missing=missing)  # fmt: skip
    if meta.get("recipe") != "specee":
        raise ValueError(
            f"parts: {root / CONFIG} holds parts of recipe {meta.get('recipe')!r}, not 'specee'"
        )
    return meta


def _lm_head(bank: nn.Module) -> nn.Module | None:
    return bank.exits[0]._host[1] if len(bank.exits) else None


@dataclass(frozen=True)
class LoadSpecEEParts(LoadParts):
    """Load trained exit predictors and the offline subset into the graph's predictors."""

    name: ClassVar[str] = "load-specee-parts"
    requires: ClassVar[frozenset[str]] = frozenset({"exit-predictors"})
    provides: ClassVar[frozenset[str]] = frozenset({"exit-predictor-weights"})
    weights: ClassVar[str] = WEIGHTS

    def module_of(self, gm: fx.GraphModule) -> nn.Module:
        return predictors_of(gm)

    def read(self, path: str) -> dict[str, Any]:
        return read_parts_config(path)

    def check(self, bank: nn.Module, meta: dict[str, Any]) -> None:
        head = _lm_head(bank)
        saved = meta.get("host", {})
        if head is not None and saved.get("vocab_size") not in (None, head.weight.shape[0]):
            raise ValueError(
                f"parts: {self.path!r} were trained for a vocabulary of {saved['vocab_size']}, "
                f"not {head.weight.shape[0]}"
            )

    def misfit(self, bank: nn.Module, meta: dict[str, Any]) -> str:
        return (
            f"parts: the tensors in {self.path!r} do not fit this model's predictors "
            f"(expected {len(bank.state_dict())} tensors for {bank.num_layers - 1} layers)"
        )

    def loaded(self, bank: nn.Module) -> None:
        head = _lm_head(bank)
        if head is not None:
            bank.to(head.weight.device)
