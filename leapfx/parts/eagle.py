"""The EAGLE head on disk (the pass that loads it: ``passes.load_parts``).

Trained parts are a directory; the head's two files in it, nothing pickled::

    eagle_head.safetensors  the EagleHead's state dict (fc.*, layer.*)
    eagle_head.json         {"format", "recipe", "options", "host", "init_layer", "parameters",
                             "eval"}
    draft_vocab.safetensors the training data's token ranking (``parts.draft_vocab``), when
                            the head was fitted; older parts have none and load the same

The names are the head's own, so a recipe with more parts (SpecEE's predictors) can write its
files beside them in the same directory. ``options`` are the recipe options it was saved with
(``rewrite.apply(..., parts=path)`` takes any it is not given from there); ``host`` describes
the model it fits, and loading refuses another. The directory is written under a temporary
name beside the target and renamed into place (``leapfx.files.write_atomic``), so a directory
with the final name is always complete.

Example::

    >>> write_eagle_head(eagle_head_of(gm), "eagle-parts/", recipe="eagle", options={},
    ...                  host=host_signature(hf_model.config))
    >>> gm = LoadEagleHead(path="eagle-parts/").run(gm).graph_module
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..files import write_atomic
from ..modules.eagle import EagleHead
from .draft_vocab import write_ranking
from .io import (
    read_parts_meta,
    write_module_files,
)

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
    ranking=None,
) -> None:
    """Write the head's two files into ``directory`` (which exists; not atomic by itself), and
    the token ranking [V] when given."""
    write_module_files(
        directory, head, weights=WEIGHTS, config=CONFIG, fmt=FORMAT, recipe=recipe,
        options=options, host=host, extra={"init_layer": head.init_layer, **(extra or {})},
    )  # fmt: skip
    if ranking is not None:
        write_ranking(directory, ranking)


def write_eagle_head(head: EagleHead, path: str | os.PathLike, **meta: Any) -> Path:
    """Write ``head`` and its metadata to the directory ``path`` (replaced if it exists)."""
    return write_atomic(path, lambda tmp: write_eagle_files(head, tmp, **meta), folder=True)


def read_eagle_config(path: str | os.PathLike, *, option: str = "parts") -> dict[str, Any]:
    """The JSON metadata of the head at ``path``; ValueError naming ``option`` if bad."""
    missing = (
        "holds no EAGLE head (missing {files}); pass a directory written by "
        "SpeculativeModel.save_parts of an 'eagle' model, or None"
    )
    return read_parts_meta(path, (WEIGHTS, CONFIG), CONFIG, option=option, fmt=FORMAT,
                           missing=missing)  # fmt: skip
