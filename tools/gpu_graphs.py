"""Manual CUDA graphs against Inductor's graph trees, on one GPU (tools/gpu_check.sh runs it).

For each ``cuda_graphs`` choice, ``leapfx_autoregressive`` on a random-weight Llama
(``--size``, bfloat16) is compiled, warmed, and timed over ``--tokens`` new tokens
(best of ``--repeats``); for the manual graphs, one replay of the one-token step graph is also
timed on the GPU alone (CUDA events), so the wall time a token takes beyond the GPU's is the
host's share. Prints one line per choice, and ``--json`` writes them.

    python tools/gpu_graphs.py --size 0.5b --modes manual,trees --json graphs.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch._dynamo.utils import counters

from leapfx import rewrite
from leapfx.bench.random_model import random_model
from leapfx.lower.inductor import CompiledStage


def _graph_set(sm):
    return next((e.graphs for e in sm._executors.values() if isinstance(e, CompiledStage)), None)


def _gpu_step_ms(graphs, replays: int = 200) -> float | None:
    """GPU time of one replay of the one-token step graph (the graph with one-token inputs)."""
    step = next((g for k, g in graphs.graphs.items() if all(s[0] == (1, 1) for s in k[1])), None)
    if step is None:
        return None
    for _ in range(10):
        step.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        step.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def measure(size: str, mode: str, tokens: int, repeats: int) -> dict:
    model, _ = random_model(size, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    sm = rewrite.apply(model, "autoregressive").compile(cuda_graphs=mode)
    compile_s = time.perf_counter() - t0
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), device="cuda")
    skips = counters["inductor"]["cudagraph_skips"]
    sm.generate(prompt, max_new_tokens=tokens)  # warm: the first call's shapes
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = sm.generate(prompt, max_new_tokens=tokens)
        best = min(best, time.perf_counter() - start)
    new = out.shape[1] - prompt.shape[1]
    row = {
        "mode": mode, "size": size, "tok_s": new / best, "ms_per_token": 1000 * best / new,
        "compile_s": compile_s,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
    }  # fmt: skip
    graphs = _graph_set(sm)
    if graphs is not None:
        row.update(captures=graphs.captures, replays=graphs.replays,
                   plain_calls=graphs.plain_calls, gpu_step_ms=_gpu_step_ms(graphs))  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--modes", default="manual,trees")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for mode in args.modes.split(","):
        try:
            row = measure(args.size, mode, args.tokens, args.repeats)
        except Exception as error:  # noqa: BLE001 - one failing mode must not hide the others
            row = {"mode": mode, "error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
