"""``manifest.json``: what an ONNX export holds and how to run it, written last.

The manifest is the one file a runtime reads before opening any model: the recipe and its options
(so the runtime picks the same schedule), the attention layout, the KV-cache layers and their
shapes, the vocabulary and stop tokens, the generation defaults, and per stage its file, the
decoder layers it runs, the cache layers it reads and writes and the names of its inputs and
outputs. Its presence marks a complete export: the exporter writes it after every model file
passed ``onnx.checker`` and renames the whole directory into place in one step.

Example (layerskip, 4 layers, exit after 2)::

    {"format": "leapfx-onnx", "format_version": 1, "recipe": "layerskip",
     "stages": {"draft": {"file": "draft.onnx", "layer_ranges": [[0, 2]],
                          "cache_reads": [0, 1], "cache_writes": [0, 1], ...}, ...}, ...}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "leapfx-onnx"
FORMAT_VERSION = 2  # 2: static cache buffers written in place; 1: past + new concatenated
MANIFEST = "manifest.json"
# A standard decoder export (``export_onnx(..., format="genai")``): one graph that
# onnxruntime-genai and optimum load; its manifest records what was written, nothing to run.
GENAI_FORMAT = "leapfx-genai"


def layer_ranges(layers: list[int]) -> list[list[int]]:
    """Contiguous ``[start, stop)`` ranges of sorted layer indices.

    >>> layer_ranges([0, 1, 2, 5, 6])
    [[0, 3], [5, 7]]
    """
    ranges: list[list[int]] = []
    for i in sorted(layers):
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return ranges


def is_export_dir(path: Path) -> bool:
    """Whether ``path`` holds a leapfx ONNX export (a manifest of our formats, any version:
    an export of an older format may still be replaced by a new one)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") in (
            FORMAT,
            GENAI_FORMAT,
        )
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read and check ``path/manifest.json``; ValueError says what is wrong with it."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise ValueError(f"path: {str(path)!r} has no {MANIFEST}; expected a leapfx ONNX export")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"path: cannot read {str(file)!r}: {exc}") from None
    if isinstance(manifest, dict) and manifest.get("format") == GENAI_FORMAT:
        raise ValueError(
            f"path: {str(path)!r} is a standard decoder export (format='genai'); open it with "
            "onnxruntime_genai.Model, optimum's ORTModelForCausalLM or leapfx.deploy.Decoder"
        )
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"path: {str(file)!r} is not a {FORMAT} manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"path: {str(file)!r} has format_version {version!r}; this leapfx reads "
            f"{FORMAT_VERSION} (re-export the model with this version)"
        )
    return manifest
