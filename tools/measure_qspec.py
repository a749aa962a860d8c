"""Measure what a quantized self-draft (the ``qspec`` recipe) can give on SmolLM2's float32
weights, before any tuning (docs/recipes.md, "qspec"):

    flock /tmp/leapfx-bench.lock python tools/measure_qspec.py [--tokens 64] [--prompts 3]

For each draft format: the cost of one decode step of the quantized copy against one float32
step (leapfx autoregressive, the kernels on: what a draft step runs), the verify's cost over
1 + d tokens (one full float32 call), and the per-draft acceptance estimated teacher-forced
(the quantized copy's argmax over the float model's greedy continuation of HumanEval and chat
prompts), then the formula's expected speedup over d: ``(1 - a^(d+1)) / (1 - a)`` tokens per
round over a round of ``d * c + v(d)`` steps. Times are the minimum over rounds (a shared
machine's noise only adds).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

FORMATS = ("Q8_0", "Q4_0", "Q4_1")


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def stage_costs(models: dict, ids: torch.Tensor, rounds: int, verify_rows: range) -> dict:
    """Per format: the minimum over ``rounds`` of one ``draft`` call (one token) and of one
    ``full`` call over r tokens (r in ``verify_rows``; r = 1 is the float decode step) after
    ``ids`` is cached, in ms; the formats' calls interleaved round by round, so that a shared
    machine's load falls on all of them alike."""
    from leapfx.runtime.runner import StageRunner

    runners, best = {}, {}
    n = ids.shape[1]
    with torch.inference_mode():
        for fmt, sm in models.items():
            stages = sm._executors or sm.stages.modules
            runners[fmt] = StageRunner(stages, sm._cache_for(n + 16), sm._layout)
            runners[fmt].full(ids, 0)
        for _ in range(rounds):
            for fmt, runner in runners.items():
                calls = {"draft": lambda r=runner: r.chunk("draft", ids[:, -1:], n)}
                for rows in verify_rows:
                    calls[rows] = lambda r=runner, x=ids[:, -rows:]: r.full(x, n)
                for key, call in calls.items():
                    seconds = _once(call)
                    runner.cache.crop(n)
                    slot = best.setdefault(fmt, {})
                    slot[key] = min(slot.get(key, float("inf")), seconds * 1e3)
    return best


def decoded_acceptance(sm, prompts, tokens: int) -> float:
    """Per-draft acceptance of ``sm`` (qspec, fixed-length rounds) over greedy decodes."""
    drafted = accepted = 0
    for ids in prompts:
        sm.generate(ids, max_new_tokens=tokens)
        drafted += sm.last_metrics.drafted_tokens
        accepted += sm.last_metrics.accepted_drafts
    return accepted / drafted


def agreement(qspec, base, prompts, tokens: int) -> float:
    """Share of positions where the draft stage's argmax equals the float model's greedy
    token, over each prompt's greedy continuation (teacher-forced: the draft reads the float
    model's tokens and its own keys)."""
    from leapfx.runtime.runner import StageRunner

    agree = total = 0
    for ids in prompts:
        out = base.generate(ids, max_new_tokens=tokens)
        n, length = ids.shape[1], out.shape[1] - 1
        with torch.inference_mode():
            runner = StageRunner(qspec.stages.modules, qspec._cache_for(length), qspec._layout)
            logits = runner.rows("draft", 0, length, input_ids=out[:, :-1])["logits"]
        guess = logits[0, n - 1 :].argmax(-1)
        agree += int((guess == out[0, n:]).sum())
        total += out.shape[1] - n
    return agree / total


def expected_speedup(a: float, c: float, v: dict[int, float], d: int) -> float:
    tokens = d + 1 if a >= 1 else (1 - a ** (d + 1)) / (1 - a)
    return tokens / (d * c + v[d + 1])


def main() -> None:
    from leapfx import rewrite
    from leapfx.bench.prompt_sets import load_prompt_set
    from leapfx.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=3, help="of each set (humaneval, chat)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", weights="float32", progress=False)
    prompts = [
        p for s in ("humaneval", "chat") for p in load_prompt_set(s, tok, count=args.prompts)
    ]
    base = rewrite.apply(model, "autoregressive")
    models, built = {}, {}
    for fmt in args.formats.split(","):
        start = time.perf_counter()
        models[fmt] = rewrite.apply(
            model, "qspec", draft_weights=fmt.lower(), adaptive=False, num_speculations=4
        )
        built[fmt] = time.perf_counter() - start
    costs = stage_costs(models, prompts[0], args.rounds, range(1, 10))
    step = min(c[1] for c in costs.values())  # the float step: every model's full stage
    v = {r: min(c[r] for c in costs.values()) / step for r in range(1, 10)}
    print(f"float32 step {step:.2f} ms ({1e3 / step:.1f} tok/s); verify of r tokens over one "
          "step: " + ", ".join(f"{r}: {x:.2f}" for r, x in v.items()), flush=True)  # fmt: skip
    report = {"float32_step_ms": step, "verify_over_step": v, "formats": {}}
    for fmt, sm in models.items():
        size = sm.stages["draft"].meta["leapfx.qdraft_size"]
        a_tf = agreement(sm, base, prompts, args.tokens)
        a = decoded_acceptance(sm, prompts, args.tokens)
        c = costs[fmt]["draft"] / step
        best = max(range(1, 9), key=lambda d: expected_speedup(a, c, v, d))
        ceiling = expected_speedup(a, c, v, best)
        curve = ", ".join(f"{expected_speedup(a, c, v, d):.2f}" for d in range(1, 9))
        print(f"{fmt}: {size['linears']} linears, {size['bytes'] / 1e6:.1f} MB as blocks "
              f"({size['float32_bytes'] / 1e6:.1f} MB float32), built in {built[fmt]:.1f} s; "
              f"draft step {costs[fmt]['draft']:.2f} ms, c = {c:.3f}; acceptance {a:.3f} "
              f"(teacher-forced {a_tf:.3f}); formula {ceiling:.2f}x at d = {best} "
              f"(d = 1..8: {curve})", flush=True)  # fmt: skip
        report["formats"][fmt] = dict(
            size, draft_ms=costs[fmt]["draft"], c=c, acceptance=a, teacher_forced=a_tf,
            best_d=best, ceiling=ceiling, built_s=built[fmt],
        )  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
