"""Moved: ``M2R2Prefetcher`` is a module the offload pass inserts, in ``leapfx.modules.moe``
(bound to its ``ExpertOffload`` by ``build_offload``). Kept so that old imports still work."""

from ...modules.moe import M2R2Prefetcher

__all__ = ["M2R2Prefetcher"]
