"""What the drafter-training commands share (``train-eagle``, ``train-kangaroo``,
``train-m2r2``, ``train-specee``): ``--model``, ``--out`` (required for any model but a shipped
one whose own parts it regenerates; never inside the installed package), ``--data
stdlib|self|FILE`` and its ``self`` budget, the run's options, and the one function that runs
``train-eagle`` and ``train-kangaroo`` (``leapfx.runs.drafters.train_drafter``).

    leapfx train-eagle --model smollm2 --out runs/eagle-smollm2 --data self --steps 2000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import (
    DEVICE_TRAIN_HELP,
    _progress,
    add_corpus_root,
    add_device,
    add_flags,
    add_model,
    add_progress,
    add_quiet,
    add_seed,
    add_threads,
    set_threads,
)

DATA_HELP = (
    "stdlib: the Python standard library's source (default); self: instruction/response pairs "
    "the model writes itself (--pairs of them; never the bench's prompts); or a .jsonl file "
    "(text / instruction+response / messages), a text file or a folder of text files"
)


def add_out(parser: argparse.ArgumentParser, *, default_help: str, positional: bool = False):
    """``--out DIR`` (and the older positional ``out`` where a command had one)."""
    if positional:
        parser.add_argument("out_positional", nargs="?", default=None, metavar="out",
                            help="the parts directory (same as --out)")  # fmt: skip
    parser.add_argument("--out", default=None, help=f"the parts directory ({default_help})")


def parts_out(args: argparse.Namespace, shipped: Path | None) -> Path:
    """The checked parts directory of ``--out`` (or the positional ``out``); see
    ``leapfx.runs.drafters.check_out``."""
    from ..runs.drafters import check_out

    positional = getattr(args, "out_positional", None)
    if positional is not None and args.out is not None and positional != args.out:
        raise ValueError(
            f"--out: {args.out!r} and the positional out {positional!r} differ; allowed: one"
        )
    return check_out(args.out or positional, args.model, shipped=shipped)


def add_data(parser: argparse.ArgumentParser) -> None:
    """``--data`` and the ``self`` data's budget (``--pairs``, ``--response-tokens``)."""
    parser.add_argument("--data", default="stdlib", help=DATA_HELP)
    add_flags(parser, {
        "--pairs": dict(type=int, default=256, help="--data self: pairs to generate"),
        "--response-tokens": dict(type=int, default=192, help="--data self: longest response"),
        "--cache-dir": dict(
            default=None,
            help="teacher features, self data and checkpoints (default: $LEAPFX_CACHE/train)",
        ),
    })  # fmt: skip


def self_options(args: argparse.Namespace):
    from ..train.sources import SelfDataOptions

    return SelfDataOptions(pairs=args.pairs, response_tokens=args.response_tokens, seed=args.seed)


def benchmark_texts() -> list[str]:
    from ..bench.prompt_sets import benchmark_texts as texts

    return texts()


def add_drafter_training(
    parser: argparse.ArgumentParser, *, shipped_help: str, steps: int, seq_len: int, lr: float
) -> None:
    """The flags of ``train-eagle`` and ``train-kangaroo``."""
    add_out(parser, default_help=shipped_help)
    add_model(parser)
    add_data(parser)
    add_steps(parser, steps=steps, seq_len=seq_len, lr=lr)
    add_seed(parser, help="batches, noise and self data")
    add_flags(parser, {
        "--features": dict(
            type=int, default=512,
            help="windows of --seq-len whose teacher states are collected once and cached (0: the "
            "model runs at every step on random windows)",
        ),
        "--resume": dict(
            action="store_true",
            help="start from the parts already in --out (continue a finished run; give another "
            "--seed so it draws other batches)",
        ),
        "--draft-vocab": dict(
            type=int, default=None,
            help="also report the held-out agreement of drafts over the N most frequent tokens",
        ),
        "--held-out-tokens": dict(type=int, default=32768, help="tokens of the held-out report"),
    })  # fmt: skip
    add_run_flags(parser)


def add_steps(parser: argparse.ArgumentParser, *, steps: int, seq_len: int, lr: float) -> None:
    """How long a resumable training run runs and on what batches: ``--steps``, ``--minutes``,
    ``--checkpoint-every``, ``--fresh``, ``--batch-size``, ``--seq-len``, ``--lr``."""
    add_flags(parser, {
        "--steps": dict(type=int, default=steps),
        "--minutes": dict(
            type=float, default=0.0,
            help="> 0: stop after this wall time (the parts so far are written); the same command "
            "continues (resumable)",
        ),
        "--checkpoint-every": dict(type=int, default=100, help="steps between checkpoints"),
        "--fresh": dict(action="store_true", help="drop this run's checkpoint and start over"),
        "--batch-size": dict(type=int, default=8),
        "--seq-len": dict(type=int, default=seq_len),
        "--lr": dict(type=float, default=lr),
    })  # fmt: skip


def add_run_flags(parser: argparse.ArgumentParser, *, device: bool = True) -> None:
    """Where and how a training run runs: ``--threads``, ``--device`` (not where
    ``device=False``: the run is CPU-only), ``--corpus-root``, ``--progress``, ``--quiet``."""
    add_threads(parser)
    if device:
        add_device(parser, help=DEVICE_TRAIN_HELP)
    add_corpus_root(parser)
    add_progress(parser)
    add_quiet(parser, help="no progress bars")


def add_drafter_command(
    sub, recipe: str, *, help: str, shipped: str, option: str, option_help: str, steps: int,
    seq_len: int, lr: float,
) -> None:  # fmt: skip
    """``train-<recipe>`` (``train-eagle``, ``train-kangaroo``): the drafter-training flags, the
    recipe's one int option ``--<option>`` (given to ``rewrite.apply`` where set), and
    :func:`run_drafter_training`; ``shipped``: the reference model's parts."""
    parser = sub.add_parser(f"train-{recipe}", help=help)
    add_drafter_training(
        parser, shipped_help=f"required but for the reference model, whose default is {shipped}",
        steps=steps, seq_len=seq_len, lr=lr,
    )  # fmt: skip
    parser.add_argument(f"--{option.replace('_', '-')}", type=int, default=None, help=option_help)

    def run(args: argparse.Namespace) -> int:
        value = getattr(args, option)
        return run_drafter_training(args, recipe, apply={} if value is None else {option: value})

    parser.set_defaults(func=run)


def run_drafter_training(
    args: argparse.Namespace, recipe: str, *, apply: dict, fit: dict | None = None
) -> int:
    """Run ``train-<recipe>`` from its parsed flags; prints the summary as JSON."""
    from ..runs.drafters import train_drafter

    set_threads(args)
    names = ("steps", "batch_size", "seq_len", "lr", "seed")
    fit = {**{n: getattr(args, n) for n in names}, "max_minutes": args.minutes, **(fit or {})}
    summary = train_drafter(
        recipe, args.out, model=args.model, data=args.data, apply=apply, fit=fit,
        resume=args.resume, features=args.features, checkpoint_every=args.checkpoint_every,
        fresh=args.fresh, draft_vocab=args.draft_vocab, cache_dir=args.cache_dir,
        exclude=benchmark_texts() if args.data == "self" else None,
        corpus_root=args.corpus_root, self_options=self_options(args),
        held_out_tokens=args.held_out_tokens, device=args.device, progress=_progress(args),
    )  # fmt: skip
    print(json.dumps(summary, indent=2))
    return 0
