"""``swift``'s parts on disk: the skip set its draft runs without, nothing trained.

The parts directory of a layer-skip draft holds one file, nothing pickled::

    swift.json  {"format", "recipe": "swift", "options": {"skip_layers", "num_speculations"},
                 "host", "calibration"}

``options.skip_layers`` is the set ``rewrite.apply(model, "swift", parts=dir)`` drafts with;
``host`` describes the model it was chosen for (``io.host_signature``; loading
refuses a model of another depth, where the layer indices would mean other layers);
``calibration`` is what ``SpeculativeModel.calibrate`` measured (the set's tokens/s, the
autoregressive baseline's, how many sets it measured), or null for a set saved uncalibrated.
Written like every parts directory (``leapfx.files.write_atomic``).

    >>> write_skip_set("swift-parts/", options={"skip_layers": [2, 5], "num_speculations": 4},
    ...                host=host_signature(hf_model.config), calibration=None)
    >>> read_skip_set("swift-parts/")["options"]["skip_layers"]
    [2, 5]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..files import write_atomic
from .io import read_meta, write_parts_files

FORMAT = 1
CONFIG = "swift.json"


def write_skip_set(
    path: str | os.PathLike,
    *,
    options: dict[str, Any],
    host: dict[str, Any],
    calibration: dict[str, Any] | None,
) -> Path:
    """Write the skip set (in ``options``) and its metadata to the directory ``path``."""
    meta = {
        "format": FORMAT,
        "recipe": "swift",
        "options": options,
        "host": host,
        "calibration": calibration,
    }

    return write_atomic(
        path, lambda tmp: write_parts_files(tmp, None, CONFIG, None, meta), folder=True
    )


def read_skip_set(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON of a swift parts directory; ValueError naming ``parts`` if it is not one."""
    if not (Path(path) / CONFIG).is_file():
        raise ValueError(
            f"parts: {str(path)!r} is not a swift parts directory (missing {CONFIG}); pass a "
            "directory written by SpeculativeModel.save_parts of a 'swift' model, or None"
        )
    meta = read_meta(path, CONFIG, option="parts", fmt=FORMAT)
    skip = meta.get("options", {}).get("skip_layers") if meta.get("recipe") == "swift" else None
    if not isinstance(skip, list):
        raise ValueError(
            f"parts: {str(path)!r} holds no swift skip set (recipe {meta.get('recipe')!r}, "
            f"options.skip_layers {skip!r}); allowed: a directory saved by a 'swift' model"
        )
    return meta
