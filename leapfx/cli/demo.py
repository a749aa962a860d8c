"""``leapfx demo``: layerskip on a tiny random model, checked against HF greedy."""

from __future__ import annotations

import argparse
import json

from .common import CPU_KERNELS, add_cpu_kernels, add_flags, add_seed


def _demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    result = run_demo(
        seed=args.seed,
        exit_layer=args.exit_layer,
        num_speculations=args.num_speculations,
        max_new_tokens=args.max_new_tokens,
        cpu_kernels=CPU_KERNELS[args.cpu_kernels],
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("leapfx demo: tiny random Llama (8 layers), recipe layerskip", result["options"])
        print(f"  new tokens            {result['new_tokens']}")
        print(f"  draft / verify calls  {result['draft_calls']} / {result['verify_calls']}")
        print(f"  acceptance rate       {result['acceptance_rate']:.3f}")
        print(f"  mean accepted tokens  {result['mean_accepted_tokens']:.3f}")
        ctar = ", ".join(f"{c:.2f}" for c in result["ctar"])
        print(f"  CTAR(1..{len(result['ctar'])})           {ctar}")
        print(f"  leapfx CPU kernels    {'on' if result['cpu_kernels'] else 'off'}")
        print(f"  identical to HF greedy: {result['identical_to_hf_greedy']}")
    return 0 if result["identical_to_hf_greedy"] else 1


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="layerskip on a tiny random model, checked against HF")
    add_seed(demo)
    add_flags(demo, {
        "--exit-layer": dict(type=int, default=2),
        "--num-speculations": dict(type=int, default=4),
        "--max-new-tokens": dict(type=int, default=64),
        "--json": dict(action="store_true", help="print the result as JSON"),
    })  # fmt: skip
    add_cpu_kernels(
        demo,
        help="leapfx's CPU kernels: auto (on for a float32 model on a CPU where they build), "
        "on (an error where they cannot run), off",
    )  # fmt: skip
    demo.set_defaults(func=_demo)
