"""Train the Kangaroo adapter for the shipped reference model (issue: Kangaroo recipe).

    python examples/train_kangaroo_adapter.py [--steps 400] [--exit-layer 2] [--out DIR]

Only the adapter trains (Kangaroo eq. 3: cross-entropy of the adapter's distribution against the
full model's, same positions), on the stdlib corpus's training split tokenized with the
reference tokenizer. Writes ``leapfx/assets/reference/kangaroo_adapter`` by default.

On a GPU, with another Python, on this machine's corpus (a copy of its stdlib folder)::

    python examples/train_kangaroo_adapter.py --device cuda --corpus-root .stdlib311 \\
        --model runs/reference-gpu/model --out runs/reference-gpu/kangaroo_adapter

The model computes in float32 on ``--device``; the adapter is saved from CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from leapfx import rewrite
from leapfx.bench import REFERENCE_ADAPTER
from leapfx.models import load_model
from leapfx.train.data import encode_documents
from leapfx.train.kangaroo import evaluate_loss
from leapfx.train.reference import corpus_digest, reference_corpus
from leapfx.train.trainer import describe_device, resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: reference)")
    parser.add_argument("--exit-layer", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (float32)")
    parser.add_argument(
        "--corpus-root", default=None, help="stdlib folder to train on (default: this Python's)"
    )
    parser.add_argument("--out", default=str(REFERENCE_ADAPTER))
    args = parser.parse_args()
    # Checked before anything is loaded or written.
    device = resolve_device(args.device, option="--device")
    corpus = reference_corpus(args.corpus_root, option="--corpus-root")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)  # float32 on the CPU
    model.to(device)  # before rewrite.apply: the adapter is built on the model's device
    train = encode_documents(tokenizer, corpus.train).long()
    held = encode_documents(tokenizer, corpus.held_out).long()[:32768]
    sm = rewrite.apply(model, "kangaroo", exit_layer=args.exit_layer)
    before = evaluate_loss(sm, held)
    result = sm.fit(
        train, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr
    )
    after = evaluate_loss(sm, held)
    sm.save_adapter(args.out)
    summary = {
        "held_out_eq3_loss_before": before,
        "held_out_eq3_loss_after": after,
        "steps": result.steps,
        "seconds": result.seconds,
        "device": describe_device(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "corpus": {
            "root": corpus.root,
            "files": len(corpus.train) + len(corpus.held_out),
            "sha256": corpus_digest(corpus),
        },
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
