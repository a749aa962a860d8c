"""``leapfx train-m2r2``: train M2R2 accelerator parts (eq. 5)."""

from __future__ import annotations

import argparse
import json

from .common import _exit_gates, _progress, add_flags, add_model, add_seed, set_threads
from .train_parts import (
    add_data,
    add_out,
    add_run_flags,
    add_steps,
    benchmark_texts,
    parts_out,
    self_options,
)


def _train_m2r2(args: argparse.Namespace) -> int:

    from ..bench import MOE_REFERENCE_M2R2, REFERENCE_M2R2
    from ..runs.m2r2 import train_parts

    set_threads(args)
    # Without a folder: the shipped parts of the model trained for (the dense reference's
    # drafter, or the MoE reference's rate-2 stream), never another model's.
    shipped = MOE_REFERENCE_M2R2 if args.model == "moe-reference" else REFERENCE_M2R2
    report = train_parts(
        parts_out(args, shipped), model_path=args.model, recipe=args.recipe, init=args.init,
        data=args.data, cache_dir=args.cache_dir, self_options=self_options(args),
        exclude=benchmark_texts() if args.data == "self" else None,
        heads=args.heads, rank=args.rank, fast_layers=args.fast_layers,
        num_speculations=args.num_speculations, confidence_threshold=args.confidence_threshold,
        exit_gates=_exit_gates(args), corpus_root=args.corpus_root, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, ce_target=args.ce_target,
        seed=args.seed, router_steps=args.router_steps, mse_weight=args.mse_weight,
        route_weight=args.route_weight, chain=args.chain, greedy_data=args.greedy_data,
        max_minutes=args.minutes, checkpoint_every=args.checkpoint_every, fresh=args.fresh,
        progress=_progress(args),
    )  # fmt: skip
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def add_parser(sub) -> None:
    m2r2 = sub.add_parser("train-m2r2", help="train M2R2 accelerator parts (eq. 5)")
    add_out(
        m2r2, positional=True,
        default_help="required but for the shipped reference models: leapfx/assets/reference/"
        "m2r2, or with --model moe-reference leapfx/assets/moe-reference/m2r2",
    )  # fmt: skip
    add_model(m2r2)
    add_data(m2r2)
    add_flags(m2r2, {
        "--recipe": dict(
            default="m2r2", choices=["m2r2", "m2r2_exit"],
            help="m2r2_exit: the exit gates N/4, N/2, 3N/4 and their ARLA routers (the parts also "
            "serve m2r2, whose gate is the first)",
        ),
        "--router-steps": dict(type=int, default=300),
        "--init": dict(default=None, help="parts to start from (resume)"),
    })  # fmt: skip
    add_steps(m2r2, steps=1500, seq_len=128, lr=2e-3)
    add_flags(m2r2, {
        "--ce-target": dict(default="model", choices=["labels", "model"]),
        "--mse-weight": dict(type=float, default=1.0, help="eq. 5's a1 (a0 is 1)"),
        "--greedy-data": dict(
            type=int, default=0, metavar="N",
            help="train on N training-split windows (a quarter of --seq-len) continued by the "
            "model's own greedy tokens instead of the corpus; 0: the corpus",
        ),
        "--chain": dict(
            type=int, default=1,
            help="m2r2: also train drafts 2..N of an unrolled draft chain (each reading the "
            "earlier drafts' fast keys, as decoding does), CE averaged over the "
            "steps; 1: eq. 5 alone",
        ),
        "--route-weight": dict(
            type=float, default=0.0,
            help="MoE hosts: weight of the KL of layers 2i+2, 2i+3's routing predicted from fast "
            "layer i (the offload's m2r2 prefetch); 0: eq. 5 alone",
        ),
        "--heads": dict(type=int, default=None, help="fast query heads (sec. 2.5)"),
        "--rank": dict(type=int, default=None, help="adapter/LoRA rank (default 8)"),
        "--num-speculations": dict(
            type=int, default=None,
            help="m2r2: drafts a round recorded in the parts (default 3, the paper's g)",
        ),
        "--confidence-threshold": dict(
            type=float, default=None,
            help="m2r2: confidence stop recorded in the parts (default 0: none)",
        ),
        "--fast-layers": dict(
            type=int, default=None,
            help="--recipe m2r2: the gate k (rate N/k; default 4); N/2 for the MoE offload's "
            "m2r2 prefetch policy",
        ),
        "--exit-gates": dict(
            default=None,
            help="--recipe m2r2_exit: the gates whose ARLA routers decide, e.g. 4 (recorded in "
            "the parts; default: every gate)",
        ),
    })  # fmt: skip
    add_seed(m2r2)
    add_run_flags(m2r2, device=False)
    m2r2.set_defaults(func=_train_m2r2)
