"""Expert-offload measurements: resident vs offloaded decoding of one MoE model, one table.

Rows (greedy, the same prompts; ``identical``: every output equals the resident one):

- ``leapfx_resident``: the autoregressive recipe, all experts in memory;
- ``leapfx_offload_none``: the same with ``OffloadOptions(prefetch="none")`` (on demand only);
- ``leapfx_offload_next_gate``: with ``prefetch="next_gate"``;
- ``leapfx_offload_m2r2``: with ``prefetch="m2r2"`` (a rate-2 fast stream predicts two layers
  ahead; its trained parts from ``--m2r2-parts``);
- ``leapfx_offload_reuse``, ``leapfx_offload_m2r2_reuse``: ``none`` and ``m2r2`` evicting by a
  learned reuse probe (``OffloadOptions(policy="reuse")``) instead of the run's policy; only
  where a probe is given (``leapfx train-reuse-probe``; the MoE reference model ships one);
- ``leapfx_offload_layerskip``: LayerSkip self-speculation over the offloaded model
  (``prefetch="verify_union"``);
- ``leapfx_offload_oracle``: not a system but the ceiling of prefetching with these slots. On
  demand loading (``prefetch="none"``, the same eviction) plus, at the first MoE layer of every
  decode step, a prediction of exactly the experts each later layer uses in that step, recorded
  on an earlier decode of the same prompt and replayed (``RoutingOracle``; greedy decoding
  repeats itself), loaded as ``m2r2``'s predictions are (``prefetch_lead`` layers ahead). No
  predictor knows more, and this one costs nothing to run. (Layer 0 is not prefetched, and the
  loads are as many as ``none``'s: only earlier.)

``leapfx bench --offload-slots S`` runs the same rows (``offload_systems``) beside its others,
timed by its harness; this module's command times them alone.

Without a trained MoE model, ``random_moe`` builds an OLMoE-shaped model with random weights
(routing of a random model is about as unpredictable as it gets, so next-gate precision here is
a floor, not a claim).

    python -m leapfx.bench.offload --layers 8 --experts 32 --top-k 4 --slots 0.5 --tokens 32
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import os
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoModelForCausalLM

from ..kernels import cpu
from ..offload import DEFAULT_PREFETCH_LEAD, OffloadOptions
from ..rewrite import apply
from ..train.data import byte_tokenizer, held_out_prompts
from ..train.reference import reference_corpus
from .report import columns, write_figure


def random_moe(
    *,
    layers: int = 8,
    hidden: int = 256,
    experts: int = 32,
    top_k: int = 4,
    intermediate: int = 512,
    vocab: int = 512,
    seed: int = 0,
):
    """An OLMoE-shaped causal LM with random weights (eval, float32, CPU)."""
    config = transformers.OlmoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.2)  # routers start at zero in OLMoE's init
    return model.eval()


OFFLOAD_ROWS = (
    "leapfx_resident", "leapfx_offload_none", "leapfx_offload_next_gate", "leapfx_offload_m2r2",
    "leapfx_offload_layerskip",
)  # fmt: skip
REUSE_ROWS = ("leapfx_offload_reuse", "leapfx_offload_m2r2_reuse")  # where a probe is given
ORACLE_ROW = "leapfx_offload_oracle"  # needs a recorded decode of each prompt (RoutingOracle)


class RoutingOracle:
    """A perfect prefetcher over an offloaded ``SpeculativeModel`` (``OffloadOptions(prefetch=
    "none")``), for measuring what prefetching can reach: ``generate(prompt, **kw)`` decodes
    with ``sm``; the first decode of a prompt records which experts every MoE layer uses at each
    decode step, and every later decode of that prompt predicts, at the first MoE layer of each
    step, exactly the experts each later layer will use in that step, loaded as m2r2's
    predictions are (``ExpertOffload.queue_prefetches``: each ``OffloadOptions.prefetch_lead``
    layers ahead of its use). Greedy decoding repeats itself, so the replay is exact;
    sampled decoding does not (don't). It wraps ``sm.offload.run``, which the graph calls.

    ``prefetch=False``: no prefetches. ``evict="optimal"``: on replays every layer's cache
    evicts the resident expert whose next use is latest (Belady's eviction, through
    ``SlotCache.victim_key``; never used again: first), instead of its policy. Together they
    bound what any predictor could make of these slots; ``evict="optimal", prefetch=False``
    bounds eviction alone (``routing_stats``' ``optimal_hit_rate``, in decoding).
    """

    EVICTIONS = ("policy", "optimal")

    def __init__(self, sm, *, prefetch: bool = True, evict: str = "policy") -> None:
        if evict not in self.EVICTIONS:
            raise ValueError(
                f"evict: {evict!r} is invalid; allowed: {', '.join(map(repr, self.EVICTIONS))}"
            )
        self.sm = sm
        self.runtime = sm.offload
        self.prefetch = prefetch
        self.evict = evict
        self.first = self.runtime.layers[0]
        self.steps: dict[tuple, list[dict[int, list[int]]]] = {}  # prompt -> per step routing
        self._steps: list[dict[int, list[int]]] = []
        self._uses: dict[tuple[int, int], list[int]] = {}  # (layer, expert) -> its steps
        self._recording = False
        self._step = -1
        self._run = self.runtime.run
        self.runtime.run = self._wrapped  # an instance attribute: the graph's nodes call it

    @staticmethod
    def _key(prompt: torch.Tensor) -> tuple:
        return tuple(prompt.flatten().tolist())

    def recorded(self, prompt: torch.Tensor) -> bool:
        return self._key(prompt) in self.steps

    def generate(self, prompt: torch.Tensor, **kw) -> torch.Tensor:
        key = self._key(prompt)
        self._recording = key not in self.steps
        self._steps = self.steps.setdefault(key, [])
        self._step = -1
        if self._recording or self.evict == "policy":
            return self.sm.generate(prompt, **kw)
        self._uses = {}
        for t, step in enumerate(self._steps):
            for layer, experts in step.items():
                for expert in experts:
                    self._uses.setdefault((layer, expert), []).append(t)
        caches = self.runtime.caches
        for layer, cache in caches.items():
            cache.victim_key = functools.partial(self._next_use_key, layer)
        try:
            return self.sm.generate(prompt, **kw)
        finally:
            for cache in caches.values():
                cache.victim_key = None

    def _next_use_key(self, layer: int, expert: int) -> tuple[int, int]:
        """Evicted first: the latest next use (at this step or later; the prefill is step -1)."""
        uses = self._uses.get((layer, expert), ())
        k = bisect.bisect_left(uses, max(self._step, 0))
        return (-(uses[k] if k < len(uses) else len(self._steps)), expert)

    def _wrapped(self, layer, module, hidden, top_k_index, top_k_weights):
        decode = hidden.shape[0] == 1  # [T, H]: one token, a decode step
        if decode and layer == self.first:
            self._step += 1
            if self._recording:
                self._steps.append({})
            elif self.prefetch and self._step < len(self._steps):
                step = self._steps[self._step]
                self.runtime.queue_prefetches(
                    [(target, experts) for target, experts in step.items() if target != self.first]
                )  # loaded as the runtime's prefetch_lead says, as m2r2's predictions are
        if decode and self._recording:
            self._steps[self._step][layer] = top_k_index[0].tolist()
        return self._run(layer, module, hidden, top_k_index, top_k_weights)


def offload_systems(
    slots: float | int, *, exit_layer: int, num_speculations: int | None = None,
    m2r2_parts=None, policy: str = "lru", path=None, engine: str = "auto", reuse_probe=None,
    prefetch_lead: int | None = DEFAULT_PREFETCH_LEAD, slow_dtype: str | None = None,
) -> dict[str, tuple[str, OffloadOptions | None, dict]]:  # fmt: skip
    """Row name -> (recipe, offload options or None, recipe options) of the offload rows.

    ``path``: a folder for the disk tiers' files (one per row); None: temporary files.
    ``engine``: the transfer engine (``OffloadOptions.engine``: auto, native or thread).
    ``prefetch_lead``: ``OffloadOptions.prefetch_lead`` of every row (m2r2's and the oracle's
    loads, that many layers ahead; None: all at a step's start).
    ``slow_dtype``: ``OffloadOptions.slow_dtype`` of every row (the disk tier's dtype).
    ``reuse_probe``: a ``ReuseProbe`` or its file: with ``policy="reuse"`` every row's, else
    the ``*_reuse`` rows' (None: no such rows).
    """

    def options(prefetch: str, file_tag: str | None = None, evict: str = policy,
                **kw) -> OffloadOptions:  # fmt: skip
        name = f"experts-{file_tag or prefetch}.bin"
        file = None if path is None else os.path.join(path, name)
        if evict == "reuse":
            kw["reuse_probe"] = reuse_probe
        return OffloadOptions(
            slots=slots, policy=evict, prefetch=prefetch, path=file, engine=engine,
            prefetch_lead=prefetch_lead, slow_dtype=slow_dtype, **kw,
        )  # fmt: skip

    reuse = {}
    if reuse_probe is not None and policy != "reuse":
        reuse = {
            "leapfx_offload_reuse": ("autoregressive", options("none", "reuse", "reuse"), {}),
            "leapfx_offload_m2r2_reuse": ("autoregressive", options(
                "m2r2", "m2r2-reuse", "reuse", m2r2_parts=m2r2_parts), {}),
        }  # fmt: skip

    layerskip = {"exit_layer": exit_layer}
    if num_speculations is not None:
        layerskip["num_speculations"] = num_speculations
    return {
        "leapfx_resident": ("autoregressive", None, {}),
        "leapfx_offload_none": ("autoregressive", options("none"), {}),
        "leapfx_offload_next_gate": ("autoregressive", options("next_gate"), {}),
        "leapfx_offload_m2r2": ("autoregressive", options("m2r2", m2r2_parts=m2r2_parts), {}),
        **reuse,
        # LayerSkip over the offloaded model; its verify pass prefetched from the drafts.
        "leapfx_offload_layerskip": ("layerskip", options("verify_union"), layerskip),
        # Wrapped in a RoutingOracle by whoever times it (it needs a recorded decode first).
        ORACLE_ROW: ("autoregressive", options("none", file_tag="oracle"), {}),
    }


# What the offload columns average over a row's prompts (per-token quantities of each call).
_MEANS = ("hit_rate", "prefetch_hit_rate", "stall_ms_per_token", "bytes_per_token",
          "wasted_bytes_per_token", "copy_busy_share")  # fmt: skip


def summarize(reports: list) -> dict:
    """One row's offload columns: the mean over its ``generate`` calls' OffloadReports
    (precision and recall over the calls that predicted anything; hit rate per layer too)."""
    n = len(reports)
    out = {f: sum(getattr(r, f) for r in reports) / n for f in _MEANS}
    for f in ("ready_rate", "prefetch_precision", "prefetch_recall"):  # None where unknown
        values = [getattr(r, f) for r in reports if getattr(r, f) is not None]
        out[f] = sum(values) / len(values) if values else None
    layers = reports[0].hit_rate_per_layer
    out["engine"] = reports[0].engine
    out["slow_dtype"] = reports[0].slow_dtype
    out["compute_threads"] = reports[0].compute_threads
    for f in ("hit_rate_per_layer", "ready_rate_per_layer", "stall_ms_per_token_per_layer"):
        if getattr(reports[0], f) is None:  # ready rates: not known on CUDA
            out[f] = None
            continue
        out[f] = {str(i): sum(getattr(r, f)[i] for r in reports) / n for i in layers}
    return out


@dataclass
class OffloadRow:
    system: str
    tokens_per_s: float
    identical: bool
    hit_rate: float | None = None
    ready_rate: float | None = None
    prefetch_hit_rate: float | None = None
    stall_ms_per_token: float | None = None
    bytes_per_token: float | None = None
    wasted_bytes_per_token: float | None = None
    prefetch_precision: float | None = None
    prefetch_recall: float | None = None
    hit_rate_per_layer: dict | None = None
    ready_rate_per_layer: dict | None = None
    stall_ms_per_token_per_layer: dict | None = None
    copy_busy_share: float | None = None


def offload_rows(
    model, prompts: list[torch.Tensor], *, max_new_tokens: int, slots: float | int,
    policy: str = "lru", exit_layer: int | None = None, path=None, plot=None,
    m2r2_parts=None, cpu_kernels: bool | None = None, reuse_probe=None,
) -> list[OffloadRow]:  # fmt: skip
    """Time every row on ``prompts`` (after one warm-up prompt per system).

    ``cpu_kernels``: every row with leapfx's CPU kernels (``leapfx_cpu::moe_experts`` over the
    weights or the slots; ``SpeculativeModel.use_cpu_kernels``) or none; None: where they
    apply (a float32 model on a CPU) and build.

    ``plot``: also trace the last prompt of every offloaded row (not timed) and draw the
    timelines and hit rates per layer into that PNG (``plot_offload``).
    """
    exit_layer = exit_layer or max(1, model.config.num_hidden_layers // 4)
    systems = offload_systems(slots, exit_layer=exit_layer, m2r2_parts=m2r2_parts,
                              policy=policy, path=path, reuse_probe=reuse_probe)  # fmt: skip

    param = next(model.parameters())
    kernels = cpu.resolve(cpu_kernels, param.device, param.dtype)
    reference = None
    rows, traces = [], {}
    for name, (recipe, offload, opts) in systems.items():
        sm = apply(model, recipe, offload=offload, cpu_kernels=kernels, **opts)
        # Warm-up: allocations, first reads, and on a GPU the kernels' first launches (a few
        # tokens were not enough there: the first row measured slower than the offloaded ones).
        sm.generate(prompts[0], max_new_tokens=max_new_tokens)
        generate = sm.generate
        if name == ORACLE_ROW:  # record every prompt's routing, untimed
            generate = RoutingOracle(sm).generate
            for prompt in prompts:
                generate(prompt, max_new_tokens=max_new_tokens)
        outputs, reports, seconds, tokens = [], [], 0.0, 0
        for prompt in prompts:
            start = time.perf_counter()
            out = generate(prompt, max_new_tokens=max_new_tokens)
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - prompt.shape[1]
            outputs.append(out)
            reports.append(sm.last_offload_report)
        if reference is None:
            reference = outputs
        row = OffloadRow(
            name, tokens / seconds,
            identical=all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True)),
        )  # fmt: skip
        if sm.offload is not None:
            for field, value in summarize(reports).items():
                setattr(row, field, value)
            if plot is not None:
                traces[name] = trace_call(sm, prompts[-1], max_new_tokens)
            sm.offload.close()
        rows.append(row)
    if plot is not None:
        plot_offload(traces, {r.system: r.hit_rate_per_layer for r in rows if r.hit_rate_per_layer},
                     plot, ready_rates={r.system: r.ready_rate_per_layer for r in rows
                                        if r.ready_rate_per_layer})  # fmt: skip
    return rows


def trace_call(sm, prompt: torch.Tensor, max_new_tokens: int) -> list:
    """The spans (``ExpertOffload.trace``) of one untimed ``generate`` call of ``sm``."""
    sm.offload.trace = []
    sm.generate(prompt, max_new_tokens=max_new_tokens)
    trace, sm.offload.trace = sm.offload.trace, None
    return trace


def plot_offload(traces: dict[str, list], hit_rates: dict[str, dict], path, *,
                 window_tokens: int | None = 3,
                 ready_rates: dict[str, dict] | None = None):  # fmt: skip
    """M2R2's Fig. 11 for the offload runtime, one PNG at ``path``: per traced row (``traces``:
    name -> ``ExpertOffload.trace`` of one call) a timeline of four lanes -- experts calls
    (compute), compute waiting for a transfer (stall), on-demand and prefetch transfers on the
    copy engine -- over the call's last ``window_tokens`` tokens (None: the whole call); beside
    them the hit rate per MoE layer of every row in ``hit_rates`` (name -> {layer: rate}), and
    where ``ready_rates`` has the row, its ready rate (hits loaded in time) as the bar's solid
    part, the late hits pale above it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = {"compute": 3, "stall": 2, "demand": 1, "prefetch": 0}
    colors = {"compute": "tab:blue", "stall": "tab:red", "demand": "tab:orange",
              "prefetch": "tab:green"}  # fmt: skip
    n = max(1, len(traces))
    fig = plt.figure(figsize=(13, 1.0 + 1.7 * n))
    grid = fig.add_gridspec(n, 2, width_ratios=[3, 1.2])
    axes = [fig.add_subplot(grid[k, 0]) for k in range(n)]
    for ax, (name, trace) in zip(axes, traces.items(), strict=False):
        t0, t1 = _window(trace, window_tokens)
        for lane, y in lanes.items():
            spans = [(1e3 * (a - t0), 1e3 * (b - a)) for kind, _, _, a, b in trace
                     if kind == lane and b >= t0 and a <= t1]  # fmt: skip
            ax.broken_barh(spans, (y - 0.4, 0.8), color=colors[lane])
        ax.set_xlim(0, 1e3 * (t1 - t0))
        ax.set_yticks(list(lanes.values()), list(lanes))
        ax.set_title(name, fontsize=10, loc="left")
    if axes:
        what = (
            f"{window_tokens} decode steps with the most transfers" if window_tokens else "one call"
        )
        axes[-1].set_xlabel(f"ms ({what})")
    bx = fig.add_subplot(grid[:, 1])
    width = 0.8 / max(1, len(hit_rates))
    ready_rates = ready_rates or {}
    for k, (name, rates) in enumerate(hit_rates.items()):
        layers = sorted(rates, key=int)
        xs = [int(i) + k * width for i in layers]
        color = f"C{k % 10}"
        ready = ready_rates.get(name)
        if ready is None:
            bx.bar(xs, [rates[i] for i in layers], width=width, color=color,
                   label=name.removeprefix("leapfx_offload_"))  # fmt: skip
            continue
        bx.bar(xs, [rates[i] for i in layers], width=width, color=color, alpha=0.3)
        bx.bar(xs, [ready[i] for i in layers], width=width, color=color,
               label=name.removeprefix("leapfx_offload_"))  # fmt: skip
    bx.set_ylim(0, 1.05)
    bx.set_xlabel("MoE layer")
    title = "hit rate per layer" + (" (pale: late, still being read)" if ready_rates else "")
    bx.set_title(title, fontsize=10)
    bx.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    write_figure(path, fig, dpi=90)  # written whole or not at all
    return path


def bench_table(rows) -> str:
    """The offload columns of ``leapfx bench`` rows (those with ``extra["offload"]``), with
    tokens/s relative to ``leapfx_offload_none`` and ``identical`` against ``leapfx_resident``."""
    picked = [r for r in rows if r.system in (*OFFLOAD_ROWS, *REUSE_ROWS, ORACLE_ROW)]
    none = next((r for r in picked if r.system == "leapfx_offload_none"), None)
    head = ["system", "tok/s", "vs none", "identical", "hit rate", "ready", "prefetch hits",
            "stall ms/tok", "MiB/tok", "wasted MiB/tok", "precision", "recall"]  # fmt: skip
    lines = []

    def f(v, scale=1.0, spec=".2f"):
        return "-" if v is None else format(v / scale, spec)

    for r in picked:
        o = r.extra.get("offload", {})
        vs = r.tokens_per_second / none.tokens_per_second if none else None
        lines.append([
            r.system, f"{r.tokens_per_second:.1f}", f(vs, spec=".2f") + "x" * (vs is not None),
            {True: "yes", False: "NO", None: "-"}[r.extra.get("identical_to_resident")],
            f(o.get("hit_rate")), f(o.get("ready_rate")), f(o.get("prefetch_hit_rate")),
            f(o.get("stall_ms_per_token"), spec=".2f"), f(o.get("bytes_per_token"), 2**20),
            f(o.get("wasted_bytes_per_token"), 2**20), f(o.get("prefetch_precision")),
            f(o.get("prefetch_recall")),
        ])  # fmt: skip

    return columns(head, lines)


def _window(trace: list, tokens: int | None) -> tuple[float, float]:
    """(start, end) of the ``tokens`` consecutive decode steps after the prefill with the most
    transfers (a warm cache moves little: the busiest steps show the overlap); None: all."""
    compute = sorted(span[3:] for span in trace if span[0] == "compute")
    if not compute:
        return 0.0, 0.0
    end = max(span[4] for span in trace)
    layers = len({span[1] for span in trace if span[0] == "compute"})
    starts = [compute[k][0] for k in range(0, len(compute), layers)]  # one call per step
    if tokens is None or len(starts) <= tokens + 1:
        return starts[0], end
    moves = sorted(span[3] for span in trace if span[0] in ("demand", "prefetch"))

    def count(k: int) -> int:
        stop = starts[k + tokens] if k + tokens < len(starts) else end
        return sum(starts[k] <= t < stop for t in moves)

    best = max(range(1, len(starts) - tokens + 1), key=count)  # step 0 is the prefill
    return starts[best], starts[best + tokens] if best + tokens < len(starts) else end


def markdown(rows: list[OffloadRow]) -> str:
    head = ("| system | tokens/s | identical | hit rate | ready | prefetch hits | stall ms/token "
            "| MiB/token | wasted MiB/token | precision | recall |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]

    def f(v, scale=1.0, digits=2):
        return "-" if v is None else f"{v / scale:.{digits}f}"

    for r in rows:
        lines.append(
            f"| {r.system} | {r.tokens_per_s:.2f} | {r.identical} | {f(r.hit_rate)} | "
            f"{f(r.ready_rate)} | {f(r.prefetch_hit_rate)} | {f(r.stall_ms_per_token, digits=1)} | "
            f"{f(r.bytes_per_token, 2**20)} | {f(r.wasted_bytes_per_token, 2**20)} | "
            f"{f(r.prefetch_precision)} | {f(r.prefetch_recall)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--slots", type=float, default=0.5)
    p.add_argument("--policy", default="lru", help="eviction: lru, lfu or reuse")
    p.add_argument(
        "--reuse-probe", default=None,
        help="a reuse probe's file (leapfx train-reuse-probe): every row's with --policy reuse, "
        "else the *_reuse rows'",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--path", default=None, help="folder for the disk tiers' files (default: temp)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--plot", default=None, help="PNG: timelines and hit rate per layer")
    p.add_argument("--m2r2-parts", default=None, help="rate-2 M2R2 parts (prefetch m2r2)")
    p.add_argument("--model", default=None, help="a local MoE checkpoint (default: random)")
    p.add_argument(
        "--device", default="cpu",
        help="cpu (slow tier: a file on disk) or cuda, cuda:1, ... (slow tier: pinned host memory)",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--cpu-kernels",
        default="auto",
        choices=("auto", "on", "off"),
        help="leapfx's CPU kernels for every row (auto: a float32 model on a CPU)",
    )
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device: {a.device!r} asks for CUDA, which this torch build cannot use")
    torch.set_num_threads(1)
    if a.model is not None:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        found = held_out_prompts(byte_tokenizer(), reference_corpus(), num_tokens=32,
                                 count=a.prompts)  # fmt: skip
        prompts = [torch.tensor([p.input_ids]) for p in found]
    else:
        model = random_moe(layers=a.layers, hidden=a.hidden, experts=a.experts, top_k=a.top_k,
                           intermediate=a.intermediate)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 512, (1, 16), generator=g) for _ in range(a.prompts)]
    model = model.to(device=device, dtype=getattr(torch, a.dtype))
    prompts = [prompt.to(device) for prompt in prompts]
    slots = int(a.slots) if a.slots >= 1 else a.slots
    rows = offload_rows(model, prompts, max_new_tokens=a.tokens, slots=slots, policy=a.policy,
                        path=a.path, plot=a.plot, m2r2_parts=a.m2r2_parts,
                        reuse_probe=a.reuse_probe,
                        cpu_kernels={"auto": None, "on": True, "off": False}[a.cpu_kernels],
                        )  # fmt: skip
    print(markdown(rows))  # noqa: T201 - a command's output
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
