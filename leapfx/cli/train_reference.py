"""``leapfx train-reference``: train the project's reference model."""

from __future__ import annotations

import argparse
import dataclasses
import json

from .common import _model_training, _model_training_args, add_flags


def _train_reference(args: argparse.Namespace) -> int:
    from ..train.reference import REFERENCE_RECIPE, train_reference

    recipe = dataclasses.replace(
        REFERENCE_RECIPE, focus_exit=args.focus_exit, focus_share=args.focus_share
    )
    report = train_reference(
        args.out, recipe=recipe, distill_minutes=args.distill_minutes, **_model_training(args)
    )
    print(json.dumps(report, indent=2))
    return 0


def add_parser(sub) -> None:
    train = sub.add_parser("train-reference", help="train the project's reference model")
    _model_training_args(train)
    add_flags(train, {
        "--focus-exit": dict(
            type=int, default=None,
            help="E: give the exit after E layers --focus-share of the early-exit loss (not in "
            "the LayerSkip paper; default: eq. 6 as is)",
        ),
        "--focus-share": dict(type=float, default=None, help="0 < share < 1, with --focus-exit"),
        "--distill-minutes": dict(
            type=float, default=0.0,
            help="minutes of --minutes kept for a second phase that distills the early exits from "
            "the last layer (not in the LayerSkip paper; it also gets what the first phase leaves)",
        ),
    })  # fmt: skip
    train.set_defaults(func=_train_reference)
