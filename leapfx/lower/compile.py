"""``compile_stages``: every stage of a SpeculativeModel as an Inductor executor (``inductor.py``).

``lower(sm, "inductor", **options)`` (and ``sm.compile(**options)``) runs ``compile_model``: it
checks the recipe compiles, takes transposed (and, on a float32 CPU model, kernel) copies of
the stages (``cpu_kernels.with_transposed_weights``), finds each stage's signature
(``stage_signature.discover``), wraps it in a ``CompiledStage``, adds a ``CompiledChain`` where
the recipe drafts a chain, compiles SpecEE's per-layer segments (``specee_segments.py``) and
warms every shape up.

    >>> compile_model(sm, verify_shapes="padded").backend
    'inductor'
"""

from __future__ import annotations

import logging
import time

import torch

from ..kernels import cpu
from ..runtime.rows import row_cache_for
from .chain import chain_length
from .cpu_kernels import with_transposed_weights
from .cuda_graphs import GraphSet
from .inductor import CompiledChain, CompiledStage, CompileOptions, graphs_kind
from .pure_stage import PureStage
from .specee_segments import is_segment, specee_segments, warmup_segments
from .stage_signature import EAGLE_STAGES, discover

log = logging.getLogger(__name__)


def compile_model(sm, **options):
    """``sm`` with every stage compiled (``CompileOptions``' keywords); returns ``sm``.
    ValueError for a recipe that runs eager only or a model whose experts are offloaded."""
    sm.check_compiles("compile")
    if sm.offload is not None:
        raise ValueError(
            "compile: the experts of this model are offloaded (data-dependent transfers "
            "that torch.compile cannot trace); allowed: the eager backend"
        )
    sm.set_executors(compile_stages(sm, CompileOptions(**options)), "inductor")
    return sm


def compile_stages(sm, options: CompileOptions) -> dict[str, CompiledStage]:
    """A CompiledStage for every stage of SpeculativeModel ``sm`` (warmed up if asked)."""
    options = options.validate()
    segmented = sm.recipe.capabilities.layer_segments  # SpecEE's per-layer stages
    if segmented and "eagle_head" in sm.stages.modules:
        raise ValueError(
            "backend: 'inductor' is not implemented for specee with drafter='eagle' (missing: "
            "the head's stage signature); allowed: 'eager', or drafter 'exit_head' / 'kangaroo'"
        )
    lay = sm._layout
    cache_len = sm._compile_cache_len()
    transpose = options.transpose_weights
    if transpose is None:
        transpose = lay.device.type == "cpu"
    kernels = cpu.resolve(options.cpu_kernels, lay.device, lay.dtype)
    transpose = transpose or kernels
    shared: dict = {}
    # One set of CUDA graphs (one memory pool) for every stage: manual capture (cuda_graphs.py)
    graphs = GraphSet() if graphs_kind(options, lay.device) == "manual" else None
    out: dict[str, CompiledStage] = {}
    segments: dict = {}
    for name, stage in sm.stages.modules.items():
        if transpose:
            stage_t = with_transposed_weights(stage, shared, kernels=kernels)
        if segmented and is_segment(name):  # per-layer segments: specee_segments.py
            segments[name] = stage_t if transpose else stage
            continue
        sig = discover(sm, name, stage)
        if transpose:
            stage = stage_t
        pure = PureStage(stage, sig.tensor_inputs, sig.groups, lay)
        out[name] = CompiledStage(
            name,
            pure,
            options=options,
            device=lay.device,
            max_hidden=max(1, sm.recipe.lookahead - 1),
            graphs=graphs,
            state_width=sm.config.hidden_size if "prev_hidden" in sig.tensor_inputs else None,
        )
    length = chain_length(sm) if options.draft_chain else 0
    if length:
        out["draft_chain"] = CompiledChain(out["draft"], length)
    if options.warmup:
        # Under inference mode, as generate() runs: dynamo guards on it (inference tensors).
        # On the model's own cache, which generate() reuses: graphs recorded on its buffers'
        # addresses (CUDA graphs) replay on them. What warm-up writes there is never read:
        # generate() resets the lengths, and slots past a query are masked.
        with torch.inference_mode():
            cache = sm._cache_for(cache_len)
            example = {
                "input_ids": torch.zeros(1, 3, dtype=torch.long, device=lay.device),
                "exit_hidden": torch.zeros(  # up to a full round's cached exit states
                    (1, max(2, sm.recipe.lookahead - 1), sm.config.hidden_size),
                    dtype=lay.dtype,
                    device=lay.device,
                ),
            }
            for name, executor in out.items():
                start = time.perf_counter()
                full_draft = name not in ("verify", *EAGLE_STAGES)
                shapes = {"input_ids": example["input_ids"]} if full_draft else example
                executor.warmup(cache, shapes)
                log.info("compiled stage %s in %.1f s", name, time.perf_counter() - start)
            cache.reset()
            plan = sm.recipe.batch
            if options.batches and plan is not None:
                _warmup_batches(sm, out, plan, example, cache_len)
    if segments:
        compiled = specee_segments(sm, segments, options, lay.device)
        if options.warmup:
            with torch.inference_mode():
                start = time.perf_counter()
                warmup_segments(compiled, sm._cache_for(cache_len), sm.config.hidden_size,
                                lay.dtype, lay.device)  # fmt: skip
                log.info("compiled the specee segments in %.1f s", time.perf_counter() - start)
        out.update(compiled)
    return out


def _warmup_batches(sm, stages: dict, plan, example: dict, cache_len: int) -> None:
    """Compile the graphs a batch of ``plan`` runs (``CompiledStage.warmup_rows``): the full
    stage's steps and chunks (prefill, verify), the draft stage's steps where the recipe drafts
    with it, the split verify's where it verifies with it (EAGLE: the target's and the
    head's)."""

    def cache_for_rows(batch: int):
        extra = sm.recipe.extra_cache_layers
        return row_cache_for(sm._hf_model, cache_len, batch, extra_layers=extra)

    warm = {"full": True}
    if plan.drafter == "eagle":  # the target verifies, the head drafts a token a call
        warm = {"target": True, "head": False}
    if plan.drafter == "stage":
        warm["draft"] = False
    if plan.split_verify:
        warm["verify"] = True
    start = time.perf_counter()
    with torch.inference_mode():
        for name, chunks in warm.items():
            if name in stages:
                stages[name].warmup_rows(cache_for_rows, example, chunks)
    log.info("compiled the batch graphs (%s) in %.1f s", ", ".join(warm),
             time.perf_counter() - start)  # fmt: skip
