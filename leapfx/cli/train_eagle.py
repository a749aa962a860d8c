"""``leapfx train-eagle``: train the EAGLE draft head."""

from __future__ import annotations

import argparse
import json

from .common import (
    DEVICE_TRAIN_HELP,
    _progress,
    add_corpus_root,
    add_device,
    add_model,
    add_progress,
    add_quiet,
    add_threads,
)


def _train_eagle(args: argparse.Namespace) -> int:
    from ..bench import REFERENCE_EAGLE
    from ..train.eagle import train_reference_head

    summary = train_reference_head(
        args.out or REFERENCE_EAGLE,
        model_path=args.model,
        steps=args.steps,
        minutes=args.minutes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        threads=args.threads,
        device=args.device,
        corpus_root=args.corpus_root,
        resume=args.resume,
        seed=args.seed,
        progress=_progress(args),
    )
    print(json.dumps(summary, indent=2))
    return 0


def add_parser(sub) -> None:
    eagle = sub.add_parser(
        "train-eagle", help="train the EAGLE draft head of the reference model (or --model)"
    )
    eagle.add_argument(
        "--out", default=None, help="parts directory (default: leapfx/assets/reference/eagle)"
    )
    add_model(eagle)
    eagle.add_argument("--steps", type=int, default=2000)
    eagle.add_argument(
        "--minutes", type=float, default=0.0, help="> 0: stop after this wall time (resumable)"
    )
    eagle.add_argument("--batch-size", type=int, default=8)
    eagle.add_argument("--seq-len", type=int, default=256)
    eagle.add_argument("--lr", type=float, default=1e-3)
    eagle.add_argument("--seed", type=int, default=0, help="window sampling and input noise")
    add_threads(eagle)
    add_device(eagle, help=DEVICE_TRAIN_HELP)
    add_corpus_root(eagle)
    eagle.add_argument(
        "--resume", action="store_true", help="start from the head already in --out, if any"
    )
    add_progress(eagle)
    add_quiet(eagle, help="no progress bar")
    eagle.set_defaults(func=_train_eagle)
