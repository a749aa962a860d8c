"""What ``leapfx bench``'s flags resolve to: the budget a model gets, the parts a row loads,
the onnxruntime thread counts, the offload rows' options, the sweep's grid; each flag's value
checked with an error that names it."""

from __future__ import annotations

import argparse
import os

from .common import _bench_recipes, _shipped

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
