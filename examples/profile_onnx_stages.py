"""Profile the onnxruntime stage calls of the reference model's layerskip export, traced graphs
against leapfx's rewritten ones (``export_onnx(optimize=False / True)``), side by side; between
them ``no_gqa``: rewritten without the GroupQueryAttention rewrite (q|k|v and gate|up fused,
cache writes as ScatterND), to show what that rewrite alone changes.

    python examples/profile_onnx_stages.py [--exit-layer 6] [--calls 150] [--out runs/profile]

For each export: onnxruntime's profiler (one thread) over a one-token full step, a one-token
draft step and a verify over 4 exit states + 1 draft (``d = 4``), called in turn; per op type,
the sum over nodes of each node's median kernel time (medians: robust to a loaded machine).
Then the wall time of the same calls without the profiler, best of ``--calls`` blocks of one
model: full steps and verify calls back to back, and verify right after 4 draft calls (as in
decoding, where the upper layers' weights have gone cold meanwhile); last the rewritten export
as ``OnnxModel`` runs it, verify split into the draft stage and verify's upper part, and the
same with that upper part on two threads (``verify_threads=2``).
"""

import argparse
import collections
import json
import time
from pathlib import Path
from unittest import mock

import numpy as np
import onnxruntime as ort
import torch

from leapfx import rewrite
from leapfx.export import OnnxModel, onnx_export
from leapfx.lower.ort_stages import OrtStage
from leapfx.models import load_model

parser = argparse.ArgumentParser()
parser.add_argument("--exit-layer", type=int, default=6)
parser.add_argument("--calls", type=int, default=150)
parser.add_argument("--out", default="runs/profile")
args = parser.parse_args()
torch.set_num_threads(1)
model, _ = load_model()
sm = rewrite.apply(model, "layerskip", exit_layer=args.exit_layer, num_speculations=4)
out = Path(args.out)
exports = {
    "traced": sm.export_onnx(out / "traced", overwrite=True, optimize=False),
    "rewritten": sm.export_onnx(out / "rewritten", overwrite=True),
}
# no rotary tables -> no GroupQueryAttention rewrite (onnx_export._rotary_positions says why)
with mock.patch.object(onnx_export, "_rotary_positions", lambda sm: None):
    exports["no_gqa"] = sm.export_onnx(out / "no_gqa", overwrite=True)
exports = {name: exports[name] for name in ("traced", "no_gqa", "rewritten")}
P, H = 64, model.config.hidden_size
ONE = {"input_ids": torch.tensor([[5]]), "position_ids": torch.tensor([[P]])}
VERIFY = {
    "input_ids": torch.tensor([[5]]),
    "position_ids": torch.tensor([[P + 4]]),
    "exit_hidden": torch.randn(1, 4, H),
    "remainder_position_ids": torch.arange(P, P + 5)[None],
}
CALLS = {"full": ONE, "draft": ONE, "verify": VERIFY}


def caller(om: OnnxModel):
    cache = om._cache_for(P + 16)

    def call(name: str) -> float:
        cache.lengths = [P] * cache.num_layers
        start = time.perf_counter()
        om.stages[name](cache=cache, **CALLS[name])
        return time.perf_counter() - start

    return call


for label, path in exports.items():
    om = OnnxModel(path, threads=1, split_verify=False)  # (profiles the verify graph itself)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.enable_profiling = True
    for name in CALLS:
        options.profile_file_prefix = str(out / f"{label}_{name}")
        spec = om.manifest["stages"][name]
        session = ort.InferenceSession(str(path / spec["file"]), options)
        om.stages[name] = OrtStage(session, spec)
    call = caller(om)
    for _ in range(args.calls):
        for name in CALLS:
            call(name)
    print(f"{label}: per op type, sum of node medians (us)")
    sums = {}
    for name in CALLS:
        events = json.loads(Path(om.stages[name].session.end_profiling()).read_text())
        per_node, op = collections.defaultdict(list), {}
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                per_node[e["name"]].append(e["dur"])
                op[e["name"]] = e["args"]["op_name"]
        by_op = collections.Counter()
        for node, durations in per_node.items():
            by_op[op[node]] += float(np.median(durations[10:]))
        sums[name] = by_op
        top = ", ".join(f"{o} {d:.0f}" for o, d in by_op.most_common(6))
        print(f"  {name:6s} {sum(by_op.values()):7.0f}  ({top})")
    print(f"  verify / full {sum(sums['verify'].values()) / sum(sums['full'].values()):.2f}")

# the exported verify graph in each; then the rewritten export as OnnxModel runs it by default,
# verify split into the draft stage and verify's upper part (leapfx.lower.ort_stages.SplitVerify)
models = {
    label: caller(OnnxModel(path, threads=1, split_verify=False)) for label, path in exports.items()
}
models["rewritten, split verify"] = caller(OnnxModel(exports["rewritten"], threads=1))
# and with verify's upper part on two spinning threads (OnnxModel verify_threads; a second core)
models["rewritten, split verify, upper on 2 threads"] = caller(
    OnnxModel(exports["rewritten"], threads=1, verify_threads=2)
)
times = collections.defaultdict(list)
for _ in range(args.calls):
    for label, call in models.items():  # per model a block: its weights as warm as decoding
        for name in ("full", "full", "full", "verify", "verify", "verify", "draft"):
            times[label, name].append(call(name))
        for _ in range(3):
            call("draft")
        times[label, "verify after drafts"].append(call("verify"))
for label in models:
    full = min(times[label, "full"])
    cells = [
        f"{name} {1e3 * min(times[label, name]):.3f} ms ({min(times[label, name]) / full:.2f})"
        for name in ("full", "draft", "verify", "verify after drafts")
    ]
    print(f"{label}: best of {args.calls}+: " + ", ".join(cells))
