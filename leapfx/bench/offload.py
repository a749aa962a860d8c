"""Expert-offload measurements: resident vs offloaded decoding of one MoE model, one table.

Rows (greedy, the same prompts; ``identical``: every output equals the resident one):

- ``leapfx_resident``: the autoregressive recipe, all experts in memory;
- ``leapfx_offload_none``: the same with ``OffloadOptions(prefetch="none")`` (on demand only);
- ``leapfx_offload_next_gate``: with ``prefetch="next_gate"``;
- ``leapfx_offload_layerskip``: LayerSkip self-speculation over the offloaded model
  (``prefetch="none"``).

Without a trained MoE model, ``random_moe`` builds an OLMoE-shaped model with random weights
(routing of a random model is about as unpredictable as it gets, so next-gate precision here is
a floor, not a claim).

    python -m leapfx.bench.offload --layers 8 --experts 32 --top-k 4 --slots 0.5 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import torch

from ..rewrite import apply
from ..runtime.offload import OffloadOptions


def random_moe(
    *,
    layers: int = 8,
    hidden: int = 256,
    experts: int = 32,
    top_k: int = 4,
    intermediate: int = 512,
    vocab: int = 512,
    seed: int = 0,
):
    """An OLMoE-shaped causal LM with random weights (eval, float32, CPU)."""
    import transformers

    config = transformers.OlmoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
        num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.2)  # routers start at zero in OLMoE's init
    return model.eval()


@dataclass
class OffloadRow:
    system: str
    tokens_per_s: float
    identical: bool
    hit_rate: float | None = None
    prefetch_hit_rate: float | None = None
    stall_ms_per_token: float | None = None
    bytes_per_token: float | None = None
    wasted_bytes_per_token: float | None = None
    prefetch_precision: float | None = None
    prefetch_recall: float | None = None


def offload_rows(
    model, prompts: list[torch.Tensor], *, max_new_tokens: int, slots: float | int,
    policy: str = "lru", exit_layer: int | None = None, path=None, plot_dir=None,
) -> list[OffloadRow]:  # fmt: skip
    """Time every row on ``prompts`` (after one warm-up prompt per system).

    ``plot_dir``: also trace the last prompt of every offloaded row (not timed) and draw its
    timeline into ``plot_dir/<system>.png``.
    """
    exit_layer = exit_layer or max(1, model.config.num_hidden_layers // 4)
    systems = {
        "leapfx_resident": ("autoregressive", None, {}),
        "leapfx_offload_none": ("autoregressive", "none", {}),
        "leapfx_offload_next_gate": ("autoregressive", "next_gate", {}),
        "leapfx_offload_layerskip": ("layerskip", "none", {"exit_layer": exit_layer}),
    }
    reference = None
    rows = []
    for name, (recipe, prefetch, opts) in systems.items():
        offload = None
        if prefetch is not None:
            offload = OffloadOptions(slots=slots, policy=policy, prefetch=prefetch, path=path)
        sm = apply(model, recipe, offload=offload, **opts)
        sm.generate(prompts[0], max_new_tokens=4)  # warm-up (allocations, first reads)
        outputs, reports, seconds, tokens = [], [], 0.0, 0
        for prompt in prompts:
            start = time.perf_counter()
            out = sm.generate(prompt, max_new_tokens=max_new_tokens)
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - prompt.shape[1]
            outputs.append(out)
            reports.append(sm.last_offload_report)
        if reference is None:
            reference = outputs
        row = OffloadRow(
            name, tokens / seconds,
            identical=all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True)),
        )  # fmt: skip
        if sm.offload is not None and plot_dir is not None:
            sm.offload.trace = []
            sm.generate(prompts[-1], max_new_tokens=max_new_tokens)
            plot_offload(sm.offload.trace, sm.last_offload_report.hit_rate_per_layer,
                         os.path.join(plot_dir, f"{name}.png"), title=name)  # fmt: skip
            sm.offload.trace = None
        if sm.offload is not None:
            n = len(reports)
            for field in ("hit_rate", "prefetch_hit_rate", "stall_ms_per_token",
                          "bytes_per_token", "wasted_bytes_per_token"):  # fmt: skip
                setattr(row, field, sum(getattr(r, field) for r in reports) / n)
            for field in ("prefetch_precision", "prefetch_recall"):
                values = [getattr(r, field) for r in reports if getattr(r, field) is not None]
                setattr(row, field, sum(values) / len(values) if values else None)
            sm.offload.close()
        rows.append(row)
    return rows


def plot_offload(trace: list, hit_rate_per_layer: dict[int, float], path, *, title: str = ""):
    """The overlap timeline (compute, stall and transfer lanes; cf. M2R2's Fig. 11) and the hit
    rate per layer of one traced ``generate`` call, as one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = {"compute": 3, "stall": 2, "demand": 1, "prefetch": 0}
    colors = {"compute": "tab:blue", "stall": "tab:red", "demand": "tab:orange",
              "prefetch": "tab:green"}  # fmt: skip
    t0 = min(span[3] for span in trace) if trace else 0.0
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 3.2), gridspec_kw={"width_ratios": [4, 1]})
    for lane, y in lanes.items():
        spans = [(1e3 * (a - t0), 1e3 * (b - a)) for kind, _, _, a, b in trace if kind == lane]
        ax.broken_barh(spans, (y - 0.4, 0.8), color=colors[lane])
    ax.set_yticks(list(lanes.values()), [f"{k}" for k in lanes])
    ax.set_xlabel("ms")
    ax.set_title(title or "expert offload: experts calls vs transfers")
    layers = sorted(hit_rate_per_layer)
    bx.bar([str(i) for i in layers], [hit_rate_per_layer[i] for i in layers], color="tab:blue")
    bx.set_ylim(0, 1)
    bx.set_xlabel("MoE layer")
    bx.set_title("hit rate")
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)  # written whole or not at all
    return path


