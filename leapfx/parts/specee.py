"""SpecEE's trained parts on disk (the pass that loads them: ``passes.load_parts``).

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
from pathlib import Path
from typing import Any

from torch import nn

from ..files import write_atomic
from .eagle import write_eagle_files
from .io import (
    module_tensors,
    read_parts_meta,
    write_module_parts,
    write_parts_files,
)

FORMAT = 1
WEIGHTS = "predictors.safetensors"
CONFIG = "specee.json"
ADAPTER_DIR = "adapter"
EAGLE_DIR = "eagle"


def write_parts(
    predictors: nn.Module,
    path: str | os.PathLike,
    *,
    options: dict[str, Any],
    host: dict[str, Any],
    report: dict[str, Any] | None = None,
    eagle_head: nn.Module | None = None,
    adapter: nn.Module | None = None,
) -> Path:
    """Write the ``predictors`` (and the drafter's trained part: its ``eagle_head`` or Kangaroo
    ``adapter``, if any) to ``path``."""
    tensors = module_tensors(predictors)
    meta = {"format": FORMAT, "recipe": "specee", "options": options, "host": host,
            "report": report or {}}  # fmt: skip

    def write(tmp: Path) -> None:
        write_parts_files(tmp, WEIGHTS, CONFIG, tensors, meta)
        if eagle_head is not None:
            (tmp / EAGLE_DIR).mkdir()
            write_eagle_files(eagle_head, tmp / EAGLE_DIR, recipe="eagle", options={}, host=host)
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
