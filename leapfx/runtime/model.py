"""SpeculativeModel: what ``rewrite.apply`` returns; generates with a recipe's schedule.

It holds the rewritten graph, its stages and the recipe's options, shares every weight with the
original HF model by reference and never modifies it. ``generate`` follows HuggingFace's
conventions (``input_ids``/``attention_mask`` in, prompt + new tokens out; the model's
``generation_config`` with keyword overrides, every field applied or refused: see
``leapfx.runtime.generation``) and leaves the metrics of the call in ``last_metrics``. What it
is handed about its recipe (``RecipeInfo``: the schedule, options, capabilities, batch plan,
training hook) is ``recipe_info.py``'s.

Example::

    >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=2, num_speculations=4)
    >>> out = sm.generate(input_ids, max_new_tokens=32)     # == hf_model.generate(..., greedy)
    >>> sm.last_metrics.acceptance_rate, sm.last_metrics.ctar_curve
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from ..modules.kernel_layers import KernelDecoderLayer, KernelExperts, KernelLinear
from ..options import check_bool, check_int
from ..passes.capture import decoder_pieces
from ..passes.partition import Stages
from ..passes.skip_layers import DRAFT_SKIP, swift_stages
from . import schedules, swift
from .batch import BATCH_BACKENDS, BatchDecode, BatchPolicy
from .cache import StaticKVCache, cache_for
from .decode import cache_length, check_prompt, decode
from .executor import Lower
from .generation import GenerateFrontEnd, GenerationSource
from .masks import SUPPORTED_ATTENTION
from .metrics import DecodeMetrics
from .recipe_info import RecipeInfo, RecipeTraining, Schedule
from .rows import row_cache_for
from .runner import AttentionLayout, StageRunner
from .schedules import DecodeRequest

log = logging.getLogger(__name__)

# batch_decode(grow=True): the columns a growing batch cache starts with
GROW_FROM = 256


class SpeculativeModel(GenerateFrontEnd):
    """A rewritten model: stages + schedule. Create it with ``leapfx.rewrite.apply``.

    Attributes:
        graph_module: the rewritten layer-level graph.
        stages: the partitioned stages (``full``, ``draft``, ``verify`` ...).
        last_metrics: ``DecodeMetrics`` of the latest ``generate`` call (None before one).
        offload: the expert-offload runtime of an MoE model applied with ``offload=`` (an
            ``ExpertOffload``), else None.

    ``lower`` is ``leapfx.lower.lower``, which ``compile`` and ``use_cpu_kernels`` run, and
    ``export`` is ``leapfx.export.export_onnx``, which ``export_onnx`` runs: both sit on floors
    above the runtime, so ``rewrite.apply`` hands them in rather than the runtime importing
    them (the recipe's ``training`` for ``fit`` comes the same way, in ``RecipeInfo``).
    """

    def __init__(
        self,
        model: nn.Module,
        graph_module: fx.GraphModule,
        stages: Stages,
        recipe: RecipeInfo,
        *,
        offload: Any = None,
        lower: Lower | None = None,
        export: Callable[..., Any] | None = None,
    ) -> None:
        impl = model.config._attn_implementation
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"model.config._attn_implementation: {impl!r} is not supported; "
                f"allowed: {', '.join(SUPPORTED_ATTENTION)} (load the model with "
                "attn_implementation='sdpa')"
            )
        # Not an nn.Module on purpose: .to()/.train()/.half() on it must never reach the
        # user's model, whose modules the stages share.
        self._hf_model = model
        self.graph_module = graph_module
        self.stages = stages
        self.recipe = recipe
        self.last_metrics: DecodeMetrics | None = None
        pieces = decoder_pieces(model)
        param = next(model.parameters())
        self._layout = AttentionLayout(
            impl=impl,
            kinds=tuple(pieces.attn_kinds),
            window=pieces.sliding_window,
            dtype=param.dtype,
            device=param.device,
        )
        self._cache: StaticKVCache | None = None
        # Stage executors that generate() runs: the eager stages unless compile() replaced them.
        self._executors: dict[str, Any] | None = None
        self.backend = "eager"
        # The expert-offload runtime (an ExpertOffload that rewrite.apply(..., offload=...)
        # builds and binds to the graph's offloaded experts); its report of the latest
        # generate call lands in last_offload_report.
        self.offload = offload
        self.last_offload_report = None
        self._lower = lower
        self._export = export
        # swift: what the latest calibrate() measured (None before one).
        self.calibration = None
        # Batched decodes' draft-length policy (its costs are this model's on this machine).
        self._batch_policy: BatchPolicy | None = None

    @property
    def skip_search(self) -> Any:
        """swift with ``search="online"``: its on-the-fly skip-set search
        (``leapfx.runtime.skip_search.OnlineSkipSearch``: ``summary()``, ``as_dict()``,
        ``reset()``), whose trials and choice carry over from one ``generate`` call to the
        next; None for any other model."""
        return getattr(self.recipe.schedule, "keywords", {}).get("search")

    @property
    def hf_model(self) -> nn.Module:
        """The original HF model (shared, never modified)."""
        return self._hf_model

    @property
    def options(self) -> Any:
        return self.recipe.options

    @property
    def config(self):
        return self._hf_model.config

    def fit(self, data: Any, **options: Any) -> Any:
        """Train the parts the recipe inserted (Kangaroo: the adapter); the host stays frozen.

        ``data`` and ``options`` are the recipe's (see ``leapfx.train.kangaroo.fit``). The stages
        share the trained modules, so ``generate`` uses them at once.

        Training runs on the plain eager stages: the CPU kernels' packed weight copies of the
        trained parts (an EAGLE head's layer, ...) would go stale, so where they were on they
        are off during ``fit`` and packed again from the trained weights after it
        (``leapfx.train.fit_options.on_plain_stages``).

        >>> sm = rewrite.apply(hf_model, "kangaroo", exit_layer=2)
        >>> sm.fit(token_ids, steps=200)
        """
        return self._training("fit").fit(self, data, **options)

    def save_parts(self, path: Any) -> Any:
        """Save what ``fit`` trained with the recipe's options (safetensors + JSON).

        Load it back with ``rewrite.apply(hf_model, recipe, parts=path)``; every recipe with
        trained parts (Kangaroo's adapter, draft heads, predictors ...) saves this way.
        """
        return self._training("save_parts").save(self, path)

    def save_adapter(self, path: Any) -> Any:
        """Kangaroo's name for ``save_parts`` (kept; ``apply(..., adapter=path)`` loads it)."""
        return self._training("save_adapter").save(self, path)

    def use_cpu_kernels(self, enabled: bool = True) -> SpeculativeModel:
        """Run the eager stages' projections through leapfx's small-M CPU kernels; returns self.

        The kernels (``leapfx.kernels.cpu``, C++ built on first use) read each weight once for all
        the rows of a verify pass, where MKL's cost grows about linearly with the rows
        (docs/benchmarks.md has the speedups). The stages keep packed copies of the projection
        weights, taken here (call it again after training the model in place); the math is the same
        up to summation order, so outputs are the same tokens except where two logits tie to
        rounding. Needs a float32 model on a CPU (ValueError otherwise). ``enabled=False`` returns
        to the plain eager stages. ``rewrite.apply`` calls it where its ``cpu_kernels`` (auto by
        default) says so. For compiled stages pass ``cpu_kernels`` to ``compile()`` (there too they
        are on by default where they run). MoE layers run their attention (``KernelAttention``) and
        experts (``KernelExperts``: ``leapfx_cpu::moe_experts``) on them too, offloaded experts over
        the slot pools. It runs ``leapfx.lower.lower(self, "cpu_kernels" | "eager")``.

        >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=4)  # on: a float32 CPU model
        >>> sm.use_cpu_kernels(False).cpu_kernels  # back to the plain eager stages
        False
        """
        check_bool("enabled", enabled)
        return self._lowering("use_cpu_kernels")(self, "cpu_kernels" if enabled else "eager")

    @property
    def cpu_kernels(self) -> bool:
        """Whether the stages that ``generate`` runs use the ``leapfx_cpu`` kernels."""
        kinds = (KernelDecoderLayer, KernelExperts, KernelLinear)
        for stage in (self._executors or {}).values():
            module = getattr(getattr(stage, "pure", None), "stage", stage)
            if isinstance(module, torch.nn.Module) and any(
                isinstance(m, kinds) for m in module.modules()
            ):
                return True
        return False

    def _training(self, what: str) -> RecipeTraining:
        if self.recipe.training is None:
            raise ValueError(
                f"{what}: recipe {self.recipe.name!r} inserts nothing that trains; use a recipe "
                "with trained parts (e.g. 'kangaroo')"
            )
        return self.recipe.training()

    def compile(
        self,
        *,
        mode: str | None = None,
        verify_shapes: str | None = None,
        cuda_graphs: str | None = None,
        warmup: bool = True,
        transpose_weights: bool | None = None,
        cpu_kernels: bool | None = None,
        draft_chain: bool = True,
        batches: bool = False,
    ) -> SpeculativeModel:
        """Lower every stage through ``torch.compile(fullgraph=True)`` (Inductor); returns self.

        Decoding runs the compiled stages over the same static KV cache and schedules;
        ``warmup`` compiles every shape a decode uses now (minutes on a CPU for a real model),
        so that ``generate`` never compiles. The cache is sized once (``max_cache_len``, or
        the first rounding step of 256 positions); a longer generation grows it, which
        compiles again once. See ``leapfx.lower.inductor.CompileOptions`` for ``mode``,
        ``verify_shapes``, ``cuda_graphs`` (on CUDA: one captured graph per stage call and
        shape, replayed), ``transpose_weights`` and ``cpu_kernels`` (on a CPU the compiled
        stages keep a transposed copy of the projection weights, taken here: call
        ``compile()`` again after training the model in place; with float32 weights they
        multiply through leapfx's small-M C++ kernels, built on first use). ``draft_chain``:
        LayerSkip's greedy rounds draft their d tokens in one compiled call of d unrolled draft
        steps (``CompiledChain``) instead of d calls; same tokens. ``batches``: also compile
        the graphs a batch (``input_ids`` [B, S] with left padding) runs, which otherwise
        compile on the first batched call (one set for every batch size >= 2, one for a single
        row). It runs ``leapfx.lower.lower(self, "inductor", ...)``.

        >>> sm = rewrite.apply(hf_model, "layerskip", exit_layer=4).compile()
        """
        return self._lowering("compile")(
            self, "inductor", mode=mode, verify_shapes=verify_shapes, cuda_graphs=cuda_graphs,
            warmup=warmup,
            transpose_weights=transpose_weights, cpu_kernels=cpu_kernels, draft_chain=draft_chain,
            batches=batches,
        )  # fmt: skip

    def _lowering(self, what: str) -> Lower:
        if self._lower is None:
            raise ValueError(
                f"{what}: this SpeculativeModel was built without a lowering; build it with "
                "leapfx.rewrite.apply, or call leapfx.lower.lower(model, backend)"
            )
        return self._lower

    def set_executors(self, executors: dict[str, Any] | None, backend: str) -> None:
        """Run ``executors`` (None: the eager stages) on ``backend`` from now on: what
        ``leapfx.lower`` calls once it has lowered the stages."""
        self._executors = executors
        self.backend = backend

    def _compile_cache_len(self) -> int:
        """The cache length compiled graphs are specialised to: the current cache's, or the
        first one generate() would allocate."""
        return self._cache_for(self._cache.max_len if self._cache else 1).max_len

    def _cache_for(self, needed: int) -> StaticKVCache:
        """The model's one KV cache, reset, with room for ``needed`` positions.

        Allocated once (at ``max_cache_len``, or ``needed`` rounded up) and reused by every
        later call that fits, so its buffers keep their addresses (CUDA graphs replay on
        them); a call that needs more than the allocated maximum reallocates it, and says so.
        """
        fixed = getattr(self.options, "max_cache_len", None)
        size = cache_length(needed, fixed, self.recipe.lookahead)
        if self._cache is None or self._cache.max_len < size:
            if self._cache is not None:
                log.info(
                    "KV cache: %d positions needed, %d allocated; reallocating %d (compiled "
                    "stages specialised to the old length compile again; set max_cache_len "
                    "to allocate the maximum once)",
                    needed, self._cache.max_len, size,
                )  # fmt: skip
            # Inference tensors, made the same way whoever asks (compile() or generate()):
            # compiled graphs guard on whether their inputs are inference tensors.
            with torch.inference_mode():
                self._cache = cache_for(
                    self._hf_model, size, extra_layers=self.recipe.extra_cache_layers
                )
        self._cache.reset()
        return self._cache

    def _generation_source(self) -> GenerationSource:
        hf = self._hf_model
        return GenerationSource(
            config=hf.generation_config,
            vocab_size=hf.config.vocab_size,
            max_positions=getattr(hf.config, "max_position_embeddings", None),
            recipe=self.recipe.name,
            lossless=self.recipe.lossless,
        )

    def _generate_prompt(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.to(self._layout.device)

    def _generate_decode(
        self, prompt: torch.Tensor, request: DecodeRequest
    ) -> tuple[list[int], DecodeMetrics]:
        if self._hf_model.training:
            warnings.warn(
                "the model is in training mode (dropout active); call model.eval() first",
                stacklevel=3,  # the caller of generate
            )
        return self._decode(self.recipe.schedule, prompt, request)

    def _generate_batch(
        self, prompt: torch.Tensor, pads: list[int], requests: list[DecodeRequest]
    ) -> tuple[list[list[int]], DecodeMetrics]:
        rows = prompt.shape[0]
        needed = prompt.shape[1] + max(r.max_new_tokens for r in requests) + self.recipe.lookahead
        decode = self.batch_decode(needed, rows, pads)
        metrics = decode.metrics
        metrics.prompt_tokens = prompt.shape[1]
        start = time.perf_counter()
        with torch.inference_mode():
            decode.start(prompt, pads, requests)
            while decode.rows:
                decode.round()
        tokens = [decode.finished.pop(b) for b in range(rows)]
        metrics.seconds = time.perf_counter() - start
        metrics.stage_seconds = dict(decode.runner.seconds)
        metrics.new_tokens = sum(len(t) for t in tokens)
        return tokens, metrics

    def batch_decode(
        self, needed: int, rows: int = 0, pads: list[int] | None = None, *, grow: bool = False
    ) -> BatchDecode:
        """A :class:`~leapfx.runtime.batch.BatchDecode` of this model (its recipe's batch plan,
        the model's batch policy, eager or compiled stages) over a cache of ``rows`` rows of at
        least ``needed`` positions each (left-padded by ``pads``): ``start`` a batch on it, or
        ``admit`` rows one by one (``rows`` 0: an empty batch, a server's). ``grow`` (eager
        stages): the cache starts at ``GROW_FROM`` columns and grows as rows need, up to
        ``needed``, so that rows joining and leaving copy what is in use. Refuses, naming the
        reason, a recipe, backend or offloaded model that does not batch."""
        plan = self.recipe.batch
        what = f"{rows} rows (or a left-padded row)" if rows else "a batch"
        if plan is None:
            raise ValueError(
                f"input_ids: {what} are not supported by recipe "
                f"{self.recipe.name!r} ({self.recipe.batch_refusal}); allowed: one unpadded "
                "row, or a recipe that batches (autoregressive, lookup, auto, layerskip, "
                "kangaroo, swift, eagle)"
            )
        if self.backend not in BATCH_BACKENDS:
            raise ValueError(
                f"input_ids: {what} run on the "
                f"{' and '.join(BATCH_BACKENDS)} backends, and this model's stages run on "
                f"{self.backend!r} (its sessions take one row); allowed: one unpadded row, or "
                "the model on 'eager' or 'inductor'"
            )
        if self.offload is not None:
            raise ValueError(
                f"input_ids: {what}: an offloaded MoE model decodes "
                "one row at a time; allowed: one unpadded row"
            )
        if self._hf_model.training:
            warnings.warn(
                "the model is in training mode (dropout active); call model.eval() first",
                stacklevel=4,
            )
        size = cache_length(needed, getattr(self.options, "max_cache_len", None),
                            self.recipe.lookahead)  # fmt: skip
        if self.backend == "inductor":
            # compiled graphs are specialised to the cache length: the model's own cache's
            size = max(size, self._compile_cache_len())
        grow_to = None
        if grow and self.backend == "eager" and size > GROW_FROM:
            size, grow_to = GROW_FROM, size
        cache = row_cache_for(
            self._hf_model, size, rows, extra_layers=self.recipe.extra_cache_layers,
            grow_to=grow_to,
        )  # fmt: skip
        pads = [0] * rows if pads is None else pads
        runner = StageRunner(self._executors or self.stages.modules, cache, self._layout, pads)
        policy = None
        if plan.drafter != "none":
            if self._batch_policy is None or self._batch_policy.max_drafts != plan.num_speculations:
                self._batch_policy = BatchPolicy(plan.num_speculations)
            policy = self._batch_policy
        metrics = DecodeMetrics(
            schedule=self.recipe.name, num_speculations=plan.num_speculations, batch_size=rows,
        )  # fmt: skip
        metrics.cpu_kernels = self.cpu_kernels
        return BatchDecode(runner, metrics, plan, policy)

    def _decode(
        self, schedule: Schedule, prompt: torch.Tensor, request: DecodeRequest, name: str = ""
    ) -> tuple[list[int], DecodeMetrics]:
        """Run ``schedule`` (named ``name`` in the metrics; default the recipe's) on this
        model's stages and cache: ``generate``'s decode, and ``calibrate``'s timed ones."""
        needed = prompt.shape[1] + request.max_new_tokens + self.recipe.lookahead
        stages = self._executors or self.stages.modules
        runner = StageRunner(stages, self._cache_for(needed), self._layout)
        if self.offload is not None:
            self.offload.begin()  # on a CPU it may set torch's threads (compute_threads)
        try:
            tokens, metrics = decode(
                schedule, runner, prompt, request, name=name or self.recipe.name,
                num_speculations=getattr(self.options, "num_speculations", 0),
            )  # fmt: skip
            metrics.cpu_kernels = self.cpu_kernels
            if self.offload is not None:
                self.offload.synchronize()  # prefetches still in flight finish before we return
                self.last_offload_report = self.offload.report(len(tokens), metrics.seconds)
        finally:
            if self.offload is not None:
                self.offload.end()
        return tokens, metrics

    @torch.inference_mode()
    def calibrate(
        self,
        prompts: Any,
        *,
        max_new_tokens: int = 32,
        max_skip: int | None = None,
        progress: bool = True,
    ) -> Any:
        """swift: find the skip set whose decodes measure fastest on ``prompts`` and draft with
        it from now on; returns what was measured (``leapfx.runtime.swift.SkipCalibration``).

        The model is changed in place: its ``draft`` stage is cut again without the set found,
        ``options.skip_layers`` is that set, and ``save_parts(dir)`` stores it, so that
        ``rewrite.apply(hf_model, "swift", parts=dir)`` drafts with it (a ``skip_layers``
        given there must be the same set). ``prompts``: token ids, a list of [1, n] tensors,
        decoded greedily for ``max_new_tokens`` tokens each (no EOS stop) after one untimed
        warm-up, on this model's stages as ``generate`` runs them (its ``num_speculations``,
        its ``lookup``); the empty set is timed as autoregressive decoding of the ``full``
        stage. ``runtime.swift.search_skip_set`` grows the set one layer at a time while the
        measured tokens/s improve: O(L^2) decodes, so keep the prompts few and short.
        ``max_skip``: at most this many layers skipped (default L - 2, at least 1). Where no
        set beats autoregressive decoding the model drafts with the fastest single layer
        measured and the record's ``speedup`` is below 1 (a warning says so): ``autoregressive``
        or ``auto`` then decodes faster than any swift set here. ``progress``: a progress bar.

        >>> sm = rewrite.apply(hf_model, "swift")
        >>> sm.calibrate([tok(p, return_tensors="pt").input_ids for p in texts]).skip_layers
        (3, 5, 8)
        >>> sm.save_parts("swift-parts/")
        """
        if self.recipe.name != "swift":
            raise ValueError(
                f"calibrate: recipe {self.recipe.name!r} has no skip set to calibrate; allowed: "
                "a 'swift' model (rewrite.apply(model, 'swift'))"
            )
        if self.skip_search is not None:
            raise ValueError(
                "calibrate: this swift model searches its skip set while decoding "
                "(search='online'; sm.skip_search holds it); allowed: a model applied with "
                "search=None"
            )
        num_layers = self.config.num_hidden_layers
        ok = (
            isinstance(prompts, (list, tuple))
            and len(prompts) > 0
            and all(
                isinstance(p, torch.Tensor) and p.dim() == 2 and p.shape[0] == 1 for p in prompts
            )
        )
        if not ok:
            raise ValueError(
                f"prompts: {type(prompts).__name__} is invalid; allowed: a non-empty list of "
                "token-id tensors of shape [1, n]"
            )
        for p in prompts:
            check_prompt(p, None, self.config.vocab_size)
        check_int("max_new_tokens", max_new_tokens, 1, allowed="int >= 1")
        check_int("max_skip", max_skip, 1, num_layers - 1, none=True)
        check_bool("progress", progress)
        prompts = [p.to(self._layout.device) for p in prompts]
        before = self.recipe

        def speed(skip: tuple[int, ...]) -> float:
            if skip:
                self._use_skip_set(skip)
                schedule, name = self.recipe.schedule, "swift"
            else:
                schedule, name = schedules.autoregressive, "autoregressive"

            def run(prompt, request):
                return self._decode(schedule, prompt, request, name)[1]

            return swift.measured_speed(run, prompts, max_new_tokens)

        try:
            result = swift.fastest_skip_set(speed, num_layers, max_skip=max_skip, progress=progress)
        except BaseException:
            self._use_skip_set(before.options.skip_layers)  # the model as it was
            self.recipe = before
            raise
        self._use_skip_set(result.skip_layers)
        self.calibration = result
        if result.speedup < 1:
            warnings.warn(
                f"calibrate: no skip set beat autoregressive decoding on these prompts (the "
                f"fastest, {result.skip_layers}, ran {result.speedup:.2f}x); the model drafts "
                "with it, but 'autoregressive' or 'auto' decodes faster here",
                stacklevel=3,  # the caller of calibrate, past inference_mode's wrapper
            )
        return result

    def _use_skip_set(self, skip: tuple[int, ...]) -> None:
        """swift: cut the ``draft`` stage again without layers ``skip`` and record the set in
        the options (``parts``, where the set came from a directory, no longer applies); the
        CPU kernels' executors, where on, are packed again from the stages."""
        if skip == self.options.skip_layers:
            return
        kernels = self._executors is not None
        self.graph_module.meta[DRAFT_SKIP] = skip
        self.stages = swift_stages(self.graph_module)
        options = replace(self.options, skip_layers=skip, parts=None)
        self.recipe = replace(self.recipe, options=options)
        self._executors = None
        if kernels:
            self.use_cpu_kernels(True)

    def export_onnx(
        self,
        path: Any,
        *,
        opset: int = 23,
        overwrite: bool = False,
        optimize: bool = True,
        format: str = "leapfx",
        tokenizer: Any = None,
    ) -> Any:
        """Export every stage as an ONNX model with an explicit KV cache, plus ``manifest.json``.

        Run the export with ``leapfx.export.OnnxModel(path).generate(...)``; see
        ``leapfx.export`` for the format. Needs the ``onnx`` extra. Returns the export's path.
        ``optimize``: leapfx's graph rewrites (``leapfx.export.onnx_optimize``); False keeps
        the graphs as traced. ``format="genai"``: the model as one standard decoder that
        onnxruntime-genai and optimum's ``ORTModelForCausalLM`` load, with ``tokenizer``'s
        files (``leapfx.export.genai``).

        >>> sm.export_onnx("layerskip-onnx/", overwrite=True)
        """
        if self.offload is not None:
            raise ValueError(
                "export_onnx: the experts of this model are offloaded (a runtime, not a graph); "
                "allowed: a model applied without offload="
            )
        if self._export is None:
            raise ValueError(
                "export_onnx: this SpeculativeModel was built without an exporter; build it with "
                "leapfx.rewrite.apply, or call leapfx.export.export_onnx(model, path)"
            )
        return self._export(
            self, path, opset=opset, overwrite=overwrite, optimize=optimize, format=format,
            tokenizer=tokenizer,
        )  # fmt: skip

    def check_compiles(self, what: str) -> None:
        """ValueError naming ``what`` where the recipe's stages do not compile with Inductor."""
        can = self.recipe.capabilities
        if not can.compiles:
            runs = (
                "eager and in onnxruntime (export_onnx), not under Inductor"
                if can.exportable
                else "eager only"
            )
            raise ValueError(
                f"{what}: recipe {self.recipe.name!r} runs its stages {runs} "
                f"({can.eager_reason}); allowed: backend='eager', with use_cpu_kernels() for "
                "the projections"
            )

    def __repr__(self) -> str:
        return (
            f"SpeculativeModel(recipe={self.recipe.name!r}, options={self.options}, "
            f"backend={self.backend!r})"
        )
