"""``leapfx train-moe-reference``: train the OLMoE-shaped MoE reference model."""

from __future__ import annotations

import argparse
import json

from .common import _model_training, _model_training_args


def _train_moe_reference(args: argparse.Namespace) -> int:
    from ..train.moe_reference import train_moe_reference

    report = train_moe_reference(args.out, aux_coef=args.aux_coef, **_model_training(args))
    print(json.dumps(report, indent=2))
    return 0


def add_parser(sub) -> None:
    moe = sub.add_parser(
        "train-moe-reference", help="train the OLMoE-shaped MoE reference model (LayerSkip + "
        "load balancing)",
    )  # fmt: skip
    _model_training_args(moe)
    moe.add_argument(
        "--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss (OLMoE's)"
    )
    moe.set_defaults(func=_train_moe_reference)
