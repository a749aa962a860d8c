"""The ``leapfx`` command line."""

# One module per command (``demo``, ``bench``, ``generate``, ``export``, ``train_*``), each
# with ``add_parser(sub)`` declaring its flags and the function the command runs; the flags
# several commands share (--model, --threads, --device, --cpu-kernels, --progress, ...) and
# the helpers they share are declared once, in ``common``. ``main`` is the console entry point.

from __future__ import annotations

import argparse
import sys

from . import (
    bench,
    demo,
    export,
    generate,
    train_eagle,
    train_kangaroo,
    train_m2r2,
    train_moe_reference,
    train_reference,
    train_reuse_probe,
    train_specee,
)
from .bench import _onnx_verify_threads, _prefetch_lead  # noqa: F401  (tests import them here)

# The commands in the order ``leapfx --help`` lists them.
COMMANDS = (
    demo,
    bench,
    generate,
    export,
    train_reference,
    train_m2r2,
    train_moe_reference,
    train_reuse_probe,
    train_specee,
    train_eagle,
    train_kangaroo,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapfx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as typed, for reports that name it (bench --markdown)
    try:
        return args.func(args)
    except ValueError as exc:  # bad user input: one line, no traceback
        print(f"leapfx {args.command}: error: {exc}", file=sys.stderr)
        return 2
