"""The benchmark harness behind ``leapfx bench``: systems side by side, one process, one run.

Every system decodes the same prompts with the same ``max_new_tokens`` and the same stop rule:

- ``hf_greedy``                HF ``generate`` (the baseline, speedup 1.00x)
- ``hf_static``                HF ``generate(cache_implementation="static")``: HF's strongest
                               path; HF compiles the decode step itself on a GPU (on a CPU it
                               runs eagerly). Every row's ``speedup_vs_static`` is against it.
- ``hf_assistant_early_exit``  HF's own LayerSkip: ``generate(assistant_early_exit=E,
                               num_assistant_tokens=d)``, constant schedule
- ``hf_prompt_lookup``         HF's prompt lookup decoding: ``generate(
                               prompt_lookup_num_tokens=10)``, training-free n-gram drafts
- ``llama_cpp``, ``llama_cpp_lookup``  llama.cpp (llama-cpp-python) on the same GGUF file, plain
                               and with its prompt-lookup drafting (``leapfx.bench.llamacpp``;
                               greedy runs of a GGUF model, the extra ``llamacpp`` installed):
                               8-bit activations, so reported as lossy (their agreement)
- ``leapfx_autoregressive``    the leapfx runtime without speculation
- ``leapfx_early_exit``        exit after E layers for every token (lossy: ``agreement``, the
                               teacher-forced agreement with greedy, and ``avg_layers``)
- ``leapfx_<recipe>``          the recipe under test (``layerskip`` by default); ``specee``
                               gives ``leapfx_specee`` (lossy, kv_fill="next", the
                               default), ``leapfx_specee_mask`` (lossy, kv_fill="mask", the
                               paper's KV policy) and ``leapfx_specee_verified``;
                               ``swift`` also gives ``leapfx_swift_adaptive`` (with
                               ``lookup=True, adaptive=True``)
- ``leapfx_resident``, ``leapfx_offload_*``  with ``offload_slots`` (an MoE model): eager
                               decoding (with the CPU kernels where they apply, like the
                               other eager rows) with every expert in memory, and with the experts
                               offloaded to disk under each prefetch policy
                               (``leapfx.bench.offload``); their rows carry ``extra["offload"]``.
                               Greedy runs with a warm-up pass add ``leapfx_offload_oracle``,
                               the ceiling of prefetching (it replays the warm-up's routing)

Timing: one warm-up pass per system, then ``repeats`` timed passes; within a pass the systems
run in a rotated order so drift on a shared machine spreads over all of them. A system's time is
the median over passes of its total time for all prompts, and tokens/s = new tokens / that time.
Speedups are ratios of tokens/s measured in the same run.

Greedy runs compare every lossless row with the baseline prompt by prompt (``identical n/m``);
at the first differing token of each differing prompt the full model measures whether the two
candidates were a near tie (``leapfx.bench.ties``): the row's ``differences`` in ``--json``.
"""

from __future__ import annotations

import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from .. import rewrite
from ..kernels import cpu
from ..lower import lower
from ..lower.onnxruntime import OnnxModel, shared_pool_threads
from ..offload import DEFAULT_PREFETCH_LEAD
from ..options import check_bool
from ..passes.accelerator_checkpoint import read_parts_config
from ..passes.draft_vocab import read_ranking
from ..passes.quantized_draft import QDRAFT_SIZE
from ..runtime.metrics import DecodeMetrics
from . import llamacpp
from .agreement import teacher_forced_agreement
from .offload import ORACLE_ROW, RoutingOracle, offload_systems, summarize
from .report import Row, progress_bar
from .sweep import (
    autoregressive_steps,  # sweep imports this module
    predicted_speedup,
)
from .ties import first_difference

log = logging.getLogger(__name__)


BACKENDS = ("eager", "inductor", "onnxruntime")
SPLIT_VERIFY = ("auto", "on", "off")  # --onnx-split-verify
THREAD_POOLS = ("shared", "session")  # --onnx-thread-pool
# How much faster a split verify must time than the whole graph for --onnx-split-verify auto
# to choose it (fastest_split_verify): it makes two session calls a verify where the whole
# graph makes one, which its short timing does not show: where the two tie in that timing, the
# bench's decodes measure the split verify slower (numbers: docs/benchmarks.md).
SPLIT_MARGIN = 0.03
# hf_prompt_lookup's prompt_lookup_num_tokens: the value HF's assisted-generation docs use.
HF_PROMPT_LOOKUP_TOKENS = 10
# Training-free drafters: one leapfx_<name> row each, at the recipe's default options.
TRAINING_FREE = ("lookup", "swift", "qspec", "auto")
BENCHED_RECIPES = (
    "autoregressive", "early_exit", "layerskip", "kangaroo", "eagle", "specee", "m2r2", "lookup",
    "swift", "qspec", "auto",
)  # fmt: skip


