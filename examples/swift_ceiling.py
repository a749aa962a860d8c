"""How far layer-skip self-speculation (``swift``) can go on a model: for skip sets of growing
size (the layers whose residual update is smallest on a calibration prompt, first and last
kept), decode for real and print acceptance alpha, the draft cost c (a draft call over a full
decode step), the speedup formula's prediction at those, its ceiling at alpha = 1, and the
measured speed over ``autoregressive``.

    python examples/swift_ceiling.py --model smollm2 --prompt-set chat
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a model spec (leapfx.models)")
    parser.add_argument("--prompt-set", default="chat")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-speculations", type=int, default=3)
    parser.add_argument("--sizes", default="2,4,6,8,10,12,15,20", help="skip-set sizes")
    args = parser.parse_args()

    import transformers

    from leapfx import rewrite
    from leapfx.bench.prompt_sets import load_prompt_set
    from leapfx.bench.sweep import predicted_speedup
    from leapfx.models import load_model

    transformers.utils.logging.set_verbosity_error()
    model, tok = load_model(args.model)
    prompts = load_prompt_set(args.prompt_set, tok, count=args.prompts)
    n, d = args.max_new_tokens, args.num_speculations
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        hs = model(prompts[0], output_hidden_states=True).hidden_states
    change = [
        ((hs[i + 1] - hs[i]).norm(dim=-1) / hs[i].norm(dim=-1)).mean().item() for i in range(layers)
    ]
    order = sorted(range(1, layers - 1), key=lambda i: change[i])
    print("relative residual update per layer:", " ".join(f"{c:.2f}" for c in change))

    def run(sm):
        sm.generate(prompts[0], max_new_tokens=4)  # warm-up
        new, seconds, metrics = 0, 0.0, []
        for p in prompts:
            sm.generate(p, max_new_tokens=n)
            metrics.append(sm.last_metrics)
            new += sm.last_metrics.new_tokens
            seconds += sm.last_metrics.seconds
        return new / seconds, metrics

    ar_tps, ar_ms = run(rewrite.apply(model, "autoregressive"))
    step = sum(m.stage_seconds.get("full", 0) for m in ar_ms) / sum(m.full_calls for m in ar_ms)
    print(f"autoregressive {ar_tps:.1f} tok/s, full step {step * 1e3:.1f} ms")
    print("k  skip set  alpha  c  predicted  ceiling(alpha=1)  measured")
    for k in (int(x) for x in args.sizes.split(",")):
        skip = tuple(sorted(order[:k]))
        sm = rewrite.apply(model, "swift", skip_layers=skip, num_speculations=d)
        tps, ms = run(sm)
        drafted = sum(m.drafted_tokens for m in ms)
        alpha = sum(m.accepted_drafts for m in ms) / drafted if drafted else 0.0
        calls = max(1, sum(m.draft_calls for m in ms))
        c = sum(m.stage_seconds.get("draft", 0) for m in ms) / calls / step
        print(
            f"{k:2d} {skip} {alpha:.3f} {c:.3f} {predicted_speedup(alpha, d, c):.2f}x "
            f"{predicted_speedup(1.0, d, c):.2f}x {tps / ar_tps:.2f}x"
        )


if __name__ == "__main__":
    main()
