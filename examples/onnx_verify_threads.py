"""Side by side in one process: the reference model's layerskip export on onnxruntime with
verify's upper part on one thread and on two (``OnnxModel(verify_threads=2)``), against the
autoregressive schedule on one thread and (timed apart, beside a second one-thread run) on two
spinning threads: the same second core, offered to the baseline. Per variant: tokens/s (median
of ``--repeats`` passes over the four prompts), and for layerskip the bench's formula line:
alpha, c, verify (both over one one-thread autoregressive step), predicted and measured
speedup, share.

    python examples/onnx_verify_threads.py [--repeats 3] [--max-new-tokens 96] [--out runs/vt]
"""

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from leapfx import rewrite
from leapfx.bench.sweep import predicted_speedup
from leapfx.export import OnnxModel
from leapfx.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--out", default="runs/vt")
args = parser.parse_args()
torch.set_num_threads(1)
model, tok = load_model()
d = 4
sm = rewrite.apply(model, "layerskip", exit_layer=6, num_speculations=d)
path = sm.export_onnx(Path(args.out) / "layerskip", overwrite=True)
texts = [
    "The quick brown fox jumps over the lazy dog. In the beginning there was a small model",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The",
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self",
]
prompts = [torch.tensor([tok(t)["input_ids"][:64]]) for t in texts]


def measure(variants: dict[str, OnnxModel]) -> dict[str, list]:
    """Per variant, per timed pass: (tokens/s, stage seconds, call counts); in turn each pass."""
    passes = {name: [] for name in variants}
    n = args.max_new_tokens
    for r in range(args.repeats + 1):  # the first pass warms up
        for name, om in variants.items():
            seconds, stages = 0.0, {}
            counts = dict.fromkeys(("draft", "verify", "full", "acc", "rej"), 0)
            for p in prompts:
                start = time.perf_counter()
                om.generate(p, max_new_tokens=n, do_sample=False, eos_token_id=[])
                seconds += time.perf_counter() - start
                m = om.last_metrics
                for k, v in m.stage_seconds.items():
                    stages[k] = stages.get(k, 0.0) + v
                counts["draft"] += m.draft_calls
                counts["verify"] += m.verify_calls
                counts["full"] += m.full_calls - 1  # the prefill is not a step
                counts["acc"] += m.accepted_drafts
                counts["rej"] += m.rejections
            if r:
                passes[name].append((n * len(prompts) / seconds, stages, counts))
    return passes


ar = "autoregressive, 1 thread"
# Two groups: a spinning session's workers slow another spinning session in the same process
# (both want the second core), so the 2-thread baseline is timed apart, with the 1-thread one.
passes = measure({
    ar: OnnxModel(path, threads=1, recipe="autoregressive"),
    "layerskip, verify on 1 thread": OnnxModel(path, threads=1),
    "layerskip, verify's upper part on 2": OnnxModel(path, threads=1, verify_threads=2),
})  # fmt: skip
gc.collect()
apart = measure(
    {
        ar + " (again)": OnnxModel(path, threads=1, recipe="autoregressive"),
        "autoregressive, 2 spinning threads": OnnxModel(
            path, threads=2, spin=True, recipe="autoregressive"
        ),
    }
)
passes.update(apart)

base = passes[ar]
base_tps = statistics.median(p[0] for p in base)
step = statistics.median(p[1]["full"] / p[2]["full"] for p in base)
for name, runs in passes.items():
    tps = statistics.median(p[0] for p in runs)
    line = f"{name:38s} {tps:7.1f} tok/s  {tps / base_tps:.2f}x"
    if name.endswith("2 spinning threads"):  # against the 1-thread row of its own group
        again = statistics.median(p[0] for p in passes[ar + " (again)"])
        line += f" ({tps / again:.2f}x the 1-thread row timed beside it)"
    if name.startswith("layerskip"):
        c = statistics.median(p[1]["draft"] / p[2]["draft"] for p in runs) / step
        v = statistics.median(p[1]["verify"] / p[2]["verify"] for p in runs) / step
        counts = runs[0][2]
        alpha = counts["acc"] / (counts["acc"] + counts["rej"])
        predicted = predicted_speedup(alpha, d, c)
        share = tps / base_tps / predicted
        line += f"  alpha {alpha:.3f} c {c:.3f} verify {v:.2f} -> formula {predicted:.2f}x"
        line += f", share {100 * share:.0f}%"
    print(line)
