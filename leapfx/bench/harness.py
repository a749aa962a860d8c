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
- ``onnxruntime_genai``, ``onnxruntime_genai_ngram``  with ``--backend onnxruntime``: the
                               model exported as onnxruntime-genai's decoder and decoded by its
                               own ``Generator``, plain and with its n-gram speculation
                               (``leapfx.bench.genai``; the extra ``genai`` installed)
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

Here: ``build_systems`` (the run's systems on each backend: ``_backend`` lowers a row, and
exports and tunes an onnxruntime one), ``run_bench`` and the checks of its rows. Beside it:
``config.py`` (``BenchConfig``), ``systems.py`` (``System`` and ``RECIPE_ROWS``, the table of
each recipe's rows), ``onnx_tuning.py`` (the onnxruntime rows' threads and verify graph) and
``report.py`` (the table, JSON, plot and markdown).
"""

from __future__ import annotations

import logging
import math
import statistics
import tempfile

import torch
from torch import nn

from .. import rewrite
from ..lower import lower
from ..lower.onnxruntime import shared_pool_threads
from ..runtime.metrics import DecodeMetrics
from .agreement import teacher_forced_agreement
from .config import BENCHED_RECIPES, HF_PROMPT_LOOKUP_TOKENS, BenchConfig
from .offload import summarize
from .onnx_tuning import (
    SPLIT_MARGIN,
    fastest_onnx_threads,
    fastest_split_verify,
    fastest_verify_threads,
    onnx_model,
)
from .report import Row, progress_bar
from .sweep import autoregressive_steps, predicted_speedup
from .systems import (
    RECIPE_ROWS,
    RowRun,
    System,
    SystemRun,
    genai_systems,
    hf_compiles_static,
    llama_cpp_systems,
    offload_rows,
    sampling_kwargs,
    use_cpu_kernels,
)
from .ties import first_difference

log = logging.getLogger(__name__)

# What callers take from here; the run's options (config.py), its systems and rows
# (systems.py) and the onnxruntime rows' tuning (onnx_tuning.py) live beside it.
__all__ = [
    "SPLIT_MARGIN",
    "BenchConfig",
    "Row",
    "System",
    "SystemRun",
    "baseline_name",
    "build_systems",
    "fastest_onnx_threads",
    "repeated_4gram_share",
    "run_bench",
    "use_cpu_kernels",
]


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
    sampling = sampling_kwargs(config)
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
    systems += llama_cpp_systems(model, config)
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
        row_run = RowRun(model, config, ours, layerskip_opts, backend)
        for carried_by, rows in RECIPE_ROWS:  # in the table's order
            if carried_by & set(recipes):
                systems += rows(row_run)
    if "onnxruntime" in backends:
        root = config.export_dir or tempfile.mkdtemp(prefix="leapfx-bench-genai-")
        systems += genai_systems(model, config, root)
    # Recipes sharing a row (layerskip,kangaroo: leapfx_layerskip): each row once.
    systems = list({s.name: s for s in systems}.values())
    if config.offload_slots is not None:
        systems += offload_rows(model, config, exit_layer, n, sampling, gen)
    return systems


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
        om = onnx_model(path, threads, split_verify=split, thread_pool=pool)
        om.threads_timing = chosen["timing"]
        om.split_verify_timing = None
        if config.onnx_split_verify == "auto" and om.split_verify:
            split, timing = fastest_split_verify(path, threads)
            if not split:
                om = onnx_model(path, threads, split_verify=False)
                om.threads_timing = chosen["timing"]
            om.split_verify_timing = timing
        vt = config.onnx_verify_threads
        if vt is not None and om.split_verify:
            timing = None
            if vt == "auto":
                vt, timing = fastest_verify_threads(path, threads)
            if vt != om.verify_threads:
                kept = om.threads_timing, om.split_verify_timing
                om = onnx_model(path, threads, verify_threads=vt)
                om.threads_timing, om.split_verify_timing = kept
            om.verify_threads_timing = timing
        return om

    return export


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