@dataclass(frozen=True)
class BenchConfig:
    """Options of one benchmark run (the CLI's flags)."""

    recipe: str = "layerskip"
    exit_layer: int | None = None  # None: the recipe's default
    num_speculations: int = 6
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy; > 0: sampling rows with a distribution check
    # kangaroo runs: the adapter (None: untrained, initialised from layer l), its exit layer
    # (None: the adapter's or the recipe default) and eta (None: the adapter's or 0.6).
    # layerskip runs: eta > 0 adds a leapfx_layerskip_dynamic row with that threshold.
    adapter: str | None = None
    kangaroo_exit_layer: int | None = None
    confidence_threshold: float | None = None
    # m2r2 runs: the accelerator parts (None: untrained) and gamma (None: the recipe's 3); the
    # run also carries leapfx_layerskip (E, d) and leapfx_kangaroo (``adapter``, its own eta).
    parts: str | None = None
    m2r2_speculations: int | None = None
    m2r2_threshold: float | None = None  # leapfx_m2r2_exit's tau (None: the recipe's 0.8)
    m2r2_exit_gates: tuple[int, ...] | None = None  # its deciding gates (None: the parts')
    exit_parts: str | None = None  # leapfx_m2r2_exit's parts (None: ``parts`` if they serve it)
    # eagle runs: the EAGLE head's parts (None: untrained, copied from the last layer). The
    # leapfx_eagle row drafts with the parts' options (d, threshold) unless
    # confidence_threshold is given; the leapfx_kangaroo row beside it with the adapter's.
    eagle_parts: str | None = None
    # Which backend runs the leapfx stages: "eager" (PyTorch), "inductor" (every leapfx system's
    # stages compiled with torch.compile and warmed up before timing) or "onnxruntime" (every
    # leapfx system is exported to ONNX and runs in onnxruntime sessions). HF rows stay eager.
    backend: str = "eager"
    export_dir: str | None = None  # onnxruntime: where exports go (None: a temp dir)
    # onnxruntime intra-op threads for every onnxruntime row. None (auto): the faster of 1 and
    # torch's thread count, timed on the autoregressive export before the run (on a small
    # model one thread can beat several: the work per op is too small to split).
    onnx_threads: int | None = None
    # intra-op threads of a split verify's upper part (OnnxModel verify_threads), spinning
    # when above 1: None, the rows' own count; "auto", the faster of 1 and torch's thread count
    # timed per speculative export. Off by default: it takes a second core that the
    # autoregressive row does not use, and costs more than it gains when that core is busy.
    onnx_verify_threads: int | str | None = None
    # layerskip's verify on onnxruntime as two calls (OnnxModel split_verify: the draft stage,
    # then verify's upper part: one copy of the lower layers' weights in a round) or as the one
    # exported verify graph. "auto": the faster of the two, timed per export (which wins
    # depends on whether both copies fit the CPU's cache); "on" / "off": fixed.
    onnx_split_verify: str = "auto"
    # Where the onnxruntime rows' intra-op threads live (OnnxModel thread_pool): "shared" switches
    # this process's onnxruntime to one process-wide pool that every stage shares (the
    # `leapfx bench` command's default: its process decodes with leapfx only); "session", a
    # pool per session (the default here: a library call must not switch its caller's process).
    onnx_thread_pool: str = "session"
    # The GGUF file the model was loaded from: the llama_cpp and llama_cpp_lookup rows run
    # llama.cpp on it (leapfx.bench.llamacpp; greedy runs, llama-cpp-python installed). None:
    # no such rows.
    llama_cpp: str | None = None
    # eager and inductor leapfx rows: projections through leapfx's small-M CPU kernels
    # (leapfx.kernels.cpu). None: where they apply (a float32 model on a CPU) and build.
    cpu_kernels: bool | None = None
    repeats: int = 3
    warmup: int = 1
    hf_baselines: bool = True
    # Only the systems whose speed does not depend on acceptance (hf_greedy, hf_static,
    # leapfx_autoregressive on each backend): a model with random weights (--random-model).
    throughput_only: bool = False
    # specee runs: the parts directory (None: untrained predictors) and the exit threshold
    # (None: the parts' own).
    specee_parts: str | None = None
    specee_threshold: float | None = None
    # MoE models: the offload rows (leapfx.bench.offload) with this many expert slots per
    # layer (an integer, or a fraction in (0, 1] of each layer's experts); None: no such rows.
    offload_slots: int | float | None = None
    offload_m2r2_parts: str | None = None  # leapfx_offload_m2r2's rate-2 fast stream
    offload_dir: str | None = None  # where the disk tiers' files go (None: temporary files)
    offload_engine: str = "auto"  # OffloadOptions.engine: auto | native | thread
    offload_prefetch_lead: int | None = DEFAULT_PREFETCH_LEAD  # None: all at once
    offload_slow_dtype: str | None = None  # OffloadOptions.slow_dtype: None | auto | float16 | ...
    # the *_reuse rows' learned eviction (a ReuseProbe file; None: no such rows)
    offload_reuse_probe: str | None = None
    # leapfx_offload_layerskip's drafts a round; None: fitted to the slots
    # (``rewrite.fit_drafts_to_slots``), not the resident rows' num_speculations
    offload_num_speculations: int | None = None

    def validate(self) -> BenchConfig:
        checks = [
            ("--num-speculations", self.num_speculations, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--repeats", self.repeats, 1),
            ("--warmup", self.warmup, 0),
        ]
        for name, value, low in checks:
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {value!r} is invalid; allowed: an integer >= {low}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature: {self.temperature!r} is invalid; allowed: >= 0")
        if self.onnx_threads is not None and (
            not isinstance(self.onnx_threads, int) or self.onnx_threads < 1
        ):
            raise ValueError(
                f"--onnx-threads: {self.onnx_threads!r} is invalid; allowed: auto or an "
                "integer >= 1"
            )
        vt = self.onnx_verify_threads
        if vt is not None and vt != "auto" and (not isinstance(vt, int) or vt < 1):
            raise ValueError(
                f"--onnx-verify-threads: {vt!r} is invalid; allowed: same, auto or an integer >= 1"
            )
        if self.onnx_split_verify not in SPLIT_VERIFY:
            raise ValueError(
                f"--onnx-split-verify: {self.onnx_split_verify!r} is invalid; allowed: "
                f"{', '.join(SPLIT_VERIFY)}"
            )
        if self.onnx_thread_pool not in THREAD_POOLS:
            raise ValueError(
                f"--onnx-thread-pool: {self.onnx_thread_pool!r} is invalid; allowed: "
                f"{', '.join(THREAD_POOLS)}"
            )
        if self.onnx_thread_pool == "shared" and self.onnx_verify_threads is not None:
            raise ValueError(
                f"--onnx-verify-threads: {self.onnx_verify_threads!r} gives verify's upper part a "
                "pool of its own; allowed with --onnx-thread-pool shared: same (or pass "
                "--onnx-thread-pool session)"
            )
        check_bool("--cpu-kernels", self.cpu_kernels, none=True, allowed="auto, on or off")
        names = self.backends
        bad = next((b for b in names if b not in BACKENDS), None)
        if bad is None and (not names or len(set(names)) < len(names)):
            bad = self.backend
        if bad is not None:
            raise ValueError(
                f"--backend: {bad!r} is invalid; allowed: one or more of "
                f"{', '.join(BACKENDS)}, comma-separated without repeats"
            )
        return self

    @property
    def recipes(self) -> tuple[str, ...]:
        """The recipes of ``recipe`` (a name, or several separated by commas): the rows of
        each, every row once."""
        return tuple(r.strip() for r in self.recipe.split(",") if r.strip())

    def offload_systems(self, exit_layer: int) -> dict:
        """The offload rows of this run (``leapfx.bench.offload.offload_systems``: row name ->
        recipe, offload options, recipe options), speculative ones exiting at ``exit_layer``."""
        return offload_systems(
            self.offload_slots, exit_layer=exit_layer,
            num_speculations=self.offload_num_speculations,
            m2r2_parts=self.offload_m2r2_parts, path=self.offload_dir,
            engine=self.offload_engine, reuse_probe=self.offload_reuse_probe,
            prefetch_lead=self.offload_prefetch_lead, slow_dtype=self.offload_slow_dtype,
        )  # fmt: skip

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends of ``backend`` (a name, or several separated by commas)."""
        return tuple(b.strip() for b in self.backend.split(",") if b.strip())


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


def _sampling_kwargs(config: BenchConfig) -> dict:
    if config.temperature > 0:
        return {"do_sample": True, "temperature": config.temperature}
    return {"do_sample": False}


def build_systems(model: nn.Module, config: BenchConfig, generator_seed: int = 0) -> list[System]:
    """The systems of a run, HF baseline first.

    ``layerskip`` (and ``kangaroo``, whose runs also carry a ``layerskip`` row at the same d and
    a fixed-length ``leapfx_kangaroo_fixed`` row, eta = 0) share E and d with HF's assistant.
    A layerskip run with ``confidence_threshold`` > 0 adds ``leapfx_layerskip_dynamic``: the
    same E and at most d drafts, a round stopping at the first draft whose exit top-1
    probability is <= the threshold.
    With several backends (``--backend eager,inductor``) every leapfx system runs once per
    backend, named ``<system>@<backend>``, so backends compare side by side in one run.
    ``throughput_only`` keeps hf_greedy, hf_static and leapfx_autoregressive (per backend).
    """
    d = config.num_speculations
    layerskip_opts = {"num_speculations": d}
    if config.exit_layer is not None:
        layerskip_opts["exit_layer"] = config.exit_layer
    layerskip_recipe = rewrite.get_recipe("layerskip")  # options only: nothing captured
    num_layers = model.config.num_hidden_layers
    exit_layer = rewrite.make_options(layerskip_recipe, num_layers, layerskip_opts).exit_layer
    sampling = _sampling_kwargs(config)
    n = config.max_new_tokens
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(generator_seed)

    def hf(**extra):
        def run(prompt):
            with torch.inference_mode():
                return model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                    **sampling, **extra,
                )  # fmt: skip

        return run

    systems = []
    if config.hf_baselines:
        systems.append(System(baseline_name(config), hf()))
        systems.append(System("hf_static", hf(cache_implementation="static"),
                              info={"hf_compiled": hf_compiles_static(model)}))  # fmt: skip
    if config.hf_baselines and not config.throughput_only:
        assistant = hf(
            assistant_early_exit=exit_layer,
            num_assistant_tokens=d,
            num_assistant_tokens_schedule="constant",
        )
        systems.append(System("hf_assistant_early_exit", assistant))
        # HF's training-free drafting: n-gram matches in the prompt and the text so far.
        lookup = hf(prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
        systems.append(System("hf_prompt_lookup", lookup))
    systems += _llama_cpp_systems(model, config)
    recipes = config.recipes
    bad = next((r for r in recipes if r not in BENCHED_RECIPES), None)
    if bad is not None or not recipes or len(set(recipes)) < len(recipes):
        raise ValueError(
            f"--recipe: {bad or config.recipe!r} is not benchmarked; allowed: one or more of "
            f"{', '.join(BENCHED_RECIPES)}, comma-separated without repeats"
        )
    backends = config.backends
    for backend in backends:
        to_backend = _backend(config, backend)
        suffix = f"@{backend}" if len(backends) > 1 else ""

        def ours(name: str, sm, lossless: bool = True, to_backend=to_backend, suffix=suffix):
            extra = {"generator": gen} if sampling["do_sample"] else {}
            sm = to_backend(name + suffix, sm)

            def run(prompt):
                return sm.generate(prompt, max_new_tokens=n, **sampling, **extra)

            info = {"cpu_kernels": sm.cpu_kernels} if hasattr(sm, "cpu_kernels") else {}
            if hasattr(sm, "threads"):  # an OnnxModel
                info["onnx_threads"] = sm.threads
                info["onnx_shared_pool"] = sm.shared_threads
                info["onnx_threads_timing"] = getattr(sm, "threads_timing", None)
                timed = sm.split_verify_timing is not None
                if "verify" in sm.stages and (timed or config.onnx_split_verify != "auto"):
                    info["onnx_split_verify"] = sm.split_verify
                    info["onnx_split_verify_timing"] = sm.split_verify_timing
                if sm.verify_threads != sm.threads:
                    info["onnx_verify_threads"] = sm.verify_threads
                if getattr(sm, "verify_threads_timing", None):
                    info["onnx_verify_threads_timing"] = sm.verify_threads_timing
            # eta > 0: rounds may stop short of d, which the speedup formula does not model.
            eta = getattr(getattr(sm, "options", None), "confidence_threshold", 0)
            info["dynamic_draft_length"] = bool(eta)
            # SpeculativeModel and OnnxModel both take teacher_tokens (lossy recipes).
            return System(name + suffix, run, lambda: sm.last_metrics, lossless=lossless,
                          info=info, model=None if lossless else sm)  # fmt: skip

        systems.append(ours("leapfx_autoregressive", rewrite.apply(model, "autoregressive")))
        if config.throughput_only:
            continue
        early = rewrite.apply(model, "early_exit", exit_layer=exit_layer)
        systems.append(ours("leapfx_early_exit", early, lossless=False))
        row_run = RowRun(model, config, ours, layerskip_opts)
        for carried_by, rows in RECIPE_ROWS:  # in the table's order
            if carried_by & set(recipes):
                systems += rows(row_run)
    # Recipes sharing a row (layerskip,kangaroo: leapfx_layerskip): each row once.
    systems = list({s.name: s for s in systems}.values())
    if config.offload_slots is not None:
        systems += _offload_systems(model, config, exit_layer, n, sampling, gen)
    return systems


def _llama_cpp_systems(model: nn.Module, config: BenchConfig) -> list[System]:
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


@dataclass(frozen=True)
class RowRun:
    """What a recipe's rows are built from on one backend: the model, the run's config,
    ``ours(name, sm, lossless=True) -> System`` (the row on that backend) and layerskip's
    options (E and d, shared with HF's assistant)."""

    model: nn.Module
    config: BenchConfig
    ours: Callable[..., System]
    layerskip_opts: dict


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
    plain = rewrite.apply(run.model, name)
    system = run.ours(f"leapfx_{name}", plain)
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
        # its sets and plain steps change while it searches: no fixed d for the formula
        online = rewrite.apply(run.model, "swift", search="online")
        systems.append(run.ours("leapfx_swift_online", online))
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


def _offload_systems(model, config: BenchConfig, exit_layer: int, n: int, sampling, gen):
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


def _backend(config: BenchConfig, backend: str):
    """name, SpeculativeModel -> what runs it: itself (eager), itself compiled (inductor) or an
    onnxruntime OnnxModel of its export. The last is ``lower(sm, "onnxruntime")`` in its two
    steps (``sm.export_onnx``, then ``OnnxModel``), because the thread count is timed on the
    first export before any model loads (onnxruntime sizes its shared pool once a process)."""
    if backend == "eager":

        def eager(name: str, sm):
            kernels = use_cpu_kernels(config, sm)  # apply's auto, or not
            return lower(sm, "cpu_kernels" if kernels else "eager")

        return eager
    if backend == "inductor":

        def compile_(name: str, sm):
            log.info("compiling %s with torch.compile (inductor)", name)
            return lower(sm, "inductor", cpu_kernels=use_cpu_kernels(config, sm))

        return compile_

    root = config.export_dir or tempfile.mkdtemp(prefix="leapfx-bench-onnx-")
    chosen: dict = {}  # one thread count for every onnxruntime row of the run

    # A process already on onnxruntime's shared pool (an earlier run in it) keeps it and its size.
    pool = None if shared_pool_threads() is not None else config.onnx_thread_pool

    def export(name: str, sm):
        path = f"{root}/{name.replace('@', '-')}"
        log.info("exporting %s to %s", name, path)
        sm.export_onnx(path, overwrite=True)
        if not chosen:
            if shared_pool_threads() is not None:
                chosen.update(threads=shared_pool_threads(), timing=None)
            elif config.onnx_threads is not None:
                chosen.update(threads=config.onnx_threads, timing=None)
            else:
                chosen.update(zip(("threads", "timing"), fastest_onnx_threads(path), strict=True))
        threads = chosen["threads"]
        split = config.onnx_split_verify != "off"
        om = _onnx_model(path, threads, split_verify=split, thread_pool=pool)
        om.threads_timing = chosen["timing"]
        om.split_verify_timing = None
        if config.onnx_split_verify == "auto" and om.split_verify:
            split, timing = fastest_split_verify(path, threads)
            if not split:
                om = _onnx_model(path, threads, split_verify=False)
                om.threads_timing = chosen["timing"]
            om.split_verify_timing = timing
        vt = config.onnx_verify_threads
        if vt is not None and om.split_verify:
            timing = None
            if vt == "auto":
                vt, timing = fastest_verify_threads(path, threads)
            if vt != om.verify_threads:
                kept = om.threads_timing, om.split_verify_timing
                om = _onnx_model(path, threads, verify_threads=vt)
                om.threads_timing, om.split_verify_timing = kept
            om.verify_threads_timing = timing
        return om

    return export


def fastest_onnx_threads(
    path: str, *, new_tokens: int = 32, repeats: int = 3
) -> tuple[int, dict[int, float]]:
    """The faster of 1 and ``torch.get_num_threads()`` onnxruntime intra-op threads on the
    export at ``path``, and each count's median seconds per token of its own schedule (a
    ``new_tokens`` greedy decode of a fixed prompt, one untimed call first, the counts timed in
    turn so drift on a shared machine falls on both)."""
    # Each count on pools of its own: onnxruntime's shared pool is sized once per process, for
    # the count this chooses (``_onnx_model``).
    return _fastest_count(
        lambda t: _onnx_model(path, t, thread_pool="session"), "threads",
        new_tokens=new_tokens, repeats=repeats,
    )  # fmt: skip


def _onnx_model(path: str, threads: int | None, **kw):
    """The bench's OnnxModel. On pools of their own (``thread_pool="session"``, or None in a
    process not switched to the shared pool) more than one thread spins within a call
    (``spin``: handing each small op to a sleeping worker costs more than the op); on
    onnxruntime's process-wide pool (``"shared"``) its workers spin as onnxruntime says."""
    return OnnxModel(path, threads=threads, spin=threads is not None and threads > 1, **kw)


def fastest_verify_threads(
    path: str, threads: int | None, *, new_tokens: int = 32, repeats: int = 3
) -> tuple[int, dict[int, float]]:
    """As :func:`fastest_onnx_threads`, for the intra-op threads of verify's upper part alone
    (``OnnxModel(verify_threads=...)``; the other stages keep ``threads``): a verify call runs
    d+1 rows through the upper layers, work a second core can share where a one-token step's
    cannot."""

    def make(t: int):
        return _onnx_model(path, threads, verify_threads=t)

    return _fastest_count(make, "verify threads", new_tokens=new_tokens, repeats=repeats)


def fastest_split_verify(
    path: str, threads: int | None, *, new_tokens: int = 64, repeats: int = 5
) -> tuple[bool, dict[str, float]]:
    """Whether layerskip's verify runs faster split (``OnnxModel(split_verify=True)``: the
    draft stage on the last draft, then verify's upper part) than as the one exported verify
    graph, on the export at ``path``, timed as :func:`fastest_onnx_threads` times thread
    counts, and chosen only where faster by more than ``SPLIT_MARGIN``; and each one's median
    seconds per token ({"split": s, "whole": s}).

    Splitting keeps one copy of the lower layers' packed weights in a round, where the whole
    graph reads its own copy besides the draft session's: it wins where both copies do not fit
    the CPU's cache (a 32 MB L3: 3.73 -> 3.20 ms a round on the reference model), and loses a
    session call where they do."""
    models = {
        "split": _onnx_model(path, threads, split_verify=True),
        "whole": _onnx_model(path, threads, split_verify=False),
    }
    _, per_token = _fastest(models, "verify", new_tokens=new_tokens, repeats=repeats)
    return per_token["split"] < per_token["whole"] * (1 - SPLIT_MARGIN), per_token


def _fastest_count(make, what: str, *, new_tokens: int, repeats: int):
    counts = sorted({1, torch.get_num_threads()})
    if len(counts) == 1:
        return counts[0], {}
    return _fastest({t: make(t) for t in counts}, what, new_tokens=new_tokens, repeats=repeats)


def _fastest(models: dict, what: str, *, new_tokens: int, repeats: int):
    """The key of the fastest of ``models`` (OnnxModels) and each one's median seconds per
    token: a ``new_tokens`` greedy decode of a fixed prompt, one untimed call of each first,
    the models timed in turn so that drift on a shared machine falls on all of them."""
    first = next(iter(models.values()))
    prompt = torch.arange(1, 9).remainder(first.manifest["vocab_size"]).view(1, -1)
    times: dict = {k: [] for k in models}
    for r in range(repeats + 1):
        for k, om in models.items():
            start = time.perf_counter()
            om.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=[])
            if r:  # the first call of each is a warm-up
                times[k].append((time.perf_counter() - start) / new_tokens)
    per_token = {k: statistics.median(v) for k, v in times.items()}
    best = min(per_token, key=per_token.get)
    log.info("onnxruntime %s: %s (seconds per token: %s)", what, best, per_token)
    return best, per_token


def repeated_4gram_share(new_tokens: list[int]) -> float:
    """Share of the output's 4-grams that already occurred earlier in the same output."""
    grams = [tuple(new_tokens[i : i + 4]) for i in range(len(new_tokens) - 3)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def _agreement(ours: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> tuple[int, int]:
    a, b = ours[0, prompt_len:], ref[0, prompt_len:]
    n = min(len(a), len(b))
    return int((a[:n] == b[:n]).sum()), max(len(a), len(b))


def run_bench(
    model: nn.Module,
    prompts: list[torch.Tensor],
    config: BenchConfig,
    *,
    progress: bool = True,
) -> list[Row]:
    """Run every system on ``prompts`` and return one Row per system (baseline first)."""
    config.validate()
    if not prompts:
        raise ValueError("--prompts: no prompts to run; allowed: at least 1")
    systems = build_systems(model, config)
    passes = config.warmup + config.repeats
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    first: dict[str, SystemRun] = {}
    bar = progress_bar(
        total=passes * len(prompts) * len(systems), desc="bench", unit="decode", enabled=progress
    )
    for p in range(passes):
        runs: dict[str, list[SystemRun]] = {s.name: [] for s in systems}
        for i, prompt in enumerate(prompts):
            # Prompt by prompt, every system in turn (the order rotated each time): a busy
            # machine's drift falls on all systems alike instead of on whichever block of
            # prompts it hit, so the ratios between rows hold on a shared machine.
            k = (p * len(prompts) + i) % len(systems)
            for system in systems[k:] + systems[:k]:
                bar.set_postfix_str(system.name)
                runs[system.name].append(system.run([prompt]))
                bar.update()
        for system in systems:
            result = SystemRun.merge(runs[system.name])
            if p >= config.warmup:
                times[system.name].append(result.seconds)
                first.setdefault(system.name, result)
    bar.close()
    for system in systems:  # the offload rows' disk tiers are temporary files: remove them
        if system.offload is not None:
            system.offload.offload.close()
    rows = _rows(systems, prompts, config, times, first)
    if config.temperature > 0:
        _distribution_checks(model, rows, systems, first, prompts)
    else:
        _explain_differences(model, rows, systems, first, prompts)
    return rows


def baseline_name(config: BenchConfig) -> str:
    """HF ``generate`` is the baseline; the leapfx runtime when HF rows are switched off."""
    if not config.hf_baselines:
        return "leapfx_autoregressive"
    return "hf_greedy" if config.temperature == 0 else "hf_sample"


def _rows(systems, prompts, config, times, first) -> list[Row]:
    greedy = config.temperature == 0
    base = baseline_name(config)
    baseline = first[base]
    rows = []
    for system in systems:
        run = first[system.name]
        new = sum(o.shape[1] - p.shape[1] for o, p in zip(run.outputs, prompts, strict=True))
        seconds = statistics.median(times[system.name])
        row = Row(system.name, new / seconds, new_tokens=new, seconds=seconds)
        row.extra["seconds_per_pass"] = list(times[system.name])  # timed passes, in order
        row.extra["first_new_tokens"] = run.outputs[0][0, prompts[0].shape[1] :].tolist()
        row.extra.update(system.info)
        if run.metrics and any(m.verify_calls for m in run.metrics):
            _speculation_stats(row, run.metrics)
        if greedy and system.name != base:
            pairs = zip(run.outputs, baseline.outputs, prompts, strict=True)
            if system.lossless:
                same = [torch.equal(o, r) for o, r, _ in pairs]
                row.identical_to_greedy = all(same)
                row.identical_prompts, row.prompts = sum(same), len(same)
            else:
                agree = [_agreement(o, r, p.shape[1]) for o, r, p in pairs]
                row.agreement_with_greedy = sum(a for a, _ in agree) / max(
                    1, sum(n for _, n in agree)
                )
                if system.model is not None:  # after timing: not part of the row's speed
                    row.agreement = teacher_forced_agreement(
                        system.model, prompts, baseline.outputs
                    ).agreement
        if run.offload:
            row.extra["offload"] = summarize(run.offload)
        resident = first.get("leapfx_resident")
        if greedy and resident is not None and system.name.startswith("leapfx_offload_"):
            pairs = zip(run.outputs, resident.outputs, strict=True)
            row.extra["identical_to_resident"] = all(torch.equal(o, r) for o, r in pairs)
        if system.name == base:
            shares = [
                repeated_4gram_share(o[0, p.shape[1] :].tolist())
                for o, p in zip(run.outputs, prompts, strict=True)
            ]
            row.extra["repeated_4gram_share"] = sum(shares) / len(shares)
        if run.metrics:
            layers = [n for m in run.metrics for n in m.layers_per_token]
            row.avg_layers = sum(layers) / len(layers) if layers else None
            row.extra["stage_seconds"] = _sum_stage_seconds(run.metrics)
            row.extra["full_steps"] = autoregressive_steps(run.metrics)  # prefills apart
            rounds: dict[str, int] = {}
            for m in run.metrics:
                for drafter, n in m.drafter_rounds.items():
                    rounds[drafter] = rounds.get(drafter, 0) + n
            if rounds:  # rounds per drafter over the timed passes ("declined", "none" included)
                row.extra["drafter_rounds"] = rounds
            search = run.metrics[-1].skip_search
            if search is not None:  # swift's online search after the last pass: its choice
                row.extra["skip_search"] = search
        rows.append(row)
    base_tps = rows[0].tokens_per_second
    for row in rows:
        row.speedup = row.tokens_per_second / base_tps if base_tps else math.nan
    static = next((r for r in rows if r.system == "hf_static"), None)
    if static is not None:
        for row in rows:
            row.speedup_vs_static = (
                row.tokens_per_second / static.tokens_per_second
                if static.tokens_per_second
                else math.nan
            )
    _formula_check(rows)
    return rows


def _formula_check(rows: list[Row]) -> None:
    """For each speculative row: the speedup over ``leapfx_autoregressive`` that the standard
    formula predicts from this run's own alpha and cost ratio c, beside the measured one."""
    by_name = {r.system: r for r in rows}
    for row in rows:
        suffix = row.system[row.system.index("@") :] if "@" in row.system else ""
        ar = by_name.get("leapfx_autoregressive" + suffix)  # same backend's own baseline
        if ar is None or not ar.new_tokens:
            continue
        # One autoregressive decode step: the full stage's time over its steps in the same
        # (first timed) pass as the speculative row's stage times, prefills excluded; the
        # row's time per token where stage times are missing.
        ar_steps = ar.extra.get("full_steps", 0)
        ar_full_s = ar.extra.get("stage_seconds", {}).get("full", 0.0)
        ar_step_s = ar_full_s / ar_steps if ar_steps > 0 else ar.seconds / ar.new_tokens
        calls = row.extra.get("draft_calls", 0)
        stage_s = row.extra.get("stage_seconds", {})
        draft_s = stage_s.get("draft", 0.0)
        if not calls or row.ctar is None:
            continue
        # The cost of one call against one autoregressive decode step on the same backend: c for
        # a draft call (the formula's c), and a verify call's (~1 where verify costs a full
        # step, as the formula assumes). A backend whose stage calls regress shows it here.
        verify_calls = row.extra.get("verify_calls", 0)
        row.extra["draft_cost"] = (draft_s / calls) / ar_step_s
        if verify_calls and "verify" in stage_s:  # (SpecEE's verified rounds rerun layer
            # stages instead of one verify stage: no verify cost to report)
            row.extra["verify_cost"] = (stage_s["verify"] / verify_calls) / ar_step_s
        d = len(row.ctar)
        measured = row.tokens_per_second / ar.tokens_per_second
        # Pass by pass: both systems ran in the same pass, minutes apart at most, so these
        # ratios show how much of the spread is the machine's drift between passes.
        pairs = zip(row.extra["seconds_per_pass"], ar.extra["seconds_per_pass"], strict=True)
        per_pass = [(row.new_tokens / s) / (ar.new_tokens / a) for s, a in pairs]
        row.extra.update(measured_vs_autoregressive=measured,
                         measured_vs_autoregressive_per_pass=per_pass)  # fmt: skip
        if row.extra.get("dynamic_draft_length"):
            continue  # eta > 0: the formula assumes d drafts every round
        c = row.extra["draft_cost"]
        predicted = predicted_speedup(row.extra["alpha"], d, c)
        row.extra.update(c=c, predicted_vs_autoregressive=predicted,
                         measured_over_predicted=measured / predicted)  # fmt: skip


def _speculation_stats(row: Row, metrics: list[DecodeMetrics]) -> None:
    steps = [s for m in metrics for s in m.accepted_per_verify]
    drafted = sum(m.drafted_tokens for m in metrics)
    accepted = sum(m.accepted_drafts for m in metrics)
    d = max(m.num_speculations for m in metrics)
    row.mean_accepted_tokens = sum(steps) / len(steps)
    row.acceptance_rate = accepted / drafted if drafted else 0.0
    row.ctar = [sum(1 for s in steps if s > w) / len(steps) for w in range(1, d + 1)]
    rejected = sum(m.rejections for m in metrics)
    # Per-token acceptance probability (geometric MLE), what the speedup formula's alpha means.
    row.extra["alpha"] = accepted / (accepted + rejected) if accepted + rejected else 0.0
    row.extra["num_speculations"] = d  # drafts a round (the most, with a dynamic length)
    row.extra["draft_calls"] = sum(m.draft_calls for m in metrics)
    row.extra["verify_calls"] = sum(m.verify_calls for m in metrics)


def _sum_stage_seconds(metrics: list[DecodeMetrics]) -> dict[str, float]:
    total: dict[str, float] = {}
    for m in metrics:
        for k, v in m.stage_seconds.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _explain_differences(model, rows, systems, first, prompts) -> None:
    """Greedy runs: for each prompt where a lossless row differs from the baseline, where the
    outputs part and whether the full model (the baseline's model) puts the two candidates
    within float tolerance of a tie there (a near-tie flip, not a bug)."""
    base = first[rows[0].system].outputs
    for row, system in zip(rows, systems, strict=True):
        if row.identical_to_greedy is not False:
            continue
        outs = first[system.name].outputs
        row.differences = [
            {"prompt": i, **first_difference(model, o, r, p.shape[1])}
            for i, (o, r, p) in enumerate(zip(outs, base, prompts, strict=True))
            if not torch.equal(o, r)
        ]


def _distribution_checks(model, rows, systems, first, prompts) -> None:
    """Sampling runs: a lossless system must sample what HF samples. Compared by the full
    model's per-token negative log-likelihood of what each produced (two-sample Mann-Whitney
    test; a small p-value flags a distribution shift). The exact proof is in the unit tests."""
    from scipy.stats import mannwhitneyu

    base = rows[0].system
    ref = _nlls(model, first[base].outputs, prompts)
    for row, system in zip(rows, systems, strict=True):
        if not system.lossless or system.name == base:
            continue
        nll = _nlls(model, first[system.name].outputs, prompts)
        p = mannwhitneyu(nll, ref).pvalue
        row.distribution_check = (
            f"per-token NLL {statistics.fmean(nll):.3f} vs HF {statistics.fmean(ref):.3f}, "
            f"Mann-Whitney p={p:.2f}"
        )


def _nlls(model, outputs, prompts) -> list[float]:
    out = []
    with torch.inference_mode():
        for o, p in zip(outputs, prompts, strict=True):
            logits = model(o).logits[0, p.shape[1] - 1 : -1].float()
            nll = torch.nn.functional.cross_entropy(logits, o[0, p.shape[1] :], reduction="none")
            out.extend(nll.tolist())
    return out
