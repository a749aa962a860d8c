"""``leapfx bench --sweep`` and ``--auto``: LayerSkip's exit layer E and draft length d over a
grid, calibrated on the prompts (``leapfx.bench.sweep``): the sweep's table, or the setting
``--auto`` picks and whether it pays."""

from __future__ import annotations

import argparse

from . import bench_options


def report(args: argparse.Namespace, model, prompts, d: int, kernels, quiet: bool):
    """The calibration of the grid (printed as a table with ``--sweep``) and, with ``--auto``,
    the setting it picks (``{"exit_layer", "num_speculations", "pays", "measured",
    "predicted"}``; else None)."""
    from ..bench.sweep import calibrate, choose, pays, sweep_table

    auto = None
    num_layers = model.config.num_hidden_layers
    exits = bench_options.grid(args.sweep_exit_layers, num_layers)
    specs = bench_options.speculations(args.sweep_speculations) if args.sweep or args.auto else [d]
    cal_prompts = prompts if args.sweep else prompts[:2]
    calibration = calibrate(
        model, cal_prompts, exits, specs, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats if args.sweep else 1, progress=not quiet,
        cpu_kernels=bench_options.calibration_kernels(model, kernels),
    )  # fmt: skip
    if args.sweep:
        print(sweep_table(calibration))
    if args.auto:
        best = choose(calibration)
        print(
            f"--auto: exit_layer={best.exit_layer} num_speculations={best.num_speculations} "
            f"(calibration: measured {best.measured:.2f}x over leapfx_autoregressive; alpha "
            f"{best.alpha:.3f}, c {best.c:.3f}, predicted {best.predicted:.2f}x)"
        )
        auto = {"exit_layer": best.exit_layer, "num_speculations": best.num_speculations,
                "pays": pays(best), "measured": best.measured,
                "predicted": best.predicted}  # fmt: skip
        if not auto["pays"]:
            print(
                "--auto: no setting of the calibration decoded faster than "
                "leapfx_autoregressive: on this model and machine LayerSkip's self-"
                "speculation only costs; decode without it (recipe autoregressive), or "
                "with adaptive=True, which drafts only where measured drafts pay"
            )
    return calibration, auto
