"""Moved: onnxruntime decoding lives in ``leapfx.lower.onnxruntime`` (loading an export runs
through ``lower/``; this package writes it). Kept so that old imports keep working."""

from __future__ import annotations

from ..lower.onnxruntime import (
    THREAD_POOLS,
    OnnxModel,
    OrtChainStage,
    OrtKVCache,
    OrtStage,
    SplitVerify,
    default_providers,
    shared_pool_threads,
)

__all__ = [
    "THREAD_POOLS",
    "OnnxModel",
    "OrtChainStage",
    "OrtKVCache",
    "OrtStage",
    "SplitVerify",
    "default_providers",
    "shared_pool_threads",
]
