"""``leapfx train-reuse-probe``: fit the expert cache's learned eviction order for an MoE model.

Fits ``leapfx.offload.ReuseProbe`` on teacher-forced windows of the reference corpus's
training split, then replays it on held-out windows (the tokens in order, one cache across the
windows, as decoding prompt after prompt keeps its slots) beside LRU and Belady's optimal
eviction, at each slot fraction, and writes the probe with those hit rates in its metadata.

    leapfx train-reuse-probe --model moe-reference      # the shipped model's probe, in place
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..models.routing import cache_hit_rates, scored_hit_rate
from ..offload.reuse import ReuseProbe, experts_inputs, fit_reuse_probe
from ..options import check_int
from .data import encode_documents
from .evaluate import eval_windows
from .reference import reference_corpus

PROBE_NAME = "reuse_probe.safetensors"  # its name beside a model (the bench looks for it)


def model_probe(model_path) -> str | None:
    """The probe beside the model ``model_path`` names (``leapfx.models.resolve_model``), if it
    has one."""
    from ..models import resolve_model

    found = resolve_model(model_path) / PROBE_NAME
    return str(found) if found.is_file() else None


@torch.no_grad()
def evaluate_reuse_probe(
    probe: ReuseProbe, model, windows: torch.Tensor, slots: tuple[float, ...] = (0.5, 0.25)
) -> dict:
    """Per slot fraction: the demand hit rate of on-demand caching of the routing of
    ``windows`` [N, S] (in order) under LRU, the probe's eviction, and the optimal eviction,
    averaged over the MoE layers; and the probe's share of the gap from LRU to the optimal."""
    data = experts_inputs(model, [w.reshape(1, -1) for w in windows])
    out = {}
    for fraction in slots:
        n = max(1, math.ceil(fraction * probe.experts))
        sums = [0.0, 0.0, 0.0]
        for layer, (x, top) in data.items():
            weight, bias = probe.for_layer(layer)
            lru, optimal = cache_hit_rates(top, n)
            scores = torch.nn.functional.linear(x, weight.float(), bias.float())
            sums[0] += lru
            sums[1] += scored_hit_rate(top, n, scores)
            sums[2] += optimal
        lru, learned, optimal = (s / len(data) for s in sums)
        gap = optimal - lru
        out[str(fraction)] = {
            "slots": n, "lru_hit_rate": round(lru, 4), "reuse_hit_rate": round(learned, 4),
            "optimal_hit_rate": round(optimal, 4),
            "gap_closed": round((learned - lru) / gap, 3) if gap > 0 else None,
        }  # fmt: skip
    return out


def train_reuse_probe(
    out: str | Path,
    *,
    model_path=None,
    horizon: int = 4,
    tokens: int = 32768,
    held_out_tokens: int = 4096,
    window: int = 256,
    steps: int = 300,
    corpus_root=None,
    progress: bool = True,
) -> dict:
    """Fit, evaluate and write a probe to ``out`` (a file); returns its report."""
    from ..models import load_model

    for name, value, low in (("tokens", tokens, window), ("held_out_tokens", held_out_tokens,
                             window), ("window", window, horizon + 1)):  # fmt: skip
        check_int(name, value, low)
    start = time.perf_counter()
    model, tokenizer = load_model(model_path)
    corpus = reference_corpus(corpus_root)
    train = eval_windows(encode_documents(tokenizer, corpus.train), window, tokens)
    held = eval_windows(encode_documents(tokenizer, corpus.held_out), window, held_out_tokens)
    probe = fit_reuse_probe(model, train, horizon=horizon, steps=steps, progress=progress)
    probe.info["held_out"] = evaluate_reuse_probe(probe, model, held)
    probe.info["held_out_tokens"] = int(held.numel())
    probe.info["model"] = str(model_path or "reference")
    probe.info["seconds"] = round(time.perf_counter() - start, 1)
    probe.info["torch"] = torch.__version__
    path = probe.save(out)
    return {"path": str(path), "horizon": probe.horizon, "layers": probe.layers, **probe.info}
