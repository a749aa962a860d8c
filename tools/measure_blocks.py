"""Measure what bounds decoding SmolLM2 from its GGUF blocks on this machine (docs/quantized.md).

    python tools/measure_blocks.py products     # bandwidth; float32 vs block products per shape
    python tools/measure_blocks.py step         # a decode step, native and float32 interleaved
    python tools/measure_blocks.py layer        # one native layer: one call vs its ~10 calls
    python tools/measure_blocks.py load         # load time (cold / cached / first) and memory
    python tools/measure_blocks.py attention    # leapfx_cpu::attention(_rows) against SDPA
    python tools/measure_blocks.py prefill      # a prompt's prefill, native and float32

Each part prints one table; times are the minimum over 7 rounds of the mean of a batch of calls
(a shared machine's noise only adds). ``load`` runs each load in a fresh process, the file's
pages evicted first for the cold one (``posix_fadvise(DONTNEED)``), after loading the tiny
reference model in that process (the imports and the kernels: resident memory that is no
model's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

# SmolLM2-135M's products per layer (q|k|v, o, gate and up, down) and the tied head
SHAPES = [
    ("q, k, v", [576, 192, 192], 576, "Q4_1"),
    ("o", [576], 576, "Q4_1"),
    ("gate, up", [1536, 1536], 576, "Q4_1"),
    ("down", [576], 1536, "Q4_1"),
    ("head", [49152], 576, "Q8_0"),
]
LAYERS = 30


def _time(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def bandwidth() -> float:
    """GB/s of a sum over 1 GB of float32 (this process's threads)."""
    a = torch.ones(1 << 28)
    a.sum()
    return 4 * a.numel() / _time(a.sum, 3) / 1e9


def products() -> dict:
    import gguf
    import numpy as np
    from gguf import quants

    from leapfx.kernels import cpu, cpu_blocks

    assert cpu.available() and cpu_blocks.available()
    rng = np.random.default_rng(0)
    ops = torch.ops.leapfx_cpu
    out = {"threads": torch.get_num_threads(), "bandwidth_gbs": bandwidth(), "shapes": []}
    print(f"threads {out['threads']}; memory bandwidth (1 GB sum): {out['bandwidth_gbs']:.1f} GB/s")
    print(f"{'product':<10} {'[N x K]':<14} {'fmt':<5} {'rows':>4} {'float32 us':>11} "
          f"{'blocks us':>10} {'ratio':>6}")  # fmt: skip
    for name, ns, k, fmt in SHAPES:
        qt = getattr(gguf.GGMLQuantizationType, fmt)
        parts = []
        for n in ns:
            raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qt)
            data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1))
            dense = torch.from_numpy(quants.dequantize(raw, qt).astype(np.float32))
            parts.append((cpu_blocks.Blocks(data, fmt, n, k), cpu.pack_weight(dense), n))
        for rows in (1, 4, 8):
            x = torch.randn(rows, k)
            calls = 10 if name == "head" else 200

            def floats(x=x, parts=parts):
                for _, wp, n in parts:
                    ops.small_mm(x, wp, n)

            def blocks(x=x, parts=parts):
                for b, _, _ in parts:
                    ops.block_mm(x, b.data, b.type_id, b.n, b.k)

            tf, tb = _time(floats, calls) * 1e6, _time(blocks, calls) * 1e6
            shape = f"[{sum(ns)} x {k}]"
            print(f"{name:<10} {shape:<14} {fmt:<5} {rows:>4} {tf:>11.1f} {tb:>10.1f} "
                  f"{tf / tb:>5.2f}x")  # fmt: skip
            out["shapes"].append({"product": name, "n": sum(ns), "k": k, "fmt": fmt,
                                  "rows": rows, "float32_us": tf, "blocks_us": tb})  # fmt: skip
    for kind in ("float32_us", "blocks_us"):
        per_token = sum(
            s[kind] * (1 if s["product"] == "head" else LAYERS)
            for s in out["shapes"] if s["rows"] == 1
        )  # fmt: skip
        out[f"products_per_token_{kind}"] = per_token
        print(f"one token's products ({kind[:-3]}): {per_token / 1e3:.2f} ms")
    return out


