"""``manifest.json``: read and written through :mod:`leapfx.deploy.manifest`, which the torch-free
deployment runtime shares (it sits on a floor below ``lower``); re-exported here."""

from __future__ import annotations

from ..deploy.manifest import (
    FORMAT,
    FORMAT_VERSION,
    GENAI_FORMAT,
    MANIFEST,
    is_export_dir,
    layer_ranges,
    read_manifest,
)

__all__ = [
    "FORMAT", "FORMAT_VERSION", "GENAI_FORMAT", "MANIFEST", "is_export_dir", "layer_ranges",
    "read_manifest",
]  # fmt: skip
