"""``leapfx train-kangaroo``: train a Kangaroo adapter for a model (default: the reference)."""

from __future__ import annotations

import argparse

from .train_parts import add_drafter_training, run_drafter_training


def _train_kangaroo(args: argparse.Namespace) -> int:
    apply = {} if args.exit_layer is None else {"exit_layer": args.exit_layer}
    return run_drafter_training(args, "kangaroo", apply=apply)


def add_parser(sub) -> None:
    kangaroo = sub.add_parser(
        "train-kangaroo", help="train the Kangaroo adapter of a model (default: the reference)"
    )
    add_drafter_training(
        kangaroo, shipped_help="required but for the reference model, whose default is "
        "leapfx/assets/reference/kangaroo_adapter", steps=1000, seq_len=128, lr=1e-3,
    )  # fmt: skip
    kangaroo.add_argument(
        "--exit-layer", type=int, default=None,
        help="l: the adapter drafts from layers < l (default: the model's tuned one, else "
        "ceil(L/16))",
    )  # fmt: skip
    kangaroo.set_defaults(func=_train_kangaroo)
