"""``leapfx generate``: text in, text out through a recipe, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .common import (
    CPU_KERNELS,
    RECIPE_NAMES,
    add_cpu_kernels,
    add_device,
    add_dtype,
    add_flags,
    add_model,
    add_seed,
    add_threads,
    add_weights,
    set_threads,
)


def load(args: argparse.Namespace):
    """The model of ``--model`` through ``--recipe`` (``generate`` and ``chat``): the
    SpeculativeModel and the tokenizer."""
    import time

    import transformers

    from .. import rewrite
    from ..models import load_model

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    set_threads(args)
    start = time.perf_counter()
    model, tokenizer = load_model(
        args.model, device=args.device, dtype=args.dtype, weights=args.weights
    )
    options = dict(_option(o) for o in args.option or ())
    parts = None if args.parts == "none" else args.parts
    sm = rewrite.apply(
        model, args.recipe, backend=args.backend, parts=parts,
        cpu_kernels=CPU_KERNELS[args.cpu_kernels], **options,
    )  # fmt: skip
    logging.getLogger(__name__).info(
        "leapfx %s: %s ready in %.1f s", args.command, sm.recipe.name, time.perf_counter() - start
    )
    return sm, tokenizer


def decoding(args: argparse.Namespace, tokenizer) -> dict:
    """``sm.generate``'s keywords from the decoding flags (``add_decoding``), checked."""
    import torch

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: {args.max_new_tokens} is invalid; allowed: >= 1")
    if args.temperature < 0:
        raise ValueError(f"--temperature: {args.temperature} is invalid; allowed: >= 0")
    kw: dict = {"max_new_tokens": args.max_new_tokens, "do_sample": args.temperature > 0}
    if args.temperature > 0:
        kw["temperature"] = args.temperature
        kw["generator"] = torch.Generator(device=args.device).manual_seed(args.seed)
        if args.top_k is not None:
            kw["top_k"] = args.top_k
        if args.top_p is not None:
            kw["top_p"] = args.top_p
    elif args.top_k is not None or args.top_p is not None:
        raise ValueError("--top-k/--top-p: they shape sampling; allowed with --temperature > 0")
    if args.repetition_penalty is not None:
        kw["repetition_penalty"] = args.repetition_penalty
    if args.no_repeat_ngram_size is not None:
        kw["no_repeat_ngram_size"] = args.no_repeat_ngram_size
    if args.min_new_tokens is not None:
        kw["min_new_tokens"] = args.min_new_tokens
    if args.stop:
        kw["stop_strings"] = list(args.stop)
        kw["tokenizer"] = tokenizer
    return kw


def _generate(args: argparse.Namespace) -> int:
    """``leapfx generate``: a prompt in, the recipe's answer streamed out."""
    import transformers

    from ..textgen import generate_text, summary

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("prompt: empty; allowed: the prompt as an argument or on stdin")
    sm, tokenizer = load(args)
    kw = decoding(args, tokenizer)
    streamer = None
    if not args.no_stream:
        streamer = transformers.TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = generate_text(
        sm, tokenizer, prompt, raw=args.raw, system=args.system, streamer=streamer, **kw
    )
    if args.no_stream:
        print(result.text)
    sys.stdout.flush()
    print(summary(result, sm.recipe.name), file=sys.stderr)
    return 0


def _option(text: str) -> tuple[str, object]:
    """``--option KEY=VALUE``: VALUE read as JSON where it parses (numbers, true/false,
    null, lists), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--option: {text!r} is invalid; allowed: KEY=VALUE, e.g. exit_layer=4")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return key.strip(), parsed


def add_recipe_flags(parser: argparse.ArgumentParser, model: str | None = None) -> None:
    """What decodes: ``--model`` (default ``model``; None: the reference), ``--recipe``, its
    parts and options, the backend and device (``generate`` and ``chat``)."""
    add_model(parser, default=model)
    parser.add_argument(
        "--recipe", default="auto", choices=RECIPE_NAMES, metavar="RECIPE",
        help=f"one of {', '.join(RECIPE_NAMES)}; auto: the best drafting the model has (EAGLE "
        "with prompt lookup where a head was trained for it, else adaptive prompt lookup)",
    )  # fmt: skip
    parser.add_argument(
        "--parts", default="auto",
        help="trained parts dir for the recipe; auto: parts trained for this model (yours under "
        "$LEAPFX_CACHE/parts, then the shipped ones), if any; none: untrained",
    )  # fmt: skip
    parser.add_argument(
        "--option", "-o", action="append", metavar="KEY=VALUE",
        help="a recipe option, e.g. -o exit_layer=8 -o num_speculations=4 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    add_cpu_kernels(parser)
    add_device(parser)
    add_dtype(parser)
    add_weights(parser)
    add_threads(parser, help="torch intra-op threads")


def add_decoding(parser: argparse.ArgumentParser, max_new_tokens: int = 256) -> None:
    """How tokens are chosen and when decoding stops (``decoding`` reads them)."""
    add_flags(parser, {
        "--max-new-tokens": dict(type=int, default=max_new_tokens),
        "--min-new-tokens": dict(type=int, default=None, help="no EOS before it"),
        "--temperature": dict(type=float, default=0.0, help="> 0: sample"),
        "--top-k": dict(type=int, default=None, help="sampling: the k likeliest"),
        "--top-p": dict(type=float, default=None, help="sampling: nucleus mass"),
    })  # fmt: skip
    add_seed(parser, help="sampling seed")
    add_flags(parser, {
        "--repetition-penalty": dict(
            type=float, default=None,
            help="HF's repetition penalty (> 1 discourages repeats)",
        ),
        "--no-repeat-ngram-size": dict(type=int, default=None, help="no n-gram of this size twice"),
        "--stop": dict(
            action="append", metavar="TEXT",
            help="stop once the text ends with TEXT (repeatable)",
        ),
    })  # fmt: skip


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="text in, text out: a prompt through a recipe, streamed to stdout"
    )
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: stdin)")
    add_recipe_flags(gen)
    add_decoding(gen)
    add_flags(gen, {
        "--raw": dict(action="store_true", help="no chat template"),
        "--system": dict(default=None, help="a system turn before the prompt"),
        "--no-stream": dict(action="store_true", help="print the answer at the end"),
    })  # fmt: skip
    gen.set_defaults(func=_generate)
