"""``leapfx train-eagle``: train an EAGLE draft head for a model (default: the reference)."""

from __future__ import annotations

import argparse

from .train_parts import add_drafter_training, run_drafter_training


def _train_eagle(args: argparse.Namespace) -> int:
    apply = {} if args.init_layer is None else {"init_layer": args.init_layer}
    return run_drafter_training(args, "eagle", apply=apply)


def add_parser(sub) -> None:
    eagle = sub.add_parser(
        "train-eagle", help="train the EAGLE draft head of a model (default: the reference)"
    )
    add_drafter_training(
        eagle, shipped_help="required but for the reference model, whose default is "
        "leapfx/assets/reference/eagle", steps=2000, seq_len=256, lr=1e-3,
    )  # fmt: skip
    eagle.add_argument(
        "--init-layer", type=int, default=None, help="host layer the head starts as a copy of"
    )
    eagle.set_defaults(func=_train_eagle)
