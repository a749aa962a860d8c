"""``leapfx bench --offload-slots S``: the expert-offload report printed under the table
(``leapfx.bench.offload``)."""

from __future__ import annotations


def report(model, rows, config, prompts, exit_layer: int, plot: str | None) -> None:
    """The offload rows' table; with --plot, one untimed traced call (the last prompt) of each
    autoregressive offloaded row, drawn as timelines beside every row's hit rate per layer."""
    import torch

    from ..bench.offload import ORACLE_ROW, bench_table, plot_offload, trace_call
    from ..rewrite import apply

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
    specs = config.offload_systems(exit_layer)
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
