"""``leapfx train-kangaroo``: train a Kangaroo adapter for a model (default: the reference)."""

from __future__ import annotations

from .train_parts import add_drafter_command


def add_parser(sub) -> None:
    add_drafter_command(
        sub, "kangaroo", help="train the Kangaroo adapter of a model (default: the reference)",
        shipped="leapfx/assets/reference/kangaroo_adapter", option="exit_layer",
        option_help="l: the adapter drafts from layers < l (default: the model's tuned one, "
        "else ceil(L/16))", steps=1000, seq_len=128, lr=1e-3,
    )  # fmt: skip
