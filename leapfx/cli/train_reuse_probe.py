"""``leapfx train-reuse-probe``: fit an MoE model's learned expert-cache eviction."""

from __future__ import annotations

import argparse
import json

from .common import add_corpus_root, add_flags, add_model, add_progress, add_threads, set_threads


def _train_reuse_probe(args: argparse.Namespace) -> int:

    from ..models import resolve_model
    from ..train.reuse_probe import PROBE_NAME, train_reuse_probe

    set_threads(args)
    if args.horizon < 1:
        raise ValueError(f"--horizon: {args.horizon} is invalid; allowed: an integer >= 1")
    out = args.out or resolve_model(args.model) / PROBE_NAME
    report = train_reuse_probe(
        out, model_path=args.model, horizon=args.horizon, tokens=args.tokens,
        held_out_tokens=args.held_out_tokens, steps=args.steps, corpus_root=args.corpus_root,
        progress=args.progress,
    )  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


def add_parser(sub) -> None:
    reuse = sub.add_parser(
        "train-reuse-probe",
        help="fit an MoE model's learned expert-cache eviction (OffloadOptions(policy='reuse'))",
    )
    reuse.add_argument(
        "out", nargs="?", default=None,
        help="the probe's file (default: reuse_probe.safetensors in the model's directory)",
    )  # fmt: skip
    add_model(reuse, "moe-reference", help="an MoE HF checkpoint dir")
    add_flags(reuse, {
        "--horizon": dict(type=int, default=4, help="the probe predicts use by the next K tokens"),
        "--tokens": dict(type=int, default=32768, help="training tokens"),
        "--held-out-tokens": dict(type=int, default=4096, help="tokens to evaluate on"),
        "--steps": dict(type=int, default=300, help="Adam steps per layer"),
    })  # fmt: skip
    add_threads(reuse)
    add_corpus_root(reuse)
    add_progress(reuse, default=True)
    reuse.set_defaults(func=_train_reuse_probe)
