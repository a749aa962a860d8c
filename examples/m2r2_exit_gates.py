"""M2R2's ARLA exit on the reference model: the gate op and the deciding gates, side by side.

    python examples/m2r2_exit_gates.py [--threads 2] [--passes 5] [--taus 0.6,0.7,0.8]
    python examples/m2r2_exit_gates.py --drafting   # m2r2's drafts: torch stage against the op

Every system decodes each of 3 bench prompts (64 new bytes) before the next prompt, ``--passes``
times after a warm-up, so that a shared machine's load hits all alike; speed is the best (and
the median) pass over ``leapfx_autoregressive``'s, agreement teacher-forced with greedy. The
systems: fixed early exit at E 10, 12, 14, and ``m2r2_exit`` (the shipped exit parts, CPU
kernels on) at each tau with

- ``torch gate, gates 4,8,12``: every gate decides, each gate stage as torch ops (as before
  ``leapfx_cpu::m2r2_gate``: each ``KernelGate`` swapped for its torch ``fallback``);
- ``op, gates 4,8,12``: the same exits, each gate one ``leapfx_cpu::m2r2_gate`` call;
- ``op, gate 4``: only gate 4 decides (``exit_gates=(4,)``, the shipped parts' choice).

``--drafting``: ``leapfx_kangaroo`` and the lossless ``m2r2`` (the shipped parts) with its
draft stage as torch ops (each ``KernelDraft`` swapped for its ``fallback``) and as one
``leapfx_cpu::m2r2_draft`` call; every output is checked identical to autoregressive.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leapfx import rewrite
from leapfx.bench import REFERENCE_ADAPTER, REFERENCE_M2R2, REFERENCE_M2R2_EXIT, bench_prompts
from leapfx.bench.agreement import teacher_forced_agreement
from leapfx.models import load_model
from leapfx.modules.m2r2_kernels import KernelGate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--taus", default="0.6,0.7,0.8")
    parser.add_argument("--drafting", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(None)
    prompts = bench_prompts(tok, count=3, num_tokens=64)
    with torch.inference_mode():
        greedy = [model.generate(p, attention_mask=torch.ones_like(p), do_sample=False,
                                 max_new_tokens=64) for p in prompts]  # fmt: skip

    def exit_(tau: float, gates: tuple[int, ...], op: bool):
        sm = rewrite.apply(model, "m2r2_exit", parts=str(REFERENCE_M2R2_EXIT), threshold=tau,
                           exit_gates=gates).use_cpu_kernels()  # fmt: skip
        if not op:
            sm._executors = _torch_path(sm._executors)
        return sm

    systems = {"leapfx_autoregressive": rewrite.apply(model, "autoregressive").use_cpu_kernels()}
    if args.drafting:
        kangaroo = rewrite.apply(model, "kangaroo", adapter=str(REFERENCE_ADAPTER))
        systems["leapfx_kangaroo"] = kangaroo.use_cpu_kernels()
        for op in (False, True):
            sm = rewrite.apply(model, "m2r2", parts=str(REFERENCE_M2R2)).use_cpu_kernels()
            if not op:
                sm._executors = _torch_path(sm._executors)
            systems[f"leapfx_m2r2, {'op' if op else 'torch'} draft"] = sm
        _timed(systems, prompts, args.passes, greedy=None)
        return
    for e in (10, 12, 14):
        systems[f"early_exit E {e}"] = rewrite.apply(model, "early_exit", exit_layer=e)
        systems[f"early_exit E {e}"].use_cpu_kernels()
    for tau in (float(x) for x in args.taus.split(",")):
        systems[f"m2r2_exit tau {tau:g}, torch gate, gates 4,8,12"] = exit_(tau, (4, 8, 12), False)
        systems[f"m2r2_exit tau {tau:g}, op, gates 4,8,12"] = exit_(tau, (4, 8, 12), True)
        systems[f"m2r2_exit tau {tau:g}, op, gate 4"] = exit_(tau, (4,), True)
    _timed(systems, prompts, args.passes, greedy)


def _torch_path(executors: dict) -> dict:
    """The stages with each one-call op (KernelGate, KernelDraft) back on its torch stage."""
    return {k: v.fallback if isinstance(v, KernelGate) else v for k, v in executors.items()}


def _timed(systems: dict, prompts, passes: int, greedy) -> None:
    """Interleaved passes; one table row per system (agreement where ``greedy`` is given, else
    identity with autoregressive)."""
    outputs = {}
    for name, sm in systems.items():
        sm.generate(prompts[0], max_new_tokens=8)  # warm-up
        outputs[name] = [sm.generate(p, max_new_tokens=64) for p in prompts]
    seconds = {k: [0.0] * passes for k in systems}
    for r in range(passes):
        for p in prompts:
            for name, sm in systems.items():
                start = time.perf_counter()
                sm.generate(p, max_new_tokens=64)
                seconds[name][r] += time.perf_counter() - start
    ar = seconds["leapfx_autoregressive"]
    last = "agreement | layers / token" if greedy is not None else "identical to autoregressive"
    print(f"| system | vs autoregressive (best / median pass) | {last} |")
    print("|---|---|---|" + ("---|" if greedy is not None else ""))
    for name, sm in systems.items():
        if name == "leapfx_autoregressive":
            continue
        best = min(ar) / min(seconds[name])
        median = statistics.median(ar) / statistics.median(seconds[name])
        if greedy is None:
            pairs = zip(outputs[name], outputs["leapfx_autoregressive"], strict=True)
            same = all(torch.equal(a, b) for a, b in pairs)
            print(f"| {name} | {best:.2f}x / {median:.2f}x | {same} |")
            continue
        a = teacher_forced_agreement(sm, prompts, greedy)
        print(f"| {name} | {best:.2f}x / {median:.2f}x | {a.agreement:.1%} | "
              f"{a.avg_layers:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
