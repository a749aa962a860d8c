"""How fast could any prefetch policy make expert offload? A perfect predictor, side by side.

    OMP_NUM_THREADS=1 python examples/offload_ceiling.py --slots 0.5
    OMP_NUM_THREADS=1 python examples/offload_ceiling.py --slots 0.25 --prompts 8 --repeats 5

On the shipped MoE reference model (``--model``: another MoE checkpoint), with the disk tier and
the CPU kernels, this times nine systems interleaved (every system on a prompt before the next
prompt, ``--repeats`` times after an untimed pass), so that a shared machine's load hits them
alike:

- ``resident``: every expert in memory (no offload);
- ``none``: on-demand loading only;
- ``m2r2``: the shipped rate-2 fast stream's prefetch (``OffloadOptions(prefetch="m2r2")``);
- ``oracle``: on-demand loading plus, at the first MoE layer of every decode step, a prediction
  of exactly the experts each later layer will use in that step, replayed from the untimed pass
  (decoding is deterministic, so the steps repeat) and loaded as m2r2's predictions are (each
  layer's ``OffloadOptions.prefetch_lead`` = 3 layers ahead). No predictor can know more, and
  this one costs nothing to run: its speed bounds what prefetching can reach with these slots
  on this machine. (M2R2's predictions never cover layers 0 and 1.)
- ``opt_evict``: on-demand loading with the optimal eviction instead of LRU (the expert used
  again last goes first, known from the untimed pass): what eviction alone can save;
- ``oracle_opt``: both, the ceiling of any predictor that also steered eviction;
- ``reuse``, ``m2r2_reuse``: ``none`` and ``m2r2`` with the learned eviction
  (``OffloadOptions(policy="reuse")``, the model's ``reuse_probe.safetensors`` or
  ``--reuse-probe``): what a policy that runs here gets of ``opt_evict``'s gain.

It prints ms per new token (median over the repeats), each system's ratio over ``none``, the
hit rate, the stall and the MiB moved per token, and checks that every output equals the
resident model's. Then a time budget per new token, from the same runs and a ninth system,
``all_slots`` (offloaded with a slot for every expert: the runtime's own cost, no transfers):
what ``none`` spends on computing, on the offload path and on waiting (in the MoE layers that
M2R2 predicts and in those it never does, layers 0 and 1), what m2r2's fast stream costs, and
the bound of any policy that predicts only M2R2's layers: ``none`` without its stall in those
layers, with nothing paid for predicting, then with the fast stream's measured cost.
``leapfx.bench.offload.RoutingOracle`` records and replays the routing (``leapfx bench
--offload-slots`` has the ``oracle`` row, ``leapfx_offload_oracle``, timed by its harness).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leapfx import rewrite
from leapfx.bench import MOE_REFERENCE_M2R2, bench_prompts
from leapfx.bench.offload import RoutingOracle, summarize
from leapfx.models import load_model
from leapfx.offload import OffloadOptions
from leapfx.passes.offload import M2R2_STREAM
from leapfx.train.reuse_probe import model_probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="moe-reference")
    parser.add_argument("--m2r2-parts", default=str(MOE_REFERENCE_M2R2))
    parser.add_argument("--slots", type=float, default=0.5, help="expert slots per MoE layer")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--reuse-probe", default=None,
        help="the reuse rows' probe (default: the model's, where it has one; none: no such rows)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} is invalid; allowed: an integer >= 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    prompts = bench_prompts(tokenizer, count=args.prompts, num_tokens=args.prompt_tokens)

    def offloaded(**kw):
        options = OffloadOptions(**{"slots": args.slots, **kw})
        return rewrite.apply(model, "autoregressive", cpu_kernels=True, offload=options)

    systems = {
        "resident": rewrite.apply(model, "autoregressive", cpu_kernels=True),
        "none": offloaded(prefetch="none"),
        "m2r2": offloaded(prefetch="m2r2", m2r2_parts=args.m2r2_parts),
        "all_slots": offloaded(prefetch="none", slots=1.0),
    }
    stream = systems["m2r2"].graph_module.get_submodule(M2R2_STREAM)
    fast = _Timer(stream)  # the fast stream's time in the timed runs
    probe = model_probe(args.model) if args.reuse_probe is None else args.reuse_probe
    if probe not in (None, "none"):
        kw = {"policy": "reuse", "reuse_probe": probe}
        systems["reuse"] = offloaded(prefetch="none", **kw)
        systems["m2r2_reuse"] = offloaded(prefetch="m2r2", m2r2_parts=args.m2r2_parts, **kw)
    generate = {name: sm.generate for name, sm in systems.items()}
    oracles = {  # name -> (prefetch, eviction) of a RoutingOracle over on-demand loading
        "oracle": (True, "policy"),
        "opt_evict": (False, "optimal"),
        "oracle_opt": (True, "optimal"),
    }
    for name, (prefetch, evict) in oracles.items():
        systems[name] = offloaded(prefetch="none")
        generate[name] = RoutingOracle(systems[name], prefetch=prefetch, evict=evict).generate
    seconds = {name: [0.0] * args.repeats for name in systems}
    reports: dict[str, list] = {name: [] for name in systems if name != "resident"}
    with torch.inference_mode():
        reference = []
        for i, prompt in enumerate(prompts):  # untimed: checks outputs, records the routing
            outs = {name: run(prompt, max_new_tokens=args.max_new_tokens)
                    for name, run in generate.items()}  # fmt: skip
            reference.append(outs["resident"])
            for name, out in outs.items():
                if not torch.equal(out, outs["resident"]):
                    raise SystemExit(f"{name}: prompt {i} differs from the resident model")
        pairs = zip(reference, prompts, strict=True)
        new_tokens = sum(out.shape[1] - p.shape[1] for out, p in pairs)
        fast.seconds = 0.0
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for name, run in generate.items():
                    start = time.perf_counter()
                    out = run(prompt, max_new_tokens=args.max_new_tokens)
                    seconds[name][r] += time.perf_counter() - start
                    if not torch.equal(out, reference[i]):
                        raise SystemExit(f"{name}: prompt {i} differs from the resident model")
                    if name in reports and r == args.repeats - 1:
                        reports[name].append(systems[name].last_offload_report)
    ms = {name: statistics.median(s) / new_tokens * 1e3 for name, s in seconds.items()}
    print(
        f"{args.prompts} prompts x {args.max_new_tokens} new tokens, {args.slots} expert slots "
        f"per MoE layer, median of {args.repeats}; every output equal to resident"
    )
    head = ("system", "ms/token", "vs none", "hit rate", "stall ms", "MiB/token")
    print(f"{head[0]:10s}" + "".join(f"{h:>10s}" for h in head[1:]))
    for name, value in ms.items():
        hit = stall = moved = "-"
        if name in reports:
            rs = reports[name]
            hit = f"{sum(x.hit_rate for x in rs) / len(rs):.3f}"
            stall = f"{sum(x.stall_ms_per_token for x in rs) / len(rs):.2f}"
            moved = f"{sum(x.bytes_per_token for x in rs) / len(rs) / 2**20:.2f}"
        ratio = f"{ms['none'] / value:.2f}x"
        print(f"{name:10s}{value:10.2f}{ratio:>10s}{hit:>10s}{stall:>10s}{moved:>10s}")
    _budget(ms, reports["none"], stream.targets, fast.seconds / args.repeats / new_tokens * 1e3)
    for sm in systems.values():
        if sm.offload is not None:
            sm.offload.close()


class _Timer:
    """Seconds spent in ``module``'s forward calls, summed (forward hooks)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds, self._start = 0.0, 0.0
        module.register_forward_pre_hook(self._begin)
        module.register_forward_hook(self._end)

    def _begin(self, *_) -> None:
        self._start = time.perf_counter()

    def _end(self, *_) -> None:
        self.seconds += time.perf_counter() - self._start


