"""Every ``nn.Module`` a pass inserts and the runtime runs, one file per paper or idea.

The floor beneath ``passes/`` and ``runtime/``: both import from here, and nothing here imports
leapfx beyond ``kernels/``. A pass decides *where* a module goes in the graph; the module here
says *what* it computes.

=================  ================================================================================
file               holds
=================  ================================================================================
``hf``             HF conventions the modules call by: the KV cache's keyword, expert tensors
``fused``          decoder layers without module dispatch (``FusedDecoderLayer``,
                   ``FusedAttention``, the ``Transposed*`` layers)
``kernel_layers``  the same on the ``leapfx_cpu`` kernels (``KernelDecoderLayer``,
                   ``KernelAttention``, ``KernelExperts``, ``KernelLinear``, ``KernelRMSNorm``,
                   ``RotaryTable``); ``rms_params``, ``kernel_rope``, ``require_kernels``
``kangaroo``       Kangaroo's adapter (``KangarooAdapter``)
``eagle``          EAGLE's draft head (``EagleHead``)
``draft_vocab``    a drafter's LM head over the N most frequent tokens (``SubsetLMHead``, FR-Spec)
``specee``         SpecEE's exit predictors (``ExitMLP``, ``LayerExit``, ``KernelLayerExit``,
                   ``SpecEEPredictors``) and their features (``exit_features``)
``m2r2``           M2R2's accelerated stream (``AcceleratedLayer``, ``ARLARouter``,
                   ``Accelerator``)
``m2r2_scratch``   what a drafting round or a training chain carries (``FastScratch``,
                   ``FastState``, ``ChainScratch``)
``m2r2_kernels``   M2R2 on the ``leapfx_cpu`` kernels: a fast layer's products
                   (``KernelAcceleratedLayer``), the gate and draft stages as one op
                   (``KernelGate``, ``KernelDraft``) and the packing every ``m2r2_*`` op reads
``moe``            MoE expert offload: ``OffloadedExperts``, ``NextGatePrefetch`` and M2R2's
                   prefetch stream ``M2R2Prefetcher``, bound to the offload runtime after the pass
=================  ================================================================================

An exit head (``InsertExitHead``) inserts no module of its own: it reuses the host's final norm
and LM head, so it has no file here.
"""
