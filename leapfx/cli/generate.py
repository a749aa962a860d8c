"""``leapfx generate``: text in, text out through a recipe, streamed to stdout."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .common import (
    CPU_KERNELS,
    add_cpu_kernels,
    add_device,
    add_model,
    add_threads,
    add_weights,
    set_threads,
)


def _generate(args: argparse.Namespace) -> int:
    """``leapfx generate``: a prompt in, the recipe's answer streamed out."""
    import time

    import torch
    import transformers

    from .. import rewrite
    from ..models import load_model
    from ..textgen import generate_text, summary

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("prompt: empty; allowed: the prompt as an argument or on stdin")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: {args.max_new_tokens} is invalid; allowed: >= 1")
    if args.temperature < 0:
        raise ValueError(f"--temperature: {args.temperature} is invalid; allowed: >= 0")
    set_threads(args)
    start = time.perf_counter()
    model, tokenizer = load_model(
        args.model, device=args.device, dtype=args.dtype, weights=args.weights
    )
    options = dict(_option(o) for o in args.option or ())
    sm = rewrite.apply(
        model, args.recipe, backend=args.backend, parts=args.parts,
        cpu_kernels=CPU_KERNELS[args.cpu_kernels], **options,
    )  # fmt: skip
    log = logging.getLogger(__name__)
    log.info("leapfx generate: ready in %.1f s", time.perf_counter() - start)
    sampling: dict = {"do_sample": args.temperature > 0}
    if args.temperature > 0:
        sampling["temperature"] = args.temperature
        sampling["generator"] = torch.Generator(device=args.device).manual_seed(args.seed)
        if args.top_k is not None:
            sampling["top_k"] = args.top_k
        if args.top_p is not None:
            sampling["top_p"] = args.top_p
    streamer = None
    if not args.no_stream:
        streamer = transformers.TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = generate_text(
        sm, tokenizer, prompt, raw=args.raw, system=args.system, streamer=streamer,
        max_new_tokens=args.max_new_tokens, **sampling,
    )  # fmt: skip
    if args.no_stream:
        print(result.text)
    sys.stdout.flush()
    print(summary(result, args.recipe), file=sys.stderr)
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


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="text in, text out: a prompt through a recipe, streamed to stdout"
    )
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: stdin)")
    add_model(gen)
    gen.add_argument("--recipe", default="autoregressive", help="any recipe (leapfx.rewrite)")
    gen.add_argument("--parts", default=None, help="trained parts dir for the recipe")
    gen.add_argument(
        "--option", "-o", action="append", metavar="KEY=VALUE",
        help="a recipe option, e.g. -o exit_layer=8 -o num_speculations=4 (repeatable)",
    )  # fmt: skip
    gen.add_argument("--max-new-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="> 0: sample")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--system", default=None, help="a system turn before the prompt")
    gen.add_argument("--no-stream", action="store_true", help="print the answer at the end")
    gen.add_argument("--backend", default="eager", choices=("eager", "inductor"))
    add_cpu_kernels(gen)
    add_device(gen)
    gen.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    add_weights(gen)
    add_threads(gen, help="torch intra-op threads")
    gen.set_defaults(func=_generate)
