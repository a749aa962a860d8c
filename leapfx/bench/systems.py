"""The systems a bench run times (``System``: a named way to decode) and the table of rows
each benchmarked recipe adds (``RECIPE_ROWS``: a new recipe's rows are one function of a
``RowRun`` and one entry), with llama.cpp's and the offload rows.

    >>> rows = [build(run) for carried_by, build in RECIPE_ROWS if "kangaroo" in carried_by]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .. import rewrite
from ..kernels import cpu
from ..parts.draft_vocab import read_ranking
from ..parts.m2r2 import read_parts_config
from ..passes.quantized_draft import QDRAFT_SIZE
from ..runtime.metrics import DecodeMetrics
from . import genai, llamacpp
from .config import TRAINING_FREE, BenchConfig
from .offload import ORACLE_ROW, RoutingOracle

log = logging.getLogger(__name__)


@dataclass
class SystemRun:
    """What one system produced over all prompts in one pass."""

    outputs: list[torch.Tensor]
    seconds: float
    metrics: list[DecodeMetrics]
    offload: list = field(default_factory=list)  # OffloadReports of an offload row

    @classmethod
    def merge(cls, runs: list[SystemRun]) -> SystemRun:
        """One pass's run from its per-prompt runs, in prompt order."""
        return cls(
            [o for r in runs for o in r.outputs],
            sum(r.seconds for r in runs),
            [m for r in runs for m in r.metrics],
            [o for r in runs for o in r.offload],
        )


class System:
    """A named way to decode: ``generate(prompt) -> (ids [1, n + new], metrics or None)``."""

    def __init__(
        self,
        name: str,
        generate: Callable[[torch.Tensor], torch.Tensor],
        metrics: Callable[[], DecodeMetrics | None] = lambda: None,
        lossless: bool = True,
        info: dict | None = None,
        model=None,
        offload=None,
    ) -> None:
        self.name = name
        self.generate = generate
        self.metrics = metrics
        self.lossless = lossless
        # The SpeculativeModel or OnnxModel behind a lossy leapfx row: teacher-forced
        # agreement runs on it.
        self.model = model
        self.info = info or {}  # copied into the row's extra (e.g. cpu_kernels)
        # An offload row's SpeculativeModel: its last_offload_report is kept per prompt.
        self.offload = offload

    def run(self, prompts: list[torch.Tensor]) -> SystemRun:
        outputs, metrics, reports = [], [], []
        start = time.perf_counter()
        for prompt in prompts:
            outputs.append(self.generate(prompt))
            m = self.metrics()
            if m is not None:
                metrics.append(m)
            if self.offload is not None:
                reports.append(self.offload.last_offload_report)
        return SystemRun(outputs, time.perf_counter() - start, metrics, reports)


def sampling_kwargs(config: BenchConfig) -> dict:
    if config.temperature > 0:
        return {"do_sample": True, "temperature": config.temperature}
    return {"do_sample": False}


def llama_cpp_systems(model: nn.Module, config: BenchConfig) -> list[System]:
    """llama.cpp's rows on ``config.llama_cpp`` (see ``leapfx.bench.llamacpp``): none without
    a GGUF file, in a sampling run, or without llama-cpp-python (a warning says how to get it).
    """
    if config.llama_cpp is None:
        return []
    if config.temperature > 0:
        log.warning("leapfx bench: llama_cpp rows run greedy runs only; skipped")
        return []
    if not llamacpp.available():
        log.warning("leapfx bench: llama_cpp rows skipped: no llama-cpp-python; install with: %s",
                    llamacpp.INSTALL)  # fmt: skip
        return []
    runs = llamacpp.llama_cpp_runs(
        config.llama_cpp, threads=torch.get_num_threads(), max_new_tokens=config.max_new_tokens,
        eos=llamacpp.eos_ids(model),
    )  # fmt: skip
    # lossy in the report's terms: 8-bit activations, its agreement is reported
    return [System(name, run, lossless=False, info=info) for name, run, info in runs]


def genai_systems(model: nn.Module, config: BenchConfig, root: str) -> list[System]:
    """onnxruntime-genai's rows (``leapfx.bench.genai``) beside the onnxruntime backend's: the
    model exported under ``root`` as its decoder; none in a sampling run or without the
    package (a warning says how to get it). Peers' rows: none where the run leaves out HF's
    (``hf_baselines`` off) or times throughput only."""
    if "onnxruntime" not in config.backends or config.throughput_only or not config.hf_baselines:
        return []
    if config.temperature > 0:
        log.warning("leapfx bench: onnxruntime_genai rows run greedy runs only; skipped")
        return []
    if not genai.available():
        log.warning("leapfx bench: onnxruntime_genai rows skipped: no onnxruntime-genai; "
                    "install with: %s", genai.INSTALL)  # fmt: skip
        return []
    log.info("exporting the model for onnxruntime-genai to %s/onnxruntime_genai", root)
    path = genai.export(model, f"{root}/onnxruntime_genai", torch.get_num_threads())
    n = config.max_new_tokens
    return [
        System("onnxruntime_genai", genai.greedy(path, n, ngram=False)),
        System("onnxruntime_genai_ngram", genai.greedy(path, n, ngram=True)),
    ]


