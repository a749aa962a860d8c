"""ReuseProbe: a learned eviction order for the expert cache (``OffloadOptions(policy="reuse")``).

Which expert to evict decides how many loads a token costs; a prefetcher only moves them
earlier. On the MoE reference model at half the slots, LRU caching hits 0.67 of the demand and
Belady's optimal eviction (knowing the whole future) 0.83 (``leapfx.bench.routing``). Online
policies that only count the past (LFU, LRU-2, decayed counts) stay within a few points of LRU.
What the layer sees now says more: per MoE layer, a linear probe from the experts' input at
token t (the post-attention-norm hidden state, [H]) to the probability that expert e is used by
one of the next ``horizon`` tokens, fitted by logistic regression on teacher-forced text. The
runtime evicts the resident expert the probe scores lowest (ties: the least recently used).

A probe's cost in decoding is one [E, H] x [H] product per MoE layer and step. Its file is
one safetensors file: ``weight`` [L, E, H] and ``bias`` [L, E] (the standardisation of the
inputs folded in), with the layers, horizon, and how it was fitted in its metadata.

    >>> probe = fit_reuse_probe(moe_model, windows, horizon=4)
    >>> probe.save("reuse_probe.safetensors")
    >>> OffloadOptions(slots=0.5, policy="reuse", reuse_probe="reuse_probe.safetensors")
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..files import write_atomic
from ..models.routing import moe_layers
from ..options import check_int
from ..passes.capture import decoder_pieces

FORMAT = "leapfx-reuse-probe-1"


@dataclass
class ReuseProbe:
    """Per MoE layer ``layers[j]``: ``scores = weight[j] @ x + bias[j]`` for the experts' input
    ``x`` [H] of one token; higher: more likely used by the next ``horizon`` tokens."""

    layers: list[int]
    weight: torch.Tensor  # [L, E, H]
    bias: torch.Tensor  # [L, E]
    horizon: int
    info: dict = field(default_factory=dict)  # how it was fitted (saved as JSON metadata)

    def __post_init__(self) -> None:
        n = len(self.layers)
        if (
            self.weight.dim() != 3
            or self.weight.shape[0] != n
            or self.bias.shape != (n, self.weight.shape[1])
        ):
            raise ValueError(
                f"ReuseProbe: weight {tuple(self.weight.shape)} and bias "
                f"{tuple(self.bias.shape)} do not match {n} layers; allowed: weight [L, E, H], "
                "bias [L, E]"
            )

    @property
    def experts(self) -> int:
        return self.weight.shape[1]

    @property
    def hidden(self) -> int:
        return self.weight.shape[2]

    def for_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.layers.index(layer)
        return self.weight[j], self.bias[j]

    def check(self, layers: list[int], experts: int, hidden: int) -> None:
        """Raise a ValueError naming what differs where the model is not the probe's."""
        missing = sorted(set(layers) - set(self.layers))
        if missing or experts != self.experts or hidden != self.hidden:
            raise ValueError(
                f"reuse_probe: fitted for MoE layers {self.layers} with {self.experts} experts "
                f"and hidden size {self.hidden}; this model has layers {layers}, {experts} "
                f"experts, hidden size {hidden}; allowed: a probe fitted on this model "
                "(leapfx train-reuse-probe)"
            )

    def save(self, path: str | os.PathLike) -> Path:
        """Write the probe to ``path`` (a temporary name first, then renamed)."""
        meta = {"format": FORMAT, "layers": json.dumps(self.layers),
                "horizon": str(self.horizon), "info": json.dumps(self.info)}  # fmt: skip
        tensors = {"weight": self.weight.contiguous(), "bias": self.bias.contiguous()}
        return write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> ReuseProbe:
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"reuse_probe: {str(path)!r} is not a file; allowed: a file written by "
                "leapfx train-reuse-probe (ReuseProbe.save)"
            )
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(
                    f"reuse_probe: {str(path)!r} is not a reuse probe (format "
                    f"{meta.get('format')!r}); allowed: a file of format {FORMAT!r}"
                )
            weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
        return cls(json.loads(meta["layers"]), weight, bias, int(meta["horizon"]),
                   json.loads(meta.get("info", "{}")))  # fmt: skip


