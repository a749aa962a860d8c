"""``leapfx bench --sweep-threshold``: the agreement-vs-speed curves of the lossy recipes
beside early exit at every E (SpecEE's threshold, M2R2's ``m2r2_exit``)."""

from __future__ import annotations

import dataclasses

from . import bench_options


def vs_early_exit(curve, systems: tuple[str, ...]) -> dict:
    """The sweep's verdict for the JSON: each early-exit point against each curve of
    ``systems`` at equal speed and at equal layers (``"system/key"``)."""
    from ..bench.specee_sweep import above_early_exit

    return {
        f"{system}/{key}": [dataclasses.asdict(c) | {"above": c.above}
                            for c in above_early_exit(curve, system, key)]
        for system in systems for key in ("speedup", "avg_layers")
    }  # fmt: skip


def exit_curve(args, model, prompts, rows, config, num_layers: int) -> list:
    """--sweep-threshold with --recipe m2r2: m2r2_exit's agreement-vs-speed curve at each
    --sweep-thresholds beside fixed early exit at --sweep-exit-layers."""
    from ..bench.exit_curve import SYSTEM, exit_curve
    from ..bench.specee_sweep import comparison_summary, sweep_threshold_table

    try:
        taus = [float(x) for x in args.sweep_thresholds.split(",")]
    except ValueError:
        taus = []
    if not taus or min(taus) < 0:
        raise ValueError(
            f"--sweep-thresholds: {args.sweep_thresholds!r} is invalid; allowed: numbers >= 0, "
            "comma-separated (e.g. 0.5,0.7,0.9)"
        )
    exits = bench_options.grid(args.sweep_exit_layers, num_layers)
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
        from ..parts.m2r2 import read_parts_config

        gates = read_parts_config(parts).get("options", {}).get("exit_gates")
    print(f"m2r2_exit's deciding gates: {'every gate' if gates is None else list(gates)}")
    print(sweep_threshold_table(points))
    print(comparison_summary(points, (SYSTEM,)))
    return points


def predictor_share(row) -> float | None:
    """Predictor time over decode time of a specee row (its stage timings)."""
    stages = row.extra.get("stage_seconds") or {}
    if "predictor" not in stages or not row.seconds:
        return None
    return stages["predictor"] / row.seconds


def specee_curve(args, model, prompts, rows, config, num_layers, quiet):
    """--sweep-threshold: specee at each threshold beside early_exit at every E."""
    from ..bench.specee_sweep import comparison_summary, sweep_threshold_table, threshold_sweep
    from ..bench.systems import specee_options, use_cpu_kernels
    from ..rewrite import apply

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