@dataclass(frozen=True)
class RowRun:
    """What a recipe's rows are built from on one backend: the model, the run's config,
    ``ours(name, sm, lossless=True) -> System`` (the row on that backend) and layerskip's
    options (E and d, shared with HF's assistant), and the backend's name."""

    model: nn.Module
    config: BenchConfig
    ours: Callable[..., System]
    layerskip_opts: dict
    backend: str = "eager"


def _layerskip_rows(run: RowRun) -> list[System]:
    return [run.ours("leapfx_layerskip", rewrite.apply(run.model, "layerskip",
                                                       **run.layerskip_opts))]  # fmt: skip


def _layerskip_dynamic_rows(run: RowRun) -> list[System]:
    eta = run.config.confidence_threshold
    if not eta:
        return []
    dynamic = rewrite.apply(run.model, "layerskip", confidence_threshold=eta, **run.layerskip_opts)
    return [run.ours("leapfx_layerskip_dynamic", dynamic)]


def _specee_rows(run: RowRun) -> list[System]:
    model, config, ours = run.model, run.config, run.ours
    kw = specee_options(config)
    lossy = rewrite.apply(model, "specee", **kw)
    rows = [ours("leapfx_specee", lossy, lossless=False)]
    # The paper's KV policy (exited tokens' skipped layers stay empty), beside it.
    masked = rewrite.apply(model, "specee", kv_fill="mask", **kw)
    rows.append(ours("leapfx_specee_mask", masked, lossless=False))
    d = config.num_speculations
    verified = rewrite.apply(model, "specee", verify=True, max_draft_tokens=d, **kw)
    system = ours("leapfx_specee_verified", verified)
    # Rounds end at the first pass that does not exit: no fixed d, no speedup formula.
    system.info["dynamic_draft_length"] = True
    rows.append(system)
    # EAGLE's head alone as a lossless drafter: SpecEE's candidate source, beside it.
    eagle = rewrite.apply(model, "eagle", parts=config.eagle_parts)
    rows.append(ours("leapfx_eagle", eagle))
    return rows


def _kangaroo_rows(run: RowRun) -> list[System]:
    model, config = run.model, run.config
    kw = {"max_draft_tokens": config.num_speculations, "adapter": config.adapter}
    if config.kangaroo_exit_layer is not None:
        kw["exit_layer"] = config.kangaroo_exit_layer
    fixed = rewrite.apply(model, "kangaroo", confidence_threshold=0.0, **kw)
    kw["confidence_threshold"] = config.confidence_threshold
    dynamic = rewrite.apply(model, "kangaroo", **kw)
    rows = [run.ours("leapfx_kangaroo_fixed", fixed), run.ours("leapfx_kangaroo", dynamic)]
    return rows + _subset_rows(run, "kangaroo", config.adapter, kw)


def _m2r2_rows(run: RowRun) -> list[System]:
    model, config, ours = run.model, run.config, run.ours
    kangaroo = rewrite.apply(model, "kangaroo", adapter=config.adapter)
    rows = [ours("leapfx_kangaroo", kangaroo)]
    kw = {"parts": config.parts}
    if config.m2r2_speculations is not None:
        kw["num_speculations"] = config.m2r2_speculations
    rows.append(ours("leapfx_m2r2", rewrite.apply(model, "m2r2", **kw)))
    rows += _subset_rows(run, "m2r2", config.parts, kw)
    kw = {"parts": config.exit_parts or config.parts}
    if config.m2r2_threshold is not None:
        kw["threshold"] = config.m2r2_threshold
    if config.m2r2_exit_gates is not None:
        kw["exit_gates"] = config.m2r2_exit_gates
    if _has_routers(kw["parts"]):
        exits = rewrite.apply(model, "m2r2_exit", **kw)
        refusal = exits.recipe.capabilities.refusal(exits.options)
        if run.backend == "onnxruntime" and refusal is not None:
            # m2r2 exports; m2r2_exit's per-layer exits do not
            log.warning("leapfx bench: no leapfx_m2r2_exit row on onnxruntime: %s", refusal)
        else:
            rows.append(ours("leapfx_m2r2_exit", exits, lossless=False))
    else:
        log.warning("parts %s hold no ARLA routers: no leapfx_m2r2_exit row", config.parts)
    return rows


