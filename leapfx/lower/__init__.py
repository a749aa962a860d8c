"""lower(sm, backend): one entry point from a rewritten model to the executors that run it.

Every backend gives the ``SpeculativeModel`` stage executors of one protocol
(``leapfx.runtime.executor.StageExecutor``); the schedules run them without knowing which:

================  ================================================================================
backend           what runs each stage
================  ================================================================================
``eager``         the stage GraphModules themselves (fused layers, no module dispatch)
``cpu_kernels``   eager copies whose projections, attention, norms and rotary run the
                  ``leapfx_cpu`` kernels (``cpu_kernels.py``; a float32 CPU model); a draft
                  chain where the recipe has one (``Capabilities.has_chain``, ``chain.py``)
``inductor``      ``torch.compile(fullgraph=True)`` graphs over the static cache
                  (``inductor.py``, compiling ``pure_stage.py``'s functions, built by
                  ``compile.py``; ``CompileOptions``' keywords)
``onnxruntime``   onnxruntime sessions over the stages exported to ``export_dir``
                  (``sm.export_onnx``), loaded as an ``OnnxModel`` (``onnxruntime.py``; its
                  stage executors: ``ort_stages.py``), which decodes under the same schedules
================  ================================================================================

What a recipe's stages can be lowered to is declared on the recipe
(``leapfx.runtime.capabilities.Capabilities``, ``sm.recipe.capabilities``) and asked here and by
the export, never read off the recipe's name. Writing the ONNX graphs is ``leapfx.export``'s (a
floor above, reached through ``sm.export_onnx``); reading an export back (``manifest.py``) and
running it (``onnxruntime.py``: ``OnnxModel(dir)`` opens an existing export) live here, as does
what a stage takes and returns (``stage_signature.py``), which the compiled stages and the
export both start from. ``SpeculativeModel.compile`` and ``use_cpu_kernels`` run this
``lower``: ``rewrite.apply`` hands it to the model it builds (the runtime, a floor below, does
not import it).

    >>> sm = lower(rewrite.apply(hf_model, "layerskip", exit_layer=4), "inductor")
    >>> sm.generate(input_ids, max_new_tokens=64)
    >>> om = lower(sm, "onnxruntime", export_dir="layerskip-onnx/", threads=2)
"""

from __future__ import annotations

from typing import Any

from ..runtime.capabilities import Capabilities
from ..runtime.executor import ChainExecutor, StageExecutor
from ..runtime.model import SpeculativeModel
from .compile import compile_model
from .cpu_kernels import use_kernels
from .onnxruntime import OnnxModel, lower_onnxruntime

BACKENDS = ("eager", "cpu_kernels", "inductor")  # lowered in place: lower returns the model
EXPORTED_BACKENDS = ("onnxruntime",)  # exported, then loaded: lower returns the loaded model

__all__ = [
    "BACKENDS",
    "EXPORTED_BACKENDS",
    "Capabilities",
    "ChainExecutor",
    "OnnxModel",
    "StageExecutor",
    "lower",
]


def lower(
    sm: SpeculativeModel, backend: str = "eager", **options: Any
) -> SpeculativeModel | OnnxModel:
    """Run ``sm``'s stages on ``backend`` (see the module doc); returns ``sm``, or for
    ``onnxruntime`` the ``OnnxModel`` of its export.

    ``options`` are the backend's: ``inductor`` takes ``SpeculativeModel.compile``'s keywords
    (``mode``, ``verify_shapes``, ``cuda_graphs``, ``warmup``, ``transpose_weights``,
    ``cpu_kernels``, ``draft_chain``); ``eager`` and ``cpu_kernels`` take none;
    ``onnxruntime`` takes ``export_dir`` (required), ``sm.export_onnx``'s keywords (``opset``,
    ``overwrite``, ``optimize``) and ``OnnxModel``'s (``providers``, ``threads``, ``spin``,
    ``recipe``, ``split_verify``, ``verify_threads``, ``thread_pool``). Lowering an eager model
    again replaces its executors; a compiled model stays compiled
    (``SpeculativeModel.use_cpu_kernels`` says so). ValueError for an unknown backend, options
    it does not take, or a recipe whose stages it cannot run (``Capabilities.compiles``,
    ``Capabilities.exportable``).

    >>> lower(sm, "cpu_kernels").cpu_kernels
    True
    """
    if backend not in BACKENDS + EXPORTED_BACKENDS:
        raise ValueError(
            f"backend: {backend!r} is invalid; allowed: "
            f"{', '.join(map(repr, BACKENDS + EXPORTED_BACKENDS))}"
        )
    if backend == "onnxruntime":
        return lower_onnxruntime(sm, **options)
    if backend == "inductor":
        return compile_model(sm, **options)
    if options:
        raise ValueError(
            f"{next(iter(options))}: backend {backend!r} takes no options; allowed: none"
        )
    return use_kernels(sm, backend == "cpu_kernels")
