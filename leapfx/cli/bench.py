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
    _adapter,
    _bench_recipes,
    _exit_gates,
    _progress,
    _reference_defaults,
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
    bench_options.declare(bench)
    bench.set_defaults(func=_bench_and_report)
