"""``leapfx serve``: an OpenAI-compatible HTTP server over a recipe, concurrent requests decoded
as one batch (continuous batching; see docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from .generate import add_recipe_flags, load


def _serve(args: argparse.Namespace) -> int:
    for name in ("port", "max_batch", "max_queue", "max_len"):
        value, low = getattr(args, name), {"max_queue": 0, "port": 0}.get(name, 1)
        if value < low:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: {value} is invalid; allowed: >= {low}")
    try:
        import uvicorn
    except ImportError:
        raise ValueError(
            "leapfx serve: needs FastAPI and uvicorn; allowed: pip install 'leapfx[serve]'"
        ) from None
    from ..serve import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sm, tokenizer = load(args)
    name = args.model_name or args.model or "reference"
    app = create_app(sm, tokenizer, model_name=name, max_batch=args.max_batch,
                     max_queue=args.max_queue, max_len=args.max_len)  # fmt: skip
    print(f"leapfx serve: {sm.recipe.name} on {name} at http://{args.host}:{args.port}/v1 "
          f"(max batch {args.max_batch})", file=sys.stderr)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.graceful)  # fmt: skip
    return 0


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible server (continuous batching, streamed)"
    )
    add_recipe_flags(serve, model="smollm2")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", default=None,
                       help="the model's id in the API (default: --model)")  # fmt: skip
    serve.add_argument("--max-batch", type=int, default=8, help="rows decoded together at most")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting at most; past it a 429")  # fmt: skip
    serve.add_argument("--max-len", type=int, default=2048,
                       help="positions a request may use (prompt + new tokens)")  # fmt: skip
    serve.add_argument("--graceful", type=float, default=60.0,
                       help="seconds SIGTERM waits for requests in flight")  # fmt: skip
    serve.set_defaults(func=_serve)
