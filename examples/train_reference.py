"""Train the project's reference model (a 16-layer LayerSkip Llama on the Python stdlib).

    python examples/train_reference.py runs/reference --minutes 50 --threads 2 --distill-minutes 10

(the shipped model's command, the same as ``leapfx train-reference``; the defaults are its
settings: bytes, 8 x 256 tokens a step, the early-exit loss at every layer; see
docs/training.md). On a GPU, with another Python, on this corpus (a copy of the
stdlib folder the shipped model was trained on)::

    python examples/train_reference.py runs/reference-gpu --device cuda --corpus-root .stdlib311

Runs again on the same directory resume from the last checkpoint. The model lands in
``runs/reference/model`` (``AutoModelForCausalLM.from_pretrained`` loads it, tokenizer included)
with ``reference_report.json`` beside it. See ``leapfx/train/reference.py`` for the choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from leapfx.train.layerskip import EXIT_CURRICULA
from leapfx.train.reference import REFERENCE_RECIPE, ReferenceModelSpec, train_reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="run directory (created; resumed when it has checkpoints)")
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="fix T instead of probing")
    parser.add_argument("--layers", type=int, default=ReferenceModelSpec.num_layers)
    parser.add_argument("--hidden", type=int, default=ReferenceModelSpec.hidden_size)
    parser.add_argument("--intermediate", type=int, default=ReferenceModelSpec.intermediate_size)
    parser.add_argument(
        "--tokenizer", choices=("bpe", "byte"), default=ReferenceModelSpec.tokenizer
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument(
        "--exit-curriculum",
        choices=EXIT_CURRICULA,
        default=REFERENCE_RECIPE.exit_curriculum,
        help="C(t, l) of the early-exit loss (LayerSkip eq. 5-6)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where to train and evaluate: cpu, cuda, cuda:1, ..."
    )
    parser.add_argument(
        "--corpus-root",
        default=None,
        help="stdlib folder to train on, e.g. a copy of another interpreter's "
        "(default: this interpreter's)",
    )
    parser.add_argument(
        "--focus-exit",
        type=int,
        default=None,
        help="E: give the exit after E layers --focus-share of the early-exit loss "
        "(not in the LayerSkip paper; default: eq. 6 as is)",
    )
    parser.add_argument("--focus-share", type=float, default=None, help="0 < share < 1")
    parser.add_argument(
        "--distill-minutes",
        type=float,
        default=0.0,
        help="minutes of --minutes kept for a second phase that distills the early exits from the "
        "last layer (not in the LayerSkip paper; it also gets what the first phase leaves)",
    )
    parser.add_argument(
        "--distill-steps", type=int, default=None, help="fix that phase's T instead of probing"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = ReferenceModelSpec(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        tokenizer=args.tokenizer,
    )
    report = train_reference(
        args.out_dir,
        minutes=args.minutes,
        seed=args.seed,
        spec=spec,
        recipe=dataclasses.replace(
            REFERENCE_RECIPE,
            exit_curriculum=args.exit_curriculum,
            focus_exit=args.focus_exit,
            focus_share=args.focus_share,
        ),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        threads=args.threads,
        progress=not args.no_progress,
        device=args.device,
        corpus_root=args.corpus_root,
        distill_minutes=args.distill_minutes,
        distill_steps=args.distill_steps,
    )
    summary = {
        "held_out": report["held_out"],
        "agreement_top1": {e: round(v["agreement_top1"], 4) for e, v in report["exits"].items()},
        "tokens_per_s": report["training"]["tokens_per_s"],
        "steps": report["training"]["steps"],
        "distill_steps": (report["distill"] or {}).get("steps"),
        "device": report["training"]["device"],
        "corpus": report["corpus"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