def _budget(ms: dict, none_reports: list, predicted: list[int], fast_ms: float) -> None:
    """Print where ``none``'s time goes and the bound of a policy that predicts ``predicted``."""
    stall = {int(i): v for i, v in summarize(none_reports)["stall_ms_per_token_per_layer"].items()}
    total = sum(stall.values())
    unpredicted = [i for i in stall if i not in predicted]
    early = sum(stall[i] for i in unpredicted)
    free = ms["none"] - total + early
    layers = ", ".join(map(str, unpredicted)) or "none"
    print("\ntime budget per new token (ms)")
    rows = (
        ("resident: computing", ms["resident"]),
        ("all_slots: + the offload path, no transfers", ms["all_slots"] - ms["resident"]),
        (f"none: + waiting in the layers m2r2 never predicts ({layers})", early),
        ("none: + waiting in the layers it predicts", total - early),
        ("none: + the rest (issuing the misses' reads)", ms["none"] - ms["all_slots"] - total),
        ("none", ms["none"]),
        ("m2r2's fast stream (its forward: the op, queueing the loads)", fast_ms),
    )
    for label, value in rows:
        print(f"  {label:62s}{value:7.3f}")
    print("a policy that predicts only m2r2's layers, never waits there and costs nothing else:")
    print(f"  {'none - its stall in those layers':62s}{free:7.3f}  {ms['none'] / free:.2f}x none")
    with_fast = free + fast_ms
    label = "the same + m2r2's fast stream"
    print(f"  {label:62s}{with_fast:7.3f}  {ms['none'] / with_fast:.2f}x none")


if __name__ == "__main__":
    main()
