"""Deployment without torch: a leapfx ONNX export decoded with onnxruntime, numpy and tokenizers.

    >>> from leapfx.deploy import Decoder
    >>> Decoder("layerskip-onnx/").generate_text("def fib(n):", max_new_tokens=32)

This package imports no other leapfx package and neither torch nor transformers (the floor
just above ``options``; ``lower`` and ``export`` read and write the manifest through
:mod:`leapfx.deploy.manifest`). See :mod:`leapfx.deploy.decoder` for what it runs.
"""

from __future__ import annotations

from .decoder import SCHEDULES, Decoder, lookup_drafts
from .manifest import FORMAT, FORMAT_VERSION, GENAI_FORMAT, MANIFEST, read_manifest

__all__ = [
    "FORMAT", "FORMAT_VERSION", "GENAI_FORMAT", "MANIFEST", "SCHEDULES", "Decoder",
    "lookup_drafts", "read_manifest",
]  # fmt: skip
