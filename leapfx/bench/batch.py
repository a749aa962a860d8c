"""``leapfx bench --batch-size 1,4,8``: total throughput per system and batch size.

The prompts are decoded in groups of B rows (left-padded to the group's longest prompt, so one
batch mixes prompt lengths), by HF's ``generate`` on the padded batch (dynamic and static
cache), the leapfx runtime without speculation and every leapfx recipe asked for that batches.
Each system's rows are named ``<system>@b<B>``. A row's throughput is the new tokens of every
row (each up to its EOS) over the time of the whole pass, the median of the timed passes; its
ratios are over ``leapfx_autoregressive`` and ``hf_greedy`` at the same B. Token identity is
counted per row against ``hf_greedy`` at the same B (HF's own batch), a differing row explained
as a near tie or not (``leapfx.bench.ties``). The leapfx rows report the draft lengths their
batch policy chose (``runtime.batch.BatchPolicy``), so where speculation stops paying as B grows
is visible in the numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import rewrite
from ..options import check_int
from ..runtime.batch import BATCH_BACKENDS
from .report import Row, columns, progress_bar, write_figure
from .ties import first_difference

# Recipes a batch bench can run, with how their options come from the run's settings.
BATCH_RECIPES = ("lookup", "auto", "swift", "layerskip", "kangaroo", "eagle")


@dataclass
class BatchBenchConfig:
    """Options of a batch bench (the CLI's ``--batch-size`` run)."""

    batch_sizes: tuple[int, ...] = (1, 4, 8)
    recipes: tuple[str, ...] = ("layerskip",)
    exit_layer: int | None = None
    num_speculations: int = 6
    max_new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    hf_baselines: bool = True
    cpu_kernels: bool | None = None
    recipe_options: dict[str, dict] = field(default_factory=dict)  # per recipe: extra options
    # the leapfx rows' backends (``runtime.batch.BATCH_BACKENDS``); several: a row each,
    # named ``<system>@<backend>@b<B>``
    backends: tuple[str, ...] = ("eager",)

    def validate(self) -> BatchBenchConfig:
        if not self.batch_sizes or len(set(self.batch_sizes)) < len(self.batch_sizes):
            raise ValueError(
                f"--batch-size: {self.batch_sizes!r} is invalid; allowed: distinct batch sizes "
                ">= 1, comma-separated (e.g. 1,4,8)"
            )
        for b in self.batch_sizes:
            check_int("--batch-size", b, 1)
        bad = next((r for r in self.recipes if r not in BATCH_RECIPES), None)
        if bad is not None:
            raise ValueError(
                f"--recipe: {bad!r} does not batch; allowed with --batch-size: "
                f"{', '.join(BATCH_RECIPES)} (comma-separated)"
            )
        bad = next((b for b in self.backends if b not in BATCH_BACKENDS), None)
        if bad is not None or not self.backends or len(set(self.backends)) < len(self.backends):
            raise ValueError(
                f"--backend: {','.join(self.backends)!r} with --batch-size is invalid; allowed: "
                f"{', '.join(BATCH_BACKENDS)} (comma-separated, no repeats; onnxruntime "
                "sessions take one row)"
            )
        check_int("--repeats", self.repeats, 1)
        check_int("--warmup", self.warmup, 0)
        return self


def pad_batch(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` [B, longest] of [1, n_i] prompts."""
    width = max(p.shape[1] for p in prompts)
    device = prompts[0].device
    ids = torch.full((len(prompts), width), pad, dtype=prompts[0].dtype, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1] :] = p[0]
        mask[b, width - p.shape[1] :] = 1
    return ids, mask


def varied_lengths(prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Prompts of one length cut to lengths spread over [n/2, n] (a batch mixes lengths);
    prompts of several lengths unchanged."""
    lengths = {p.shape[1] for p in prompts}
    if len(lengths) > 1:
        return prompts
    n = lengths.pop()
    low = max(1, n // 2)
    steps = len(prompts)
    return [p[:, : low + (n - low) * ((7 * i) % steps) // max(1, steps - 1)] for i, p in
            enumerate(prompts)]  # fmt: skip


def row_tokens(out: torch.Tensor, b: int, width: int, eos: set[int]) -> list[int]:
    """Row b's new tokens of a batched output, up to and including its first EOS."""
    new = out[b, width:].tolist()
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1]
    return new


@dataclass
class BatchSystem:
    """A named way to decode a padded batch: ``generate(ids, mask) -> [B, S + T]``."""

    name: str
    generate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metrics: Callable[[], object] = lambda: None
    lossless: bool = True
    suffix: str = ""  # "@<backend>" where the run has several backends


def batch_systems(model: nn.Module, config: BatchBenchConfig) -> list[BatchSystem]:
    """hf_greedy and hf_static (with ``hf_baselines``), leapfx_autoregressive, then one row a
    recipe of ``config.recipes``."""
    n = config.max_new_tokens

    def hf(**extra):
        def run(ids, mask):
            with torch.inference_mode():
                return model.generate(ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=n, **extra)  # fmt: skip

        return run

    systems = []
    if config.hf_baselines:
        systems.append(BatchSystem("hf_greedy", hf()))
        systems.append(BatchSystem("hf_static", hf(cache_implementation="static")))

    def ours(name: str, sm, backend: str) -> BatchSystem:
        if backend == "inductor":  # every graph the batches run, compiled before the timing
            sm.compile(cpu_kernels=config.cpu_kernels, batches=True)
        elif config.cpu_kernels is not None:
            sm.use_cpu_kernels(config.cpu_kernels)
        suffix = f"@{backend}" if len(config.backends) > 1 else ""
        return BatchSystem(
            name + suffix,
            lambda ids, mask: sm.generate(ids, attention_mask=mask, max_new_tokens=n),
            lambda: sm.last_metrics,
            suffix=suffix,
        )

    for backend in config.backends:
        systems.append(
            ours("leapfx_autoregressive", rewrite.apply(model, "autoregressive"), backend)
        )
        for recipe in config.recipes:
            options = {"num_speculations": config.num_speculations}
            if recipe in ("kangaroo", "eagle"):
                options = {"max_draft_tokens": config.num_speculations}
            if recipe in ("layerskip", "kangaroo") and config.exit_layer is not None:
                options["exit_layer"] = config.exit_layer
            options.update(config.recipe_options.get(recipe, {}))
            sm = rewrite.apply(model, recipe, **options)
            systems.append(ours(f"leapfx_{recipe}", sm, backend))
    return systems


def run_batch_bench(
    model: nn.Module, prompts: list[torch.Tensor], config: BatchBenchConfig, *,
    pad_token_id: int, progress: bool = True,
) -> list[Row]:  # fmt: skip
    """Every system at every batch size over ``prompts``; one Row per (system, B), named
    ``<system>@b<B>``, in batch-size order."""
    config.validate()
    if not prompts:
        raise ValueError("--prompts: no prompts to run; allowed: at least 1")
    systems = batch_systems(model, config)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    rows: list[Row] = []
    passes = config.warmup + config.repeats
    groups_of = {b: [prompts[i : i + b] for i in range(0, len(prompts), b)]
                 for b in config.batch_sizes}  # fmt: skip
    total = passes * len(systems) * sum(len(g) for g in groups_of.values())
    bar = progress_bar(total=total, desc="bench --batch-size", unit="batch", enabled=progress)
    for size in config.batch_sizes:
        groups = [pad_batch(g, pad_token_id) for g in groups_of[size]]
        times: dict[str, list[float]] = {s.name: [] for s in systems}
        outputs: dict[str, list[torch.Tensor]] = {}
        metrics: dict[str, list] = {s.name: [] for s in systems}
        for p in range(passes):
            seconds = dict.fromkeys(times, 0.0)
            for i, (ids, mask) in enumerate(groups):
                k = (p * len(groups) + i) % len(systems)  # rotated: drift falls on all alike
                for system in systems[k:] + systems[:k]:
                    bar.set_postfix_str(f"{system.name}@b{size}")
                    start = time.perf_counter()
                    out = system.generate(ids, mask)
                    seconds[system.name] += time.perf_counter() - start
                    if p == config.warmup:
                        outputs.setdefault(system.name, []).append(out)
                        m = system.metrics()
                        if m is not None:
                            metrics[system.name].append(m)
                    bar.update()
            if p >= config.warmup:
                for name, s in seconds.items():
                    times[name].append(s)
        rows += _size_rows(model, systems, size, groups, outputs, metrics, times, eos)
    bar.close()
    return rows


def _size_rows(model, systems, size, groups, outputs, metrics, times, eos) -> list[Row]:
    reference = outputs.get("hf_greedy")
    rows = []
    for system in systems:
        new = 0
        same = differing = 0
        differences = []
        for g, ((ids, mask), out) in enumerate(zip(groups, outputs[system.name], strict=True)):
            width = ids.shape[1]
            for b in range(ids.shape[0]):
                mine = row_tokens(out, b, width, eos)
                new += len(mine)
                if reference is None or system.name == "hf_greedy":
                    continue
                theirs = row_tokens(reference[g], b, width, eos)
                if mine == theirs:
                    same += 1
                    continue
                differing += 1
                prompt = ids[b : b + 1, int((mask[b] == 0).sum()) :]
                diff = first_difference(
                    model, torch.cat([prompt, torch.tensor([mine])], 1),
                    torch.cat([prompt, torch.tensor([theirs])], 1), prompt.shape[1],
                )  # fmt: skip
                differences.append({"group": g, "row": b, **diff})
        seconds = statistics.median(times[system.name])
        row = Row(f"{system.name}@b{size}", new / seconds, new_tokens=new, seconds=seconds)
        row.extra["batch_size"] = size
        row.extra["seconds_per_pass"] = list(times[system.name])
        if reference is not None and system.name != "hf_greedy":
            row.identical_prompts, row.prompts = same, same + differing
            row.identical_to_greedy = differing == 0
            row.differences = differences or None
        ms = metrics[system.name]
        if ms:
            lengths: dict[int, int] = {}
            for m in ms:
                for d in m.draft_lengths:
                    lengths[d] = lengths.get(d, 0) + 1
            if lengths and "autoregressive" not in system.name:
                row.extra["draft_lengths"] = dict(sorted(lengths.items()))
            drafted = sum(m.drafted_tokens for m in ms)
            if drafted:
                row.acceptance_rate = sum(m.accepted_drafts for m in ms) / drafted
        rows.append(row)
    by_name = {s.name: r for s, r in zip(systems, rows, strict=True)}
    first = next((s.suffix for s in systems if s.name.startswith("leapfx_")), "")
    for system, row in zip(systems, rows, strict=True):
        # over our autoregressive row on the same backend (HF's rows: the first backend's)
        base = by_name.get("leapfx_autoregressive" + (system.suffix or first))
        row.speedup = row.tokens_per_second / base.tokens_per_second if base else 1.0
        hf = by_name.get("hf_greedy")
        if hf is not None:
            row.extra["vs_hf_greedy"] = row.tokens_per_second / hf.tokens_per_second
    return rows


def batch_table(rows: list[Row]) -> str:
    """The printed table: one line per system and batch size."""
    head = ["system", "tok/s", "x leapfx_AR", "x hf_greedy", "accept", "identical rows",
            "draft lengths (rounds)"]  # fmt: skip
    lines = []
    for r in rows:
        same = "-"
        if r.prompts is not None:
            ties = sum(1 for d in r.differences or [] if d.get("near_tie"))
            same = f"{r.identical_prompts}/{r.prompts}"
            if r.differences:
                same += f" ({ties} near-tie)"
        lengths = r.extra.get("draft_lengths")
        shown = " ".join(f"{d}:{n}" for d, n in lengths.items()) if lengths else "-"
        vs_hf = r.extra.get("vs_hf_greedy")
        lines.append([
            r.system, f"{r.tokens_per_second:.1f}", f"{r.speedup:.2f}x",
            "-" if vs_hf is None else f"{vs_hf:.2f}x",
            "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}", same, shown,
        ])  # fmt: skip
    return columns(head, lines)


def write_batch_plot(path, rows: list[Row]) -> None:
    """Throughput against batch size, a line per system (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        name = r.system.rsplit("@b", 1)[0]
        series.setdefault(name, []).append((r.extra["batch_size"], r.tokens_per_second))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("batch size")
    ax.set_ylabel("total tokens/s")
    ax.set_xticks(sorted({r.extra["batch_size"] for r in rows}))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    write_figure(path, fig)
    plt.close(fig)