# The _vocab rows' draft vocabulary: FR-Spec's smallest setting for Llama-3's 128k vocabulary,
# a sixth of SmolLM2's 49,152 ids.
EAGLE_DRAFT_VOCAB = 8192


def _subset_rows(run: RowRun, recipe: str, parts: str | None, kw: dict) -> list[System]:
    """``leapfx_<recipe>_vocab`` (the drafter over the training data's most frequent tokens,
    FR-Spec) and ``leapfx_<recipe>_lookup`` (that drafter composed with prompt lookup, each
    round choosing by measured tokens per cost), where the parts hold a ranking and the
    vocabulary is large enough for the subset to matter (kangaroo and m2r2; EAGLE's rows are
    ``_eagle_rows``'). ``kw``: the recipe's options of its main row."""
    model = run.model
    if parts is None or model.config.vocab_size < 4 * EAGLE_DRAFT_VOCAB:
        return []
    if read_ranking(parts) is None:
        return []
    kw = {**kw, "draft_vocab": EAGLE_DRAFT_VOCAB}
    rows = [run.ours(f"leapfx_{recipe}_vocab", rewrite.apply(model, recipe, **kw))]
    both = rewrite.apply(model, recipe, lookup=True, adaptive=True, **kw)
    rows.append(run.ours(f"leapfx_{recipe}_lookup", both))
    rows[-1].info["dynamic_draft_length"] = True
    return rows


def _eagle_rows(run: RowRun) -> list[System]:
    model, config = run.model, run.config
    kangaroo = rewrite.apply(model, "kangaroo", adapter=config.adapter)
    rows = [run.ours("leapfx_kangaroo", kangaroo)]
    kw = {"confidence_threshold": config.confidence_threshold}
    eagle = rewrite.apply(model, "eagle", parts=config.eagle_parts, **kw)
    rows.append(run.ours("leapfx_eagle", eagle))
    # The same head drafting over the training data's most frequent tokens only (FR-Spec),
    # where its parts hold the ranking and the vocabulary is large enough for it to matter.
    vocab = model.config.vocab_size
    if config.eagle_parts is not None and vocab >= 4 * EAGLE_DRAFT_VOCAB:
        if read_ranking(config.eagle_parts) is not None:
            kw["draft_vocab"] = EAGLE_DRAFT_VOCAB
            subset = rewrite.apply(model, "eagle", parts=config.eagle_parts, **kw)
            rows.append(run.ours("leapfx_eagle_vocab", subset))
    if config.eagle_parts is not None:
        # Composed with prompt lookup: each round drafts with the head, with the prompt's
        # n-grams or not at all, by measured tokens per cost (the subset head where it runs).
        both = rewrite.apply(model, "eagle", parts=config.eagle_parts, lookup=True,
                             adaptive=True, **kw)  # fmt: skip
        rows.append(run.ours("leapfx_eagle_lookup", both))
        rows[-1].info["dynamic_draft_length"] = True
    return rows


def _training_free_rows(name: str, run: RowRun) -> list[System]:
    """At the recipe's defaults (HF's d is not theirs); swift also as
    ``leapfx_swift_adaptive`` (``lookup=True, adaptive=True``: each round chooses among the
    layer-skipped drafter, prompt lookup and no drafting by measured tokens per cost) and as
    ``leapfx_swift_online`` (``search="online"``: the skip set searched while decoding; its
    search goes on across the warm-up and timed passes, as a user's later calls would)."""
    # onnxruntime runs auto in its lookup form, adaptive prompt lookup, as `leapfx export`
    # does: the form every model has and leapfx.deploy runs (the head `apply(model, "auto")`
    # finds may draft over a vocabulary subset, which leapfx.deploy does not read); a
    # trained EAGLE head exports as the eagle recipe (the leapfx_eagle rows)
    exportable = name == "auto" and run.backend == "onnxruntime"
    plain = rewrite.apply(run.model, name, **({"parts": None} if exportable else {}))
    system = run.ours(f"leapfx_{name}", plain)
    if exportable:
        system.info["auto_as"] = plain.recipe.name  # auto itself: lookup, no head
    # lookup / auto: a round drafts what a match gives (or nothing), qspec as many as its
    # adaptive policy chooses: no fixed d for the formula; swift drafts d every round
    system.info["dynamic_draft_length"] = name != "swift"
    if name == "qspec":  # the copy's memory: its blocks beside the float weights
        system.info["draft_weights"] = dict(plain.stages["draft"].meta[QDRAFT_SIZE])
    systems = [system]
    if name == "swift":
        sm = rewrite.apply(run.model, "swift", lookup=True, adaptive=True)
        systems.append(run.ours("leapfx_swift_adaptive", sm))
        systems[-1].info["dynamic_draft_length"] = True
        online = rewrite.apply(run.model, "swift", search="online")
        refusal = online.recipe.capabilities.refusal(online.options)
        if run.backend == "onnxruntime" and refusal is not None:
            # the search cuts and times draft stages of the eager model while decoding
            log.warning("leapfx bench: no leapfx_swift_online row on onnxruntime: %s", refusal)
            return systems
        systems.append(run.ours("leapfx_swift_online", online))
        # its sets and plain steps change while it searches: no fixed d for the formula
        systems[-1].info["dynamic_draft_length"] = True
    return systems