def experts_inputs(
    model, batches: list[torch.Tensor]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer, what its experts module received over ``batches`` (teacher forced, each
    [1, S] token ids): (input [T, H] float32, top-k [T, k]), in token order."""

    layers = decoder_pieces(model).layers
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in moe_layers(model)}
    hooks = []
    for i in seen:

        def grab(module, args, i=i):
            hidden, top_k_index = args[0].detach(), args[1].detach()
            rows = hidden.reshape(-1, hidden.shape[-1])
            seen[i].append((rows.float(), top_k_index.reshape(rows.shape[0], -1)))

        hooks.append(layers[i].mlp.experts.register_forward_pre_hook(grab))
    try:
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {
        i: (torch.cat([x for x, _ in v]), torch.cat([t for _, t in v])) for i, v in seen.items()
    }


def reuse_targets(top: torch.Tensor, experts: int, horizon: int, window: int) -> torch.Tensor:
    """[T, E]: 1 where expert e is in the top-k of one of tokens t+1..t+horizon of the same
    window of ``window`` tokens (the last ``horizon`` tokens of a window see fewer)."""
    used = torch.zeros(len(top), experts).scatter_(1, top, 1.0).view(-1, window, experts)
    soon = torch.zeros_like(used)
    for d in range(1, horizon + 1):
        soon[:, :-d] = torch.maximum(soon[:, :-d], used[:, d:])
    return soon.view(-1, experts)


def fit_reuse_probe(
    model,
    windows: list[torch.Tensor] | torch.Tensor,
    *,
    horizon: int = 4,
    steps: int = 300,
    lr: float = 1e-2,
    progress: bool = False,
) -> ReuseProbe:
    """Fit a ``ReuseProbe`` on ``windows`` (each [S] token ids, all of one length S > horizon;
    or one [N, S] tensor):
    per MoE layer, logistic regression (full batch, Adam, ``steps`` steps) from the
    standardised experts' input to "used by one of the next ``horizon`` tokens". The last
    ``horizon`` tokens of each window, whose future lies past it, are left out."""
    check_int("horizon", horizon, 1)
    check_int("steps", steps, 1)
    if isinstance(windows, torch.Tensor):
        windows = list(windows.reshape(-1, windows.shape[-1]))
    if len(windows) == 0:
        raise ValueError("windows: none given; allowed: one or more [S] token-id tensors")
    window = windows[0].numel()
    if window <= horizon or any(w.numel() != window for w in windows):
        raise ValueError(
            f"windows: lengths {sorted({w.numel() for w in windows})} are invalid; allowed: "
            f"one length, above horizon={horizon}"
        )
    data = experts_inputs(model, [w.reshape(1, -1) for w in windows])
    keep = torch.ones(len(windows), window, dtype=torch.bool)
    keep[:, window - horizon :] = False
    keep = keep.flatten()
    layers = sorted(data)
    weights, biases, losses = [], [], {}
    bar = None
    if progress:
        bar = tqdm(total=len(layers), desc="reuse probe", unit="layer")
    for i in layers:
        x, top = data[i]
        experts = _experts_of(model, i)
        soon = reuse_targets(top, experts, horizon, window)[keep]
        x = x[keep]
        weight, bias, losses[str(i)] = fit_layer(x, soon, steps=steps, lr=lr)
        weights.append(weight)
        biases.append(bias)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    info = {"tokens": int(keep.sum()), "windows": len(windows), "window": window,
            "steps": steps, "lr": lr, "final_bce": losses}  # fmt: skip
    return ReuseProbe(layers, torch.stack(weights), torch.stack(biases), horizon, info)


def fit_layer(
    x: torch.Tensor, soon: torch.Tensor, *, steps: int = 300, lr: float = 1e-2
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Logistic regression of ``soon`` [N, E] (0/1) on ``x`` [N, H], standardised, full batch:
    (weight [E, H], bias [E], the final loss), the standardisation folded into them, so that
    ``x @ weight.T + bias`` are the logits."""
    experts = soon.shape[1]
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], experts, requires_grad=True)
    b = torch.zeros(experts, requires_grad=True)
    optimizer = torch.optim.Adam([w, b], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            loss = F.binary_cross_entropy_with_logits(z @ w + b, soon)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():  # scores = ((x - mean) / std) @ w + b = x @ (w / std) + b'
        folded = w / std[:, None]
        return folded.t().contiguous(), b - mean @ folded, round(loss.item(), 5)


def _experts_of(model, layer: int) -> int:
    return decoder_pieces(model).layers[layer].mlp.experts.gate_up_proj.shape[0]