def markdown(rows: list[OffloadRow]) -> str:
    head = ("| system | tokens/s | identical | hit rate | prefetch hits | stall ms/token "
            "| MiB/token | wasted MiB/token | precision | recall |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]

    def f(v, scale=1.0, digits=2):
        return "-" if v is None else f"{v / scale:.{digits}f}"

    for r in rows:
        lines.append(
            f"| {r.system} | {r.tokens_per_s:.2f} | {r.identical} | {f(r.hit_rate)} | "
            f"{f(r.prefetch_hit_rate)} | {f(r.stall_ms_per_token, digits=1)} | "
            f"{f(r.bytes_per_token, 2**20)} | {f(r.wasted_bytes_per_token, 2**20)} | "
            f"{f(r.prefetch_precision)} | {f(r.prefetch_recall)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--slots", type=float, default=0.5)
    p.add_argument("--policy", default="lru")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--path", default=None, help="the disk tier's file (default: a temp file)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--plot", default=None, help="folder for each offloaded row's timeline PNG")
    p.add_argument("--model", default=None, help="a local MoE checkpoint (default: random)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.model is not None:
        from transformers import AutoModelForCausalLM

        from ..train.data import byte_tokenizer, held_out_prompts
        from ..train.reference import reference_corpus

        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        found = held_out_prompts(byte_tokenizer(), reference_corpus(), num_tokens=32,
                                 count=a.prompts)  # fmt: skip
        prompts = [torch.tensor([p.input_ids]) for p in found]
    else:
        model = random_moe(layers=a.layers, hidden=a.hidden, experts=a.experts, top_k=a.top_k,
                           intermediate=a.intermediate)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 512, (1, 16), generator=g) for _ in range(a.prompts)]
    if a.plot:
        os.makedirs(a.plot, exist_ok=True)
    slots = int(a.slots) if a.slots >= 1 else a.slots
    rows = offload_rows(model, prompts, max_new_tokens=a.tokens, slots=slots, policy=a.policy,
                        path=a.path, plot_dir=a.plot)  # fmt: skip
    print(markdown(rows))  # noqa: T201 - a command's output
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
