"""``leapfx serve``: an OpenAI-compatible HTTP server over a recipe, concurrent requests decoded
as one batch (continuous batching; see docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from .common import RECIPE_NAMES, add_flags
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
            "leapfx serve: needs FastAPI and uvicorn; allowed: pip install -e '.[serve]' in "
            "leapfx's checkout"
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
    add_flags(serve, {
        "--host": dict(default="127.0.0.1"),
        "--port": dict(type=int, default=8000),
        "--model-name": dict(default=None, help="the model's id in the API (default: --model)"),
        "--max-batch": dict(type=int, default=8, help="rows decoded together at most"),
        "--max-queue": dict(type=int, default=64, help="requests waiting at most; past it a 429"),
        "--max-len": dict(
            type=int, default=2048,
            help="positions a request may use (prompt + new tokens)",
        ),
        "--graceful": dict(
            type=float, default=60.0,
            help="seconds SIGTERM waits for requests in flight",
        ),
    })  # fmt: skip
    serve.set_defaults(func=_serve)
    add_bench_parser(sub)


def _serve_bench(args: argparse.Namespace) -> int:
    import importlib.util
    import tempfile
    from pathlib import Path

    from ..bench.prompt_sets import CHAT_PROMPTS, HUMANEVAL_INSTRUCTION, humaneval_prompts, spread
    from ..serve import load

    levels = _ints("--concurrency", args.concurrency)
    recipes = [r for r in args.recipe.split(",") if r]
    for r in recipes:
        if r not in RECIPE_NAMES:
            raise ValueError(f"--recipe: {r!r} is invalid; allowed: {', '.join(RECIPE_NAMES)}")
    if args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--requests and --max-tokens: allowed: >= 1")
    if args.prompt_set == "chat":
        texts = list(CHAT_PROMPTS)
    elif args.prompt_set == "humaneval":
        texts = [f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p}```" for p in humaneval_prompts()]
    else:
        raise ValueError(f"--prompt-set: {args.prompt_set!r} is invalid; allowed: chat, humaneval")
    prompts = [[{"role": "user", "content": texts[i]}] for i in spread(len(texts), args.requests)]
    systems = [(f"leapfx_{r}", r) for r in recipes]
    gguf = None
    if args.llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        from ..models import resolve

        source = resolve(args.model)
        if source.kind == "gguf":
            gguf = str(source.path)
            systems.append(("llama_cpp_server", None))
    if args.passes < 1:
        raise ValueError(f"--passes: {args.passes} is invalid; allowed: >= 1")
    logs = Path(tempfile.mkdtemp(prefix="leapfx-serve-bench-"))
    servers: dict[str, tuple[load.ServerProcess, str]] = {}
    try:
        # Every server up first (an idle one waits on a socket), then the systems take turns
        # level by level, pass by pass (in reverse order every other pass): drift on a shared
        # machine falls on all of them.
        for name, recipe in systems:
            port = load.free_port()
            if recipe is None:
                argv = load.llama_cpp_argv(gguf, port, max(levels), args.threads)
            else:
                argv = load.leapfx_argv(args.model, recipe, port, max(levels), args.threads, [])
            print(f"{name}: starting ({' '.join(argv[1:4])} ...)", file=sys.stderr)
            server = load.ServerProcess(argv, port, logs / f"{name}.log")
            servers[name] = (server, "smollm2" if recipe is None else args.model)
            load.run_load(server.url, servers[name][1], prompts[:2], 1, 8)  # warm-up
        passes: dict[tuple[str, int], list[tuple[dict, list]]] = {}
        for p in range(args.passes):
            turns = list(servers.items())
            for c in levels:
                for name, (server, model) in turns if p % 2 == 0 else turns[::-1]:
                    row, answers = load.run_load(server.url, model, prompts, c, args.max_tokens)
                    passes.setdefault((name, c), []).append((row, answers))
                    print(f"{_line({'system': name, **row})} (pass {p + 1})", file=sys.stderr)
    finally:
        for server, _ in servers.values():
            server.close()
    rows = load.median_rows(passes, [name for name, _ in systems], levels)
    for line in load.ratio_lines(rows, levels):
        print(line, file=sys.stderr)
    print(_table(rows, levels))
    meta = {"model": args.model, "prompt_set": args.prompt_set, "requests": args.requests,
            "max_tokens": args.max_tokens, "threads": args.threads, "passes": args.passes,
            "logs": str(logs)}  # fmt: skip
    if args.json:
        load.write_json(args.json, rows, meta)
    if args.plot:
        load.plot(rows, args.plot)
    return 0


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: {text!r} is invalid; allowed: comma-separated ints >= 1")
    return values


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _line(row: dict) -> str:
    return (f"  {row['system']} x{row['concurrency']}: {row['tokens_per_second']:.1f} tok/s, "
            f"TTFT p50 {_fmt(row['ttft_p50'])} s p99 {_fmt(row['ttft_p99'])} s, "
            f"errors {row['errors']}")  # fmt: skip


def _table(rows: list[dict], levels: list[int]) -> str:
    head = ("| system | streams | tok/s | vs 1 stream | TTFT p50 s | TTFT p99 s | chunk gap p50 s "
            "| chunk gap p99 s | TPOT ms | same text | errors |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        one = next((r for r in rows if r["system"] == row["system"] and r["concurrency"] == 1),
                   None)  # fmt: skip
        ratio = row["tokens_per_second"] / one["tokens_per_second"] if one else None
        tpot = None if row["tpot_mean"] is None else 1000 * row["tpot_mean"]
        lines.append(
            f"| {row['system']} | {row['concurrency']} | {row['tokens_per_second']:.1f} | "
            f"{_fmt(ratio, 2)}x | {_fmt(row['ttft_p50'])} | {_fmt(row['ttft_p99'])} | "
            f"{_fmt(row['chunk_gap_p50'])} | {_fmt(row['chunk_gap_p99'])} | {_fmt(tpot, 1)} | "
            f"{row['agreement']:.2f} | {row['errors']} |"
        )
    return "\n".join(lines)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "serve-bench",
        help="load-test leapfx serve (and llama-cpp-python's server) with concurrent streams",
    )
    add_flags(bench, {
        "--model": dict(default="smollm2", help="the model both servers load"),
        "--recipe": dict(
            default="auto,autoregressive",
            help="leapfx serve's recipes, comma-separated: a system each",
        ),
        "--concurrency": dict(default="1,2,4,8", help="concurrent streams to measure"),
        "--prompt-set": dict(default="chat", help="chat or humaneval"),
        "--requests": dict(type=int, default=16, help="prompts answered at each level"),
        "--max-tokens": dict(type=int, default=64),
        "--passes": dict(
            type=int, default=3,
            help="passes over the levels, the systems taking turns; a row is its median pass",
        ),
        "--threads": dict(type=int, default=None, help="each server's threads"),
        "--no-llama-cpp": dict(
            dest="llama_cpp", action="store_false",
            help="leave out llama-cpp-python's server (it runs where it is installed)",
        ),
        "--json": dict(default=None, help="write the rows here"),
        "--plot": dict(default=None, help="a PNG of throughput and p99 TTFT"),
    })  # fmt: skip
    bench.set_defaults(func=_serve_bench)
