"""What an expert cache can count on: an MoE model's routing on held-out text, per layer.

    python examples/routing_report.py
    python examples/routing_report.py --model path/to/moe-checkpoint --tokens 8192

Runs ``leapfx.bench.routing.routing_stats`` on held-out windows of the reference corpus (teacher
forced, the tokens in order, one cache across the windows, as decoding prompt after prompt keeps
its slots) and prints per MoE layer: routing entropy, the busiest expert's load over the mean,
how often a token reuses the previous token's experts, how precisely layer l's residual predicts
the top-k of layers l+1 and l+2 through their routers (``next_gate``), and the hit rate of
on-demand loading at each slot count under LRU and under the optimal eviction (Belady's, which
knows the whole future). A prefetcher only makes loads earlier; the loads a token costs are the
eviction's doing, and the optimal hit rate bounds every eviction policy.

``--probe K`` also fits, per layer, a linear probe from what the layer sees at token t (its
experts' input) to which experts tokens t+1..t+K will use (logistic regression on
``--probe-tokens`` training tokens; ``leapfx.offload.fit_reuse_probe``, what
``leapfx train-reuse-probe`` ships as ``OffloadOptions(policy="reuse")``), and replays its
scores as the eviction order on the held-out tokens (``routing.scored_hit_rate``: the lowest
score at token t goes first): how much of the gap to the optimal eviction it closes.
"""

from __future__ import annotations

import argparse
import math

import torch

from leapfx.bench.routing import routing_stats
from leapfx.models import load_model
from leapfx.offload import fit_reuse_probe
from leapfx.train.data import encode_documents
from leapfx.train.evaluate import eval_windows
from leapfx.train.reference import reference_corpus
from leapfx.train.reuse_probe import evaluate_reuse_probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="moe-reference")
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens to route")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--slots", default="0.5,0.25", help="slot fractions, comma-separated")
    parser.add_argument("--probe", type=int, default=0, metavar="K",
                        help="fit a next-K-tokens reuse probe per layer (0: none)")  # fmt: skip
    parser.add_argument("--probe-tokens", type=int, default=32768)
    args = parser.parse_args()
    if args.probe < 0:
        parser.error(f"--probe: {args.probe} is invalid; allowed: 0 (none) or a horizon >= 1")
    try:
        slots = tuple(float(x) for x in args.slots.split(","))
    except ValueError:
        parser.error(f"--slots: {args.slots!r} is invalid; allowed: fractions like 0.5,0.25")
    if not all(0 < x <= 1 for x in slots):
        parser.error(f"--slots: {args.slots!r} is invalid; allowed: fractions in (0, 1]")
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    held = encode_documents(tokenizer, reference_corpus(None).held_out)
    windows = eval_windows(held, args.window, args.tokens)
    stats = routing_stats(model, [w[None] for w in windows], slots=slots)
    print(f"{stats['tokens']} held-out tokens in {len(windows)} windows of {args.window}")
    cache_heads = "".join(f"  {'LRU/opt @' + str(s):>17s}" for s in slots)
    print(f"layer  entropy  max/mean  reuse  next_gate d=1  d=2{cache_heads}")
    means = {s: [0.0, 0.0] for s in slots}
    for layer, entry in stats["layers"].items():
        gates = [entry["next_gate"].get(d, {}).get("precision", math.nan) for d in ("1", "2")]
        line = (
            f"{layer:>5s}  {entry['entropy_bits']:7.2f}  {entry['load_max_over_mean']:8.2f}  "
            f"{entry['reuse_previous_token']:5.2f}  {gates[0]:13.2f}  {gates[1]:4.2f}"
        )
        for s in slots:
            cache = entry["cache"][str(s)]
            line += f"  {cache['lru_hit_rate']:8.3f}/{cache['optimal_hit_rate']:.3f}"
            means[s][0] += cache["lru_hit_rate"] / len(stats["layers"])
            means[s][1] += cache["optimal_hit_rate"] / len(stats["layers"])
        print(line)
    for s in slots:
        slot_count = next(iter(stats["layers"].values()))["cache"][str(s)]["slots"]
        lru, optimal = means[s]
        print(
            f"{slot_count} slots ({s}): hit rate LRU {lru:.3f}, optimal {optimal:.3f}; loads "
            f"{(1 - optimal) / (1 - lru):.2f}x LRU's"
        )
    if args.probe:
        train = encode_documents(tokenizer, reference_corpus(None).train)
        fit = eval_windows(train, args.window, args.probe_tokens)
        probe = fit_reuse_probe(model, fit, horizon=args.probe)
        for s, entry in evaluate_reuse_probe(probe, model, windows, slots).items():
            print(f"reuse probe, next {args.probe} tokens, {entry['slots']} slots ({s}): hit "
                  f"rate {entry['reuse_hit_rate']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
