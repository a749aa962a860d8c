"""``leapfx bench --batch-size 1,4,8``: the batch report (total tokens/s per system and batch
size, ``leapfx.bench.batch``)."""

from __future__ import annotations

import argparse

from . import bench_options
from .common import _bench_recipes


def run(args, model, tokenizer, prompts, exit_layer, d, kernels, quiet) -> int:
    """``--batch-size``: total throughput per system and batch size (``bench.batch``)."""
    import torch

    from ..bench.batch import (
        BatchBenchConfig,
        batch_table,
        run_batch_bench,
        varied_lengths,
        write_batch_plot,
    )  # fmt: skip
    from ..bench.report import write_json

    config = BatchBenchConfig(
        batch_sizes=args.batch_size, recipes=tuple(sorted(_bench_recipes(args))),
        exit_layer=exit_layer, num_speculations=d, max_new_tokens=args.max_new_tokens,
        repeats=args.repeats, warmup=args.warmup, cpu_kernels=kernels,
        backends=tuple(args.backend.split(",")),
        recipe_options={"eagle": batch_eagle_options(args, model)},
    ).validate()  # fmt: skip
    prompts = varied_lengths(prompts)
    lengths = [p.shape[1] for p in prompts]
    print(f"--batch-size {','.join(map(str, config.batch_sizes))}: {len(prompts)} prompts of "
          f"{min(lengths)}..{max(lengths)} tokens, left-padded per batch")  # fmt: skip
    config_pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    pad = config_pad if config_pad is not None else (eos[0] if isinstance(eos, list) else eos)
    rows = run_batch_bench(
        model, prompts, config, pad_token_id=0 if pad is None else int(pad), progress=not quiet
    )
    print(batch_table(rows))
    print(
        "x leapfx_AR / x hf_greedy: tokens/s over that system's at the same batch size; "
        "identical rows: per row against hf_greedy on the same padded batch; draft lengths: "
        "rounds per draft length the batch policy chose (0: a plain step)"
    )
    if args.json:
        meta = {
            "model": str(args.model or "reference"), "recipe": args.recipe,
            "batch_sizes": list(config.batch_sizes), "exit_layer": exit_layer,
            "num_speculations": d, "prompt_set": args.prompt_set, "prompts": len(prompts),
            "prompt_lengths": lengths, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "device": args.device,
            "cpu_kernels": args.cpu_kernels, "backend": args.backend,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        }  # fmt: skip
        write_json(args.json, rows, meta)
    if args.plot:
        write_batch_plot(args.plot, rows)
    return 0


def batch_eagle_options(args: argparse.Namespace, model) -> dict:
    """The batch bench's EAGLE: the benchmarked model's head (``bench_options.eagle_parts``)
    with its own draft length, over the subset vocabulary where its parts rank one
    (``EAGLE_DRAFT_VOCAB``), and prompt lookup first (a row with a match copies, the others
    draft with the head)."""
    from ..bench.systems import EAGLE_DRAFT_VOCAB
    from ..parts.draft_vocab import read_ranking

    parts = bench_options.eagle_parts(args) if "eagle" in _bench_recipes(args) else None
    if parts is None:
        return {}
    options = {"parts": parts, "lookup": True, "max_draft_tokens": None}
    if model.config.vocab_size >= 4 * EAGLE_DRAFT_VOCAB and read_ranking(parts) is not None:
        options["draft_vocab"] = EAGLE_DRAFT_VOCAB
    return options
