"""lower(sm, backend): one entry point from a rewritten model to the executors that run it.

Every backend gives the ``SpeculativeModel`` stage executors of one protocol
(``leapfx.runtime.executor.StageExecutor``); the schedules run them without knowing which:

================  ================================================================================
backend           what runs each stage
================  ================================================================================
``eager``         the stage GraphModules themselves (fused layers, no module dispatch)
``cpu_kernels``   eager copies whose projections, attention, norms and rotary run the
                  ``leapfx_cpu`` kernels (``SpeculativeModel.use_cpu_kernels``; a float32 CPU
                  model); a draft chain where the recipe has one (``Capabilities.has_chain``)
``inductor``      ``torch.compile(fullgraph=True)`` graphs over the static cache
                  (``SpeculativeModel.compile``; its keyword options pass through)
================  ================================================================================

What a recipe's stages can be lowered to is declared on the recipe
(``leapfx.runtime.capabilities.Capabilities``, ``sm.recipe.capabilities``) and asked here and by
the export, never read off the recipe's name. ONNX export and onnxruntime decoding are
``sm.export_onnx(dir)`` and ``leapfx.export.OnnxModel(dir)`` (``leapfx.export`` sits a floor
above this one).

    >>> sm = lower(rewrite.apply(hf_model, "layerskip", exit_layer=4), "inductor")
    >>> sm.generate(input_ids, max_new_tokens=64)
"""

from __future__ import annotations

from typing import Any

from ..runtime.capabilities import Capabilities
from ..runtime.executor import ChainExecutor, StageExecutor
from ..runtime.model import SpeculativeModel

BACKENDS = ("eager", "cpu_kernels", "inductor")

__all__ = ["BACKENDS", "Capabilities", "ChainExecutor", "StageExecutor", "lower"]


def lower(sm: SpeculativeModel, backend: str = "eager", **options: Any) -> SpeculativeModel:
    """Run ``sm``'s stages on ``backend`` (see the module doc); returns ``sm``.

    ``options`` are the backend's: ``inductor`` takes ``SpeculativeModel.compile``'s keywords
    (``mode``, ``verify_shapes``, ``warmup``, ``transpose_weights``, ``cpu_kernels``,
    ``draft_chain``); ``eager`` and ``cpu_kernels`` take none. Lowering an eager model again
    replaces its executors; a compiled model stays compiled (``SpeculativeModel.use_cpu_kernels``
    says so). ValueError for an unknown backend, options it does not take, or a recipe whose
    stages it cannot run (``Capabilities.compiles``).

    >>> lower(sm, "cpu_kernels").cpu_kernels
    True
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"backend: {backend!r} is invalid; allowed: {', '.join(map(repr, BACKENDS))}"
        )
    if backend == "inductor":
        return sm.compile(**options)
    if options:
        raise ValueError(
            f"{next(iter(options))}: backend {backend!r} takes no options; allowed: none"
        )
    return sm.use_cpu_kernels(backend == "cpu_kernels")
