"""The Kangaroo adapter on disk (the pass that loads it: ``passes.load_parts``).

A checkpoint is a directory with two files, nothing pickled::

    adapter.safetensors  the KangarooAdapter's state dict (input_norm.*, attention.*, output_norm.*)
    adapter.json         {"format", "recipe", "options", "host", "parameters"}

and, when the adapter was fitted, ``draft_vocab.safetensors`` (the training data's token
ranking, ``parts.draft_vocab``); older checkpoints have none and load the same.

``options`` are the recipe options it was trained with (``rewrite.apply(..., adapter=path)``
takes any it is not given from here); ``host`` describes the model it fits, and loading refuses
another. The directory is written under a temporary name beside the target and renamed into
place, so a directory with the final name is always complete.

Example::

    >>> write_adapter(adapter_of(gm), "kangaroo-adapter/", recipe="kangaroo",
    ...               options={"exit_layer": 2}, host=host_signature(hf_model.config))

The files are those of every one-module parts directory (``io.write_module_parts``, which
M2R2's accelerators are saved with too).
    >>> gm = LoadKangarooAdapter(path="kangaroo-adapter/").run(gm).graph_module
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..modules.kangaroo import KangarooAdapter
from .draft_vocab import write_ranking
from .io import MODULE_CONFIG, MODULE_WEIGHTS, read_module_parts_config, write_module_parts

WEIGHTS = MODULE_WEIGHTS  # the file names of every one-module parts directory (io.py)
CONFIG = MODULE_CONFIG


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
    """Write Kangaroo's ``adapter`` and its metadata to the directory ``path`` (replaced if it
    exists), and the token ranking [V] (``parts.draft_vocab``) when given."""
    also = None if ranking is None else (lambda tmp: write_ranking(tmp, ranking))
    return write_module_parts(
        adapter, path, recipe=recipe, options=options, host=host, extra=extra, also=also
    )


def read_adapter_config(path: str | os.PathLike, *, recipe: str = "kangaroo") -> dict[str, Any]:
    """The JSON metadata of the checkpoint at ``path``; ValueError naming ``adapter`` if bad."""
    missing = (
        "is not an adapter checkpoint (missing {files}); pass a directory written by "
        "SpeculativeModel.save_adapter, or None"
    )
    return read_module_parts_config(path, recipe=recipe, option="adapter", missing=missing)