# The leapfx rows after leapfx_autoregressive and leapfx_early_exit, in the order they run
# and print: (the recipes whose runs carry them, how to build them on one backend). A row two
# recipes carry (leapfx_layerskip in a layerskip,kangaroo run) is built for each entry and
# kept once, at its first place (``build_systems``).
RECIPE_ROWS: tuple[tuple[frozenset[str], Callable[[RowRun], list[System]]], ...] = (
    (frozenset({"layerskip", "kangaroo", "m2r2"}), _layerskip_rows),
    (frozenset({"layerskip"}), _layerskip_dynamic_rows),
    (frozenset({"specee"}), _specee_rows),
    (frozenset({"kangaroo"}), _kangaroo_rows),
    (frozenset({"m2r2"}), _m2r2_rows),
    (frozenset({"eagle"}), _eagle_rows),
    *((frozenset({name}), partial(_training_free_rows, name)) for name in TRAINING_FREE),
)


def offload_rows(model, config: BenchConfig, exit_layer: int, n: int, sampling, gen):
    """The offload rows (eager; all of them with the CPU kernels or none, as ``--cpu-kernels``
    says: the experts then run ``leapfx_cpu::moe_experts`` over the weights or the slots), the
    resident one first. Speculative rows draft at the run's E and d."""
    extra = {"generator": gen} if sampling["do_sample"] else {}
    specs = config.offload_systems(exit_layer)
    if sampling["do_sample"] or config.warmup < 1:
        # The oracle replays each prompt's routing, recorded in the warm-up pass: greedy only.
        del specs[ORACLE_ROW]
    systems = []
    for name, (recipe, offload, options) in specs.items():
        sm = rewrite.apply(model, recipe, offload=offload, **options)
        sm.use_cpu_kernels(use_cpu_kernels(config, sm))
        generate = RoutingOracle(sm).generate if name == ORACLE_ROW else sm.generate

        def run(prompt, generate=generate):
            return generate(prompt, max_new_tokens=n, **sampling, **extra)

        systems.append(System(name, run, lambda sm=sm: sm.last_metrics,
                              offload=sm if offload is not None else None,
                              info={"cpu_kernels": sm.cpu_kernels}))  # fmt: skip
    return systems


def specee_options(config: BenchConfig) -> dict:
    """The specee options of a run: its parts and threshold, where given."""
    kw: dict = {}
    if config.specee_parts is not None:
        kw["parts"] = config.specee_parts
    if config.specee_threshold is not None:
        kw["threshold"] = config.specee_threshold
    return kw


def _has_routers(parts: str | None) -> bool:
    """Whether ``parts`` (None: untrained, routers included) serve ``m2r2_exit``."""
    if parts is None:
        return True
    return read_parts_config(parts).get("recipe") == "m2r2_exit"


def hf_compiles_static(model: nn.Module) -> bool:
    """Whether HF ``generate`` compiles the decode step of a static-cache call on this model.

    transformers 5 (``GenerationMixin._valid_auto_compile_criteria``) compiles it by itself
    when the cache is compileable (a static one is) and the model sits on a CUDA, XPU, Neuron
    or TPU device; on a CPU it runs eagerly unless the caller passes a ``CompileConfig``.
    """
    return next(model.parameters()).device.type in ("cuda", "xpu", "neuron", "tpu")


# How --cpu-kernels names itself in errors (leapfx.kernels.cpu.resolve).
CPU_KERNELS_FLAG = {"option": "--cpu-kernels", "on": "on", "allowed": "auto or off"}


def use_cpu_kernels(config: BenchConfig, sm) -> bool:
    """Whether ``sm``'s eager or compiled stages run leapfx's CPU kernels in this run."""
    lay = sm._layout
    return cpu.resolve(config.cpu_kernels, lay.device, lay.dtype, **CPU_KERNELS_FLAG)
