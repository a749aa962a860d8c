"""Expert offload for MoE models: a fast tier of expert slots per layer over a slow tier.

``rewrite.apply(model, recipe, offload=OffloadOptions(...))`` runs any recipe over the
offloaded model: the ``offload-experts`` pass (``leapfx.passes.offload``) rewrites the graph,
then ``build_offload`` builds the runtime and binds it to the modules the pass inserted (see
``runtime`` for the design, ``slots`` for the cache rules, ``engine`` for the transfer engines,
``store`` for the slow tiers). ``load_offloaded(path)`` loads an MoE checkpoint without its
experts, which the slow tier then reads from it (``checkpoint``).
"""

from .build import build_offload
from .checkpoint import CheckpointExperts, load_offloaded
from .engine import CudaEngine, NativeEngine, ReadJob, ThreadEngine, TransferEngine
from .reuse import ReuseProbe, fit_reuse_probe
from .runtime import (
    DEFAULT_PREFETCH_LEAD,
    ENGINES,
    PREFETCH_POLICIES,
    ExpertOffload,
    NextGatePrefetch,
    OffloadedExperts,
    OffloadOptions,
    OffloadReport,
)
from .slots import POLICIES, Placement, SlotCache, SlotStats
from .store import DiskStore, HostStore

__all__ = [
    "DEFAULT_PREFETCH_LEAD",
    "ENGINES",
    "POLICIES",
    "PREFETCH_POLICIES",
    "CheckpointExperts",
    "CudaEngine",
    "DiskStore",
    "ExpertOffload",
    "HostStore",
    "NativeEngine",
    "NextGatePrefetch",
    "OffloadOptions",
    "OffloadReport",
    "OffloadedExperts",
    "Placement",
    "ReadJob",
    "ReuseProbe",
    "SlotCache",
    "SlotStats",
    "ThreadEngine",
    "TransferEngine",
    "build_offload",
    "fit_reuse_probe",
    "load_offloaded",
]