def step(tokens: int = 64, rounds: int = 3) -> list[dict]:
    """leapfx autoregressive on SmolLM2 (a HumanEval prompt), native blocks and float32 weights
    in one process, their rounds interleaved (a shared machine's noise falls on both): ms per
    token over ``tokens`` greedy tokens, the prefill and first token excluded (the difference
    of two lengths), each the best of ``rounds``."""
    from leapfx import rewrite
    from leapfx.bench.prompt_sets import load_prompt_set
    from leapfx.models import load_model

    runs = {}
    for weights in ("native", "float32"):
        model, tok = load_model("smollm2", weights=weights, progress=False)
        sm = rewrite.apply(model, "autoregressive")
        ids = load_prompt_set("humaneval", tok, count=1)[0]
        new = sm.generate(ids, max_new_tokens=1 + tokens).shape[1] - ids.shape[1] - 1
        runs[weights] = (sm, ids, new, [], [])
    for _ in range(rounds):
        for sm, ids, _, short, long in runs.values():
            short.append(_once(lambda sm=sm, ids=ids: sm.generate(ids, max_new_tokens=1)))
            long.append(_once(lambda sm=sm, ids=ids: sm.generate(ids, max_new_tokens=1 + tokens)))
    out = []
    for weights, (_, _, new, short, long) in runs.items():
        ms = (min(long) - min(short)) / new * 1e3
        print(f"weights {weights}: {ms:.2f} ms a token ({1e3 / ms:.1f} tok/s) over {new} tokens")
        out.append({"weights": weights, "ms_per_token": ms, "tokens": new})
    print(f"native / float32: {out[1]['ms_per_token'] / out[0]['ms_per_token']:.2f}x")
    return out


def layer(cached: int = 150) -> dict:
    """One SmolLM2 decoder layer's decode step over ``cached`` cached positions, native blocks:
    ``BlockDecoderLayer``'s one ``block_decoder_layer`` call against the per-op path of
    ``KernelDecoderLayer`` (the same module, its one-call arguments set aside), interleaved;
    microseconds, the best of 3 interleaved passes of 7 rounds. The two give the same numbers
    (checked)."""
    from leapfx import rewrite
    from leapfx.lower.cpu_kernels import kernel_stages
    from leapfx.models import load_model
    from leapfx.modules.block_layer import BlockDecoderLayer
    from leapfx.runtime.cache import cache_for

    model, _ = load_model("smollm2", progress=False)
    stage = next(iter(kernel_stages(rewrite.apply(model, "autoregressive")).values()))
    mod = next(m for m in stage.modules() if isinstance(m, BlockDecoderLayer))
    cache = cache_for(model, cached + 8)
    h = torch.randn(1, 1, model.config.hidden_size)
    pos = torch.tensor([[cached]])
    rope = model.model.rotary_emb(h, pos)
    whole = mod._whole

    def call(args) -> torch.Tensor:
        mod._whole = args
        cache.lengths[0] = cached
        return mod(h, None, rope, pos, cache)

    with torch.no_grad():
        assert torch.equal(call(whole), call(None))
        one = _time(lambda: call(whole), 200) * 1e6
        per_op = _time(lambda: call(None), 200) * 1e6
        for _ in range(2):  # interleaved: a shared machine's noise falls on both
            one = min(one, _time(lambda: call(whole), 200) * 1e6)
            per_op = min(per_op, _time(lambda: call(None), 200) * 1e6)
    mod._whole = whole
    print(f"one layer, {cached} cached positions: one call {one:.1f} us, per-op {per_op:.1f} us "
          f"({per_op / one:.2f}x; x {model.config.num_hidden_layers} layers: "
          f"{(per_op - one) * model.config.num_hidden_layers / 1e3:.2f} ms a token)")  # fmt: skip
    return {"cached": cached, "one_call_us": one, "per_op_us": per_op}


# (query rows, cached keys) of one sequence; (batch rows, query rows, keys) of a ragged batch
ATTENTION_ROWS = [(1, 150), (1, 700), (5, 400), (8, 700), (16, 1000), (32, 1000), (271, 271)]
ATTENTION_RAGGED = [(8, 3, 330), (4, 7, 1000), (8, 16, 600), (4, 200, 400)]


def attention() -> list[dict]:
    """SmolLM2's attention (9 query heads over 3 kv heads of 64): ``leapfx_cpu::attention``
    against SDPA with the causal mask (``enable_gqa``), and ``attention_rows`` over a batch's
    ragged rows against SDPA behind their mask; microseconds, interleaved, best of 7."""
    import torch.nn.functional as F

    from leapfx.kernels import cpu_attention

    assert cpu_attention.available()
    hq, hkv, d = 9, 3, 64
    out = []

    def row(name, kernel, sdpa):
        ks, ss = [], []
        for _ in range(2):  # interleaved: a shared machine's noise falls on both
            ks.append(_time(kernel, 50) * 1e6)
            ss.append(_time(sdpa, 50) * 1e6)
        k, s = min(ks), min(ss)
        print(f"{name}: kernel {k:.0f} us, SDPA {s:.0f} us ({s / k:.2f}x)")
        out.append({"shape": name, "kernel_us": k, "sdpa_us": s})

    for s, n in ATTENTION_ROWS:
        q = torch.randn(1, s, hq, d).transpose(1, 2)
        k, v = torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
        pos = torch.arange(n - s, n)
        mask = torch.ones(s, n, dtype=torch.bool).tril(n - s)
        row(f"{s} rows over {n} keys",
            lambda q=q, k=k, v=v, pos=pos: torch.ops.leapfx_cpu.attention(q, k, v, pos, d**-0.5),
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True))  # fmt: skip
    for b, s, n in ATTENTION_RAGGED:
        q = torch.randn(b, s, hq, d).transpose(1, 2)
        k, v = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
        first = torch.arange(b) * (n // (3 * b))
        last = torch.arange(n - s, n).expand(b, s).contiguous()
        cols = torch.arange(n)
        mask = ((cols >= first[:, None, None]) & (cols <= last[:, :, None]))[:, None]
        row(f"B = {b} ragged rows of {s} over {n} keys",
            lambda q=q, k=k, v=v, f=first, la=last: torch.ops.leapfx_cpu.attention_rows(
                q, k, v, f, la, d**-0.5),
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True))  # fmt: skip
    return out


