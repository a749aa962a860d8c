"""Trained parts found for a model: the drafter parts whose host is this model.

Every parts directory records the model it was trained for (``host``: architecture, layers,
widths, heads, vocabulary; ``parts.io.host_signature``). ``rewrite.apply(model,
"eagle")`` with ``parts`` left at ``"auto"`` looks for the recipe's folder whose host equals
the model's, first among the user's parts, ``$LEAPFX_CACHE/parts/*/<folder>`` (default
``~/.cache/leapfx/parts``: e.g. ``leapfx train-eagle --model M --out
~/.cache/leapfx/parts/my-model/eagle``), then among the parts leapfx ships (the reference
model's and SmolLM2-135M-Instruct's), and loads it: for a shipped model, the same head
``leapfx bench`` runs. ``parts=DIR`` names a directory instead; ``parts=None`` uses none (an
untrained drafter).

A host signature names shapes, not weights: a model of the same shapes but other weights (a
fine-tune, the base model of an instruct one) matches too. The drafts are still verified, so
decoding stays lossless; only acceptance drops. Pass ``parts=None`` there.

    >>> find_parts(model.config, "eagle")          # SmolLM2-135M-Instruct
    PosixPath('.../leapfx/assets/smollm2/eagle')
"""

from __future__ import annotations

import json
from pathlib import Path

from ..parts.io import host_signature
from .gguf import cache_root

USER_PARTS = "parts"  # $LEAPFX_CACHE/parts/<any name>/<recipe folder>: the user's own parts

# Each recipe's parts folder in a shipped model's assets, and the command that trains them.
PARTS_FOLDERS = {
    "eagle": "eagle",
    "kangaroo": "kangaroo_adapter",
    "m2r2": "m2r2",
    "m2r2_exit": "m2r2_exit",
    "specee": "specee",
}
TRAIN_COMMANDS = {
    "eagle": "leapfx train-eagle",
    "kangaroo": "leapfx train-kangaroo",
    "m2r2": "leapfx train-m2r2",
    "m2r2_exit": "leapfx train-m2r2 --recipe m2r2_exit",
    "specee": "leapfx train-specee",
}


def _host(folder: Path) -> dict | None:
    """The ``host`` a parts folder's JSON records (None: none readable)."""
    for path in sorted(folder.glob("*.json")):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("host"), dict):
            return meta["host"]
    return None


def find_parts(config, recipe: str) -> Path | None:
    """The parts folder of ``recipe`` trained for a model of ``config`` (its host signature
    equal to the model's): the user's (``$LEAPFX_CACHE/parts``) first, then the shipped ones;
    None where there is none."""
    from . import SHIPPED_PARTS

    name = PARTS_FOLDERS.get(recipe)
    if name is None:
        return None
    host = host_signature(config)
    user = cache_root() / USER_PARTS
    roots = sorted(p for p in user.iterdir() if p.is_dir()) if user.is_dir() else []
    roots += list(dict.fromkeys(SHIPPED_PARTS.values()))  # each shipped model once
    for root in roots:
        folder = root / name
        if folder.is_dir() and _host(folder) == host:
            return folder
    return None
