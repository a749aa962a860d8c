"""M2R2 on the reference model: draft length, confidence stop and FLOPs options, side by side.

    python examples/m2r2_tuning.py --threads 2                 # decode speed per (g, eta)
    python examples/m2r2_tuning.py --threads 1 --draft-costs   # draft cost per (heads, rank)
    python examples/m2r2_tuning.py --gammas 3 --etas 0 --fast-keys none,64,16  # sec. 2.5 top-k

Decode speed: ``leapfx_autoregressive``, Kangaroo (its shipped adapter) and ``m2r2`` (the
shipped parts) at each ``--gammas`` x ``--etas`` x ``--fast-keys`` (``none``: every key), all
with the CPU kernels, timed interleaved (every system on a prompt before the next prompt,
``--repeats`` times after one untimed pass that also checks every output is token-identical to
autoregressive), so that a shared machine's load hits every system alike: compare the ratios,
not the tokens/s across runs.

Draft costs: c, one draft-stage call over one autoregressive decode step (the medians of the
stage times that ``generate`` records), for untrained accelerators of each ``heads`` x
``rank``: the cost side of sec. 2.5's FLOPs options (the acceptance side needs trained parts).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leapfx import rewrite
from leapfx.bench import REFERENCE_ADAPTER, REFERENCE_M2R2, bench_prompts
from leapfx.models import load_model


def decode_speed(model, prompts, args) -> None:
    systems = {
        "leapfx_autoregressive": rewrite.apply(model, "autoregressive"),
        "leapfx_kangaroo": rewrite.apply(model, "kangaroo", adapter=str(REFERENCE_ADAPTER)),
    }
    for g in (int(x) for x in args.gammas.split(",")):
        for eta in (float(x) for x in args.etas.split(",")):
            for keys in args.fast_keys.split(","):
                fk = None if keys == "none" else int(keys)
                sm = rewrite.apply(
                    model, "m2r2", parts=args.parts, num_speculations=g,
                    confidence_threshold=eta, fast_keys=fk,
                )  # fmt: skip
                name = f"m2r2 g={g} eta={eta}" + ("" if fk is None else f" k={fk}")
                systems[name] = sm
    systems = {name: sm.use_cpu_kernels() for name, sm in systems.items()}
    seconds = dict.fromkeys(systems, 0.0)
    tokens = dict.fromkeys(systems, 0)
    accepted = {name: [] for name in systems}
    drafts = {name: [] for name in systems}  # seconds per draft-stage call
    for r in range(args.repeats + 1):
        for prompt in prompts:
            ref = None
            for name, sm in systems.items():
                start = time.perf_counter()
                out = sm.generate(prompt, max_new_tokens=args.max_new_tokens)
                took = time.perf_counter() - start
                ref = out if ref is None else ref
                if r == 0:  # untimed: warm-up and the losslessness check
                    assert torch.equal(out, ref), f"{name} differs from autoregressive"
                    continue
                seconds[name] += took
                tokens[name] += out.shape[1] - prompt.shape[1]
                m = sm.last_metrics
                if m.drafted_tokens:
                    accepted[name].append(m.accepted_drafts / m.drafted_tokens)
                if m.draft_calls and "draft" in m.stage_seconds:
                    drafts[name].append(m.stage_seconds["draft"] / m.draft_calls)
    base = tokens["leapfx_autoregressive"] / seconds["leapfx_autoregressive"]
    print(f"{'system':32s} {'tok/s':>7s} {'vs AR':>6s} accept draft_us")
    for name in systems:
        rate = tokens[name] / seconds[name]
        acc = f"{statistics.mean(accepted[name]):.3f}" if accepted[name] else "-"
        cost = f"{statistics.median(drafts[name]) * 1e6:.0f}" if drafts[name] else "-"
        print(f"{name:32s} {rate:7.1f} {rate / base:5.2f}x {acc:>6s} {cost:>8s}")


def draft_costs(model, prompts, args) -> None:
    def per_call(sm, stage: str, calls: str) -> float:
        times = []
        for prompt in prompts * args.repeats:
            sm.generate(prompt, max_new_tokens=args.max_new_tokens)
            m = sm.last_metrics
            times.append(m.stage_seconds.get(stage, 0.0) / max(1, getattr(m, calls)))
        return statistics.median(times)

    ar = rewrite.apply(model, "autoregressive").use_cpu_kernels()
    step = per_call(ar, "full", "full_calls")
    print(f"autoregressive step {step * 1e6:.0f} us")
    for heads in (1, 2, 4):
        for rank in (8, 32):
            sm = rewrite.apply(model, "m2r2", heads=heads, rank=rank).use_cpu_kernels()
            draft = per_call(sm, "draft", "draft_calls")
            print(f"heads {heads} rank {rank:2d}: draft {draft * 1e6:.0f} us, c {draft / step:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", default=str(REFERENCE_M2R2))
    ap.add_argument("--gammas", default="3,6")
    ap.add_argument("--etas", default="0,0.5")
    ap.add_argument("--fast-keys", default="none", help="comma list of top-k keys; none: all")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--draft-costs", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    prompts = bench_prompts(tokenizer, count=args.prompts, num_tokens=args.prompt_tokens)
    (draft_costs if args.draft_costs else decode_speed)(model, prompts, args)


if __name__ == "__main__":
    main()