def prefill(count: int = 4, rounds: int = 3) -> list[dict]:
    """The prefill (and first token) of ``count`` HumanEval prompts, leapfx autoregressive on
    native blocks and on float32 weights in one process, interleaved: ms each, best of
    ``rounds``."""
    from leapfx import rewrite
    from leapfx.bench.prompt_sets import load_prompt_set
    from leapfx.models import load_model

    runs = {}
    for weights in ("native", "float32"):
        model, tok = load_model("smollm2", weights=weights, progress=False)
        sm = rewrite.apply(model, "autoregressive")
        prompts = load_prompt_set("humaneval", tok, count=count)
        sm.generate(prompts[0], max_new_tokens=1)
        runs[weights] = (sm, prompts, [[] for _ in prompts])
    for _ in range(rounds):
        for sm, prompts, times in runs.values():
            for ids, t in zip(prompts, times, strict=True):
                t.append(_once(lambda sm=sm, ids=ids: sm.generate(ids, max_new_tokens=1)))
    out = []
    for weights, (_, prompts, times) in runs.items():
        ms = [min(t) * 1e3 for t in times]
        lengths = [ids.shape[1] for ids in prompts]
        print(f"weights {weights}: " + ", ".join(
            f"{n} tokens {m:.0f} ms" for n, m in zip(lengths, ms, strict=True)))  # fmt: skip
        out.append({"weights": weights, "prompt_tokens": lengths, "ms": ms})
    return out


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


LOAD = """
import json, sys, time
from leapfx.bench.memory import resident_bytes
import torch, transformers
from leapfx.models import load_model
from leapfx.kernels import cpu, cpu_blocks
# the code a load imports and the kernels, first (on the project's tiny reference model):
# what follows grows by the weights and what is per model only
cpu.available(); cpu_blocks.available()
load_model("reference", progress=False)
before = resident_bytes(); start = time.perf_counter()
model, tok = load_model("smollm2", weights=sys.argv[1], progress=False)
seconds = time.perf_counter() - start; loaded = resident_bytes()
with torch.no_grad():
    model(tok("Hello", return_tensors="pt").input_ids)
print(json.dumps({"seconds": seconds, "resident_after_load": loaded - before,
                  "resident_after_a_token": resident_bytes() - before}))
"""


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load() -> dict:
    from leapfx.models import resolve

    path = str(resolve("smollm2").path)
    size = os.path.getsize(path)
    out = {"file_bytes": size}
    print(f"SmolLM2 GGUF file: {size / 1e6:.1f} MB")
    runs = [("native", "cold", None), ("native", "cached", None), ("native", "first", "empty"),
            ("float32", "cached", None)]  # fmt: skip
    for weights, state, cache in runs:
        env = dict(os.environ)
        if cache == "empty":
            env["LEAPFX_CACHE"] = tempfile.mkdtemp()
        if state == "cold":
            _evict(path)
        res = subprocess.run([sys.executable, "-c", LOAD, weights], env=env, check=True,
                             capture_output=True, text=True)  # fmt: skip
        r = json.loads(res.stdout.strip().splitlines()[-1])
        out[f"{weights}_{state}"] = r
        print(f"{weights:<8} {state:<7} (page cache {'evicted' if state == 'cold' else 'warm'}"
              f"{', no leapfx cache' if cache else ''}): {r['seconds']:.2f} s; resident +"
              f"{r['resident_after_load'] / 1e6:.0f} MB after load, +"
              f"{r['resident_after_a_token'] / 1e6:.0f} MB after a token "
              f"({r['resident_after_a_token'] / size:.2f}x the file)")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part", choices=("products", "step", "layer", "load", "attention", "prefill")
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    parser.add_argument("--rounds", type=int, default=3, help="step: interleaved rounds, best of")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "products":
        out = products()
    elif args.part == "step":
        out = {"steps": step(rounds=args.rounds)}
    elif args.part == "layer":
        out = layer()
    elif args.part == "attention":
        out = {"attention": attention()}
    elif args.part == "prefill":
        out = {"prefill": prefill(rounds=args.rounds)}
    else:
        out = load()
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(out, f, indent=2)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
