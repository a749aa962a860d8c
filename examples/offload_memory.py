"""How much memory does offloading save? Peak RSS of decoding with the experts loaded or not.

    python examples/offload_memory.py                         # the shipped MoE reference model
    python examples/offload_memory.py --model DIR --slots 0.25 --tokens 32

Runs each way in a fresh interpreter (peak RSS is per process) and prints its peak resident
set, its anonymous resident memory after decoding (``RssAnon``: not the checkpoint's mapped
file pages, which the kernel can drop), the bytes of tensors the model holds, the fast tier's
slots, and whether the tokens match:

- ``resident``: ``from_pretrained``, every expert in memory, no offload;
- ``offload``: ``from_pretrained``, then ``rewrite.apply(..., offload=OffloadOptions(slots=S))``:
  the model's own expert tensors stay, so the slots come on top of them;
- ``load_offloaded``: ``leapfx.offload.load_offloaded(DIR)``, the experts never loaded:
  the slow tier is written from the checkpoint an expert at a time, and only the slots hold
  experts in memory.

Both include the interpreter and torch (peak RSS also the checkpoint's pages mapped while it
is read), so the differences between rows are what to read, not the totals.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

WAYS = ("resident", "offload", "load_offloaded")


def _child(args: argparse.Namespace) -> None:
    import torch
    import transformers

    from leapfx import rewrite
    from leapfx.bench import bench_prompts
    from leapfx.models import load_model, resolve_model
    from leapfx.offload import OffloadOptions, load_offloaded

    torch.set_num_threads(1)
    path = resolve_model(args.model)
    offload = OffloadOptions(slots=args.slots)
    if args.way == "load_offloaded":
        model = load_offloaded(path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    else:
        model, tokenizer = load_model(path)
    held = sum(t.numel() * t.element_size() for t in model.parameters() if not t.is_meta)
    sm = rewrite.apply(model, "autoregressive", offload=None if args.way == "resident" else offload)
    slots = 0
    if sm.offload is not None:
        slots = sum(p.numel() * p.element_size() for pools in (sm.offload.gate_up, sm.offload.down)
                    for p in pools.values())  # fmt: skip
    prompt = bench_prompts(tokenizer, count=1, num_tokens=args.tokens)[0]
    with torch.inference_mode():
        out = sm.generate(prompt, max_new_tokens=args.tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    anon = _status_kib("RssAnon") * 1024
    print(json.dumps({"peak": peak, "anon": anon, "held": held, "slots": slots,
                      "tokens": out[0].tolist()}))  # fmt: skip


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (0 where there is no such file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="moe-reference", help="an MoE checkpoint directory")
    parser.add_argument("--slots", type=float, default=0.5, help="fast-tier slots (share or count)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens to decode")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.tokens < 1:
        parser.error(f"--tokens: {args.tokens} is invalid; allowed: >= 1")
    if args.way:
        return _child(args)
    rows = {}
    for way in WAYS:
        cmd = [sys.executable, __file__, "--model", args.model, "--slots", str(args.slots),
               "--tokens", str(args.tokens), "--way", way]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{way}: {done.stderr.strip().splitlines()[-1]}")
        rows[way] = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"{'way':16s}{'peak RSS':>10s}{'anon RSS':>10s}{'model tensors':>15s}{'slots':>8s}"
          "  tokens (MiB)")  # fmt: skip
    for way, r in rows.items():
        same = "identical" if r["tokens"] == rows["resident"]["tokens"] else "DIFFERENT"
        print(f"{way:16s}{r['peak'] / mib:10.1f}{r['anon'] / mib:10.1f}{r['held'] / mib:15.1f}"
              f"{r['slots'] / mib:8.1f}  {same}")  # fmt: skip


if __name__ == "__main__":
    main()
