"""``leapfx train-specee``: train SpecEE's exit predictors."""

from __future__ import annotations

import argparse
import json

from .common import _progress, add_flags, add_model, add_seed
from .train_parts import add_data, add_out, add_run_flags, benchmark_texts, parts_out, self_options


def _train_specee(args: argparse.Namespace) -> int:
    import torch

    from ..models import REFERENCE_MODEL, load_model
    from ..models.gguf import cache_root
    from ..rewrite import apply
    from ..train.sources import check_data, training_data

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = parts_out(args, REFERENCE_MODEL / "specee")
    check_data(args.data)
    model, tokenizer = load_model(args.model, device=args.device)
    cache = args.cache_dir or cache_root() / "train"
    data = training_data(args.data, model, tokenizer, cache_dir=cache,
                         exclude=benchmark_texts() if args.data == "self" else None,
                         corpus_root=args.corpus_root, self_options=self_options(args),
                         progress=_progress(args)).train  # fmt: skip
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
    sm.save_parts(out)
    print(json.dumps({"parts": str(out), **result.as_dict()}, indent=2))
    return 0


def add_parser(sub) -> None:
    specee = sub.add_parser(
        "train-specee", help="train SpecEE's exit predictors for a model (default: the reference)"
    )
    add_out(
        specee, positional=True,
        default_help="required but for the reference model: leapfx/assets/reference/specee",
    )  # fmt: skip
    add_model(specee)
    add_data(specee)
    add_flags(specee, {
        "--drafter": dict(default="exit_head", choices=("eagle", "exit_head", "kangaroo")),
        "--eagle": dict(
            default=None,
            help="eagle drafter: a trained head dir (default: the shipped one for the reference)",
        ),
        "--draft-steps": dict(
            type=int, default=None,
            help="eagle drafter: head training steps before the predictors (default: "
            "200, or 0 with --eagle)",
        ),
        "--exit-layer": dict(type=int, default=None, help="the drafter's layer E"),
        "--adapter": dict(
            default=None,
            help="kangaroo drafter: adapter dir (default: the shipped one)",
        ),
        "--prompts": dict(type=int, default=64),
        "--prompt-len": dict(type=int, default=64),
        "--new-tokens": dict(type=int, default=256),
        "--epochs": dict(type=int, default=100),
    })  # fmt: skip
    add_seed(specee)
    add_flags(specee, {
        "--threshold": dict(
            type=float, default=None,
            help="exit threshold saved with the parts (default: 0.5, or see --target-agreement)",
        ),
        "--target-agreement": dict(
            type=float, default=None,
            help="pick the threshold of fewest layers whose held-out agreement reaches this",
        ),
        "--features": dict(
            default=None,
            help="safetensors file caching the collected features (read if it exists)",
        ),
    })  # fmt: skip
    add_run_flags(specee)
    specee.set_defaults(func=_train_specee)
