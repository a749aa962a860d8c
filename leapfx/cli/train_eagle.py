"""``leapfx train-eagle``: train an EAGLE draft head for a model (default: the reference)."""

from __future__ import annotations

from .train_parts import add_drafter_command


def add_parser(sub) -> None:
    add_drafter_command(
        sub, "eagle", help="train the EAGLE draft head of a model (default: the reference)",
        shipped="leapfx/assets/reference/eagle", option="init_layer",
        option_help="host layer the head starts as a copy of", steps=2000, seq_len=256, lr=1e-3,
    )  # fmt: skip
