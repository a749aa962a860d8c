"""Moved: ``M2R2Prefetcher`` is a module the offload pass inserts, in ``leapfx.passes.m2r2_stream``
(bound to its ``ExpertOffload`` by ``build_offload``). Kept so that old imports still work."""

from ...passes.m2r2_stream import M2R2Prefetcher

__all__ = ["M2R2Prefetcher"]
