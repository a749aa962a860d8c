"""M2R2's trained accelerator on disk (the pass that loads it: ``passes.load_parts``).

A one-module parts directory (``io.write_module_parts``, as Kangaroo's adapter):
``adapter.safetensors`` (the Accelerator's state dict: ``layers.<i>.<name>``, trainable tensors
only) and ``adapter.json`` (``recipe``, the ``options`` it was trained with -- gates, heads,
rank --, the ``host`` signature), written to a temporary directory and renamed into place.
Parts may hold more fast layers than a graph needs (``passes.load_parts.LoadAccelerator``).
"""

from __future__ import annotations

from typing import Any

from .io import read_module_parts_config

RECIPES = ("m2r2", "m2r2_exit")


def read_parts_config(path) -> dict[str, Any]:
    """The JSON of an M2R2 parts directory (either recipe); ValueError naming ``parts``."""
    missing = (
        "is not an M2R2 parts directory (missing {files}); pass a directory written by "
        "SpeculativeModel.save_parts"
    )
    errors = []
    for recipe in RECIPES:
        try:
            return read_module_parts_config(path, recipe=recipe, option="parts", missing=missing)
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError(errors[-1])
