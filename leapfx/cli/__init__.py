"""The ``leapfx`` command line."""

# One module per command (``demo``, ``bench``, ``generate``, ``export``, ``train_*``), each
# with ``add_parser(sub)`` declaring its flags and the function the command runs; the flags
# several commands share (--model, --threads, --device, --cpu-kernels, --progress, ...) and
# the helpers they share are declared once, in ``common``. ``main`` is the console entry point.

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import (
    bench,
    chat,
    demo,
    export,
    generate,
    serve,
    train_eagle,
    train_kangaroo,
    train_m2r2,
    train_moe_reference,
    train_reference,
    train_reuse_probe,
    train_specee,
)
from .bench_options import onnx_verify_threads as _onnx_verify_threads  # noqa: F401
from .bench_options import prefetch_lead as _prefetch_lead  # noqa: F401  (tests import both here)

# The commands in the order ``leapfx --help`` lists them.
COMMANDS = (
    demo,
    bench,
    generate,
    chat,
    serve,
    export,
    train_reference,
    train_m2r2,
    train_moe_reference,
    train_reuse_probe,
    train_specee,
    train_eagle,
    train_kangaroo,
)


def _shown(default) -> bool:
    """Whether ``--help`` states a default: not for None (unset), False (a flag's off) or a
    suppressed one (0 and 0.0 are shown: ``in`` would take them for False)."""
    return not (default is None or default is False or default is argparse.SUPPRESS)


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it states it already or has none
    worth saying (None: unset, False: a flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        said = ("%(default)", f"default: {default}", f"default {default}")
        if action.option_strings and _shown(default) and not any(x in text for x in said):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapfx", description=__doc__)
    parser.add_argument("--version", action="version", version=f"leapfx {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    for command_parser in sub.choices.values():
        command_parser.formatter_class = DefaultsFormatter
        for action in command_parser._actions:  # argparse prints no help line for help=None
            if action.help is None and _shown(action.default):
                action.help = "(default: %(default)s)"
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
