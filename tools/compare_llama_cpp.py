"""A quick interleaved comparison: llama.cpp against leapfx autoregressive on SmolLM2 native
and float32 weights (2 HumanEval prompts, 48 tokens, 3 passes; docs/quantized.md)."""

import time

import torch

from leapfx import rewrite
from leapfx.bench import llamacpp
from leapfx.bench.prompt_sets import load_prompt_set
from leapfx.models import load_model, resolve

torch.set_num_threads(2)
N = 48
m, tok = load_model("smollm2")
mf, _ = load_model("smollm2", weights="float32")
prompts = load_prompt_set("humaneval", tok, count=2)
nat = rewrite.apply(m, "autoregressive")
flt = rewrite.apply(mf, "autoregressive")
runs = dict(
    llamacpp.llama_cpp_runs(
        str(resolve("smollm2").path), threads=2, max_new_tokens=N, eos=llamacpp.eos_ids(m)
    )[i][:2]
    for i in range(2)
)
systems = {
    "llama_cpp": runs["llama_cpp"],
    "leapfx_autoregressive native": lambda p: nat.generate(p, max_new_tokens=N),
    "leapfx_autoregressive float32": lambda p: flt.generate(p, max_new_tokens=N),
}
times = {k: [] for k in systems}
outs = {}
for _ in range(3):
    for name, f in systems.items():
        t = time.perf_counter()
        new = 0
        for p in prompts:
            o = f(p)
            new += o.shape[1] - p.shape[1]
            outs.setdefault(name, []).append(o)
        times[name].append(new / (time.perf_counter() - t))
for k, v in times.items():
    print(f"{k}: {sorted(v)[1]:.1f} tok/s (median of 3 passes: {', '.join(f'{x:.1f}' for x in v)})")
same = all(
    torch.equal(a, b)
    for a, b in zip(
        outs["leapfx_autoregressive native"][:2],
        outs["leapfx_autoregressive float32"][:2],
        strict=True,
    )
)
print("native tokens == float32 tokens:", same)
