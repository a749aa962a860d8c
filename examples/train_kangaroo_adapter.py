"""Train the Kangaroo adapter for the shipped reference model (issue: Kangaroo recipe).

    python examples/train_kangaroo_adapter.py [--steps 400] [--exit-layer 2] [--out DIR]

Only the adapter trains (Kangaroo eq. 3: cross-entropy of the adapter's distribution against the
full model's, same positions), on the stdlib corpus's training split tokenized with the
reference tokenizer. Writes ``leapfx/assets/reference/kangaroo_adapter`` by default.
"""

from __future__ import annotations

import argparse
import json

import torch

from leapfx import rewrite
from leapfx.bench import REFERENCE_ADAPTER, load_model
from leapfx.train.data import encode_documents, stdlib_corpus
from leapfx.train.kangaroo import evaluate_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: reference)")
    parser.add_argument("--exit-layer", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(REFERENCE_ADAPTER))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    corpus = stdlib_corpus()
    train = encode_documents(tokenizer, corpus.train).long()
    held = encode_documents(tokenizer, corpus.held_out).long()[:32768]
    sm = rewrite.apply(model, "kangaroo", exit_layer=args.exit_layer)
    before = evaluate_loss(sm, held)
    sm.fit(train, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr)
    after = evaluate_loss(sm, held)
    sm.save_adapter(args.out)
    print(json.dumps({"held_out_eq3_loss_before": before, "held_out_eq3_loss_after": after}))


if __name__ == "__main__":
    main()
