"""SpecEE predictor training (sec. 7.4.4; spec specee.md sec. 3 and 5): inside ``sm.fit``.

1. **Data.** Prompts are windows of the training text; the full model continues each greedily
   (the leapfx autoregressive schedule, token-identical to HF greedy), and one no-grad forward
   over prompt + continuation gives every layer's hidden state at the continuation's positions:
   the features of the model's own greedy decoding.
2. **Features and labels** per predicted layer l = E-1..L-2, exactly as at inference: S = the
   drafter's top-k, z_l = N(h_l) W[S]^T, p_l = softmax(z_l), D_l = p_l - p_{l-1} (D = p at
   E-1); label 1 iff argmax N(h_l) W^T equals the full model's token (not requiring it in S).
3. **Training**: one MLP per layer, BCE on the sigmoid, Adam (lr 1e-3, batch 1024), 80/20 split
   by prompt; per-layer held-out accuracy / precision / recall at the threshold.
4. **Offline schedule** (sec. 5.2): on the held-out positions, every predictor on, the exit rule
   of sec. 4.3.3 (fires and argmax in S) gives each position's exit layer; the most frequent exit
   layers covering ``offline_coverage`` of the exits form the offline subset (spec sec. 9.3).

The host model and the drafter never change; only the MLPs train. Runs where the model is.

Example::

    >>> sm = rewrite.apply(hf_model, "specee")
    >>> result = sm.fit(token_ids, prompts=64, new_tokens=256)
    >>> result.layers[10]          # held-out accuracy, precision, recall, positives
    >>> sm.save_parts("specee-parts/")
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..files import write_atomic
from ..modules.specee import NUM_SPECULATIVE_TOKENS
from ..options import check_bool, check_int, check_number
from ..parts.io import host_signature
from ..parts.specee import write_parts
from ..passes.capture import capture, decoder_pieces
from ..passes.partition import Stages, full_stage
from ..passes.predictor import predictors_of
from ..recipes.specee import specee_schedule
from ..runtime import schedules
from ..runtime.model import SpeculativeModel
from ..runtime.recipe_info import RecipeInfo
from .fit_options import fit_config, on_plain_stages
from .kangaroo import adapter_and_target_logits, sample_windows, token_stream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpecEEFitConfig:
    """Options of ``fit``. The paper: ~16K samples per predictor, 100 epochs, batch 1024."""

    prompts: int = 64  # greedy continuations to collect features from
    prompt_len: int = 64
    new_tokens: int = 256  # per prompt: prompts * new_tokens samples per layer
    epochs: int = 100
    batch_size: int = 1024
    lr: float = 1e-3
    held_out: float = 0.2  # share of the prompts held out for the per-layer report
    # The exit threshold of the report and of the offline measurement, saved with the parts.
    # None: 0.5 (the paper's), or with target_agreement the grid threshold of fewest layers
    # whose held-out simulated agreement reaches it.
    threshold: float | None = None
    target_agreement: float | None = None
    # A safetensors file for the collected features: loaded if it exists, else written, so a
    # second fit with other training options skips the greedy decoding.
    features_path: str | None = None
    # drafter="eagle": steps of EAGLE head training before the features are collected (0:
    # keep the head as it is, e.g. loaded with eagle=...).
    draft_steps: int = 200
    offline_coverage: float = 0.8  # the offline subset covers this share of measured exits
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        ints = (("prompts", 2), ("prompt_len", 1), ("new_tokens", 1), ("epochs", 1),
                ("batch_size", 1), ("seed", 0), ("draft_steps", 0))  # fmt: skip
        for name, low in ints:
            value = getattr(self, name)
            check_int(name, value, low)
        for name, low, high in (("lr", 0.0, math.inf), ("held_out", 0.0, 1.0)):
            value = getattr(self, name)
            check_number(name, value, low, high, low_open=True, high_open=True, finite=False,
                         allowed=f"in ({low}, {high})")  # fmt: skip
        for name in ("threshold", "offline_coverage", "target_agreement"):
            value = getattr(self, name)
            if value is None and name != "offline_coverage":
                continue
            check_number(name, value, 0, 1, allowed="a number in [0, 1]")
        check_bool("progress", self.progress)


@dataclass
class LayerReport:
    """Held-out quality of one layer's predictor at the threshold."""

    accuracy: float
    precision: float
    recall: float
    positives: float  # share of held-out positions labelled 1 (layer l already agrees)


@dataclass
class SpecEEFitResult:
    """What ``fit`` did: samples, per-layer held-out report, exits and the offline subset."""

    samples: int  # training positions per layer
    held_out_samples: int
    layers: dict[int, LayerReport] = field(default_factory=dict)
    exit_counts: dict[int, int] = field(default_factory=dict)  # held-out, every predictor on
    offline_layers: tuple[int, ...] = ()
    threshold: float = 0.5
    simulated_agreement: float = 0.0  # held-out: the exit layer's argmax == the full model's
    simulated_avg_layers: float = 0.0
    # (threshold, simulated agreement, simulated avg layers), every predictor on
    curve: list[tuple[float, float, float]] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layers"] = {str(k): dataclasses.asdict(v) for k, v in self.layers.items()}
        out["exit_counts"] = {str(k): v for k, v in self.exit_counts.items()}
        return out


@torch.no_grad()
def greedy_continuations(sm, prompts: list[torch.Tensor], new_tokens: int, progress: bool):
    """The full model's greedy continuation of each prompt [1, n] (leapfx autoregressive)."""
    full = _autoregressive(sm.hf_model)
    bar = tqdm(prompts, desc="specee: greedy decoding", disable=not progress)
    return [full.generate(p, max_new_tokens=new_tokens, eos_token_id=[]) for p in bar]


def _autoregressive(model) -> SpeculativeModel:
    """``model`` decoding autoregressively through its captured ``full`` stage (eager): the
    model ``rewrite.apply(model, "autoregressive")`` builds, made here without the floor above
    (train sits beneath rewrite)."""
    gm = capture(model)
    info = RecipeInfo("autoregressive", None, schedules.autoregressive, lookahead=1)
    return SpeculativeModel(model, gm, Stages({"full": full_stage(gm)}), info)


@torch.no_grad()
def layer_features(sm, seq: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    """Features and labels of ``seq`` [1, T] at positions start..T-2 (each predicting t+1).

    Returns ``x`` [L-E, N, 12] (layers E-1..L-2), ``y`` [L-E, N] (labels) and ``hit``
    [L-E, N] (the layer's argmax is in S: the global check passes).
    """
    model = sm.hf_model
    parts = decoder_pieces(model)
    e = sm.options.exit_layer
    out = model(input_ids=seq, output_hidden_states=True, use_cache=False)
    final = out.logits[0, start:-1].argmax(-1)  # [N]: the full model's tokens
    if sm.options.drafter == "kangaroo":
        draft_logits = adapter_and_target_logits(sm, seq)[0][0, start:-1]
    elif sm.options.drafter == "eagle":  # position t reads h_{t-1} (teacher-forced, as decoding)
        from .eagle import head_outputs, teacher_features

        h, _ = teacher_features(sm, seq)
        draft_logits = head_outputs(sm, seq, h)[1][0, start:-1]
    else:
        draft_logits = parts.head(parts.norm(out.hidden_states[e][0, start:-1]))
    cands = draft_logits.topk(NUM_SPECULATIVE_TOKENS, dim=-1).indices  # [N, k]
    w = parts.head.weight
    w_s = w[cands].float()  # [N, k, H]: the gathered rows (subset_logits row by row)
    xs, ys, hits = [], [], []
    p_prev = None
    for layer in range(e - 1, model.config.num_hidden_layers - 1):
        normed = parts.norm(out.hidden_states[layer + 1][0, start:-1]).float()  # [N, H]
        z = torch.einsum("nh,nkh->nk", normed, w_s)  # [N, k]
        p = torch.softmax(z, dim=-1)
        d = p if p_prev is None else p - p_prev
        xs.append(torch.cat([z, p, d], dim=-1))
        g = parts.head(normed.to(w.dtype)).argmax(-1)  # [N]
        ys.append((g == final).float())
        hits.append((cands == g[:, None]).any(-1))
        p_prev = p
    return {"x": torch.stack(xs), "y": torch.stack(ys), "hit": torch.stack(hits)}


def _train_layer(mlp, x, y, config: SpecEEFitConfig, generator: torch.Generator) -> None:
    opt = torch.optim.Adam(mlp.parameters(), lr=config.lr)
    n = x.shape[0]
    mlp.train()
    for _ in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        for i in range(0, n, config.batch_size):
            idx = order[i : i + config.batch_size].to(x.device)
            loss = F.binary_cross_entropy(mlp(x[idx])[:, 0], y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    mlp.eval()


def _report(prob: torch.Tensor, y: torch.Tensor, threshold: float) -> LayerReport:
    pred = prob > threshold
    pos = y > 0.5
    tp = int((pred & pos).sum())
    return LayerReport(
        accuracy=float((pred == pos).float().mean()),
        precision=tp / max(1, int(pred.sum())),
        recall=tp / max(1, int(pos.sum())),
        positives=float(pos.float().mean()),
    )


def offline_subset(exit_counts: dict[int, int], coverage: float) -> tuple[int, ...]:
    """The most frequent exit layers that together hold ``coverage`` of the exits.

    >>> offline_subset({3: 50, 7: 30, 9: 15, 12: 5}, 0.8)
    (3, 7)
    """
    total = sum(exit_counts.values())
    chosen, covered = [], 0
    for layer, count in sorted(exit_counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if total == 0 or covered >= coverage * total or count == 0:
            break
        chosen.append(layer)
        covered += count
    return tuple(sorted(chosen))


THRESHOLD_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.96, 0.97, 0.98, 0.99, 0.995)


def simulate(probs, labels, hits, threshold: float, e: int, num_layers: int):
    """Held-out exits with every predictor on: (agreement, avg layers, exits per layer).

    ``probs``, ``labels``, ``hits``: [L-E, N] for layers E-1..L-2. A position exits at the first
    layer whose predictor fires and whose argmax is in S (sec. 4.3.3); it agrees when that
    layer's argmax is the full model's token (or it never exits).
    """
    exits = (probs > threshold) & hits
    any_exit = exits.any(0)
    idx = exits.float().argmax(0)  # [N]: the first exit (0 where none: masked below)
    layers = range(e - 1, num_layers - 1)
    counts = {layer: int(((idx == j) & any_exit).sum()) for j, layer in enumerate(layers)}
    agree = torch.where(any_exit, labels[idx, torch.arange(idx.numel())] > 0.5, True)
    depth = torch.where(any_exit, idx + e, num_layers)  # layers run
    return float(agree.float().mean()), float(depth.float().mean()), counts


def _collect(sm, data, tokenizer, config: SpecEEFitConfig) -> dict[str, torch.Tensor]:
    """Training and held-out features (x, y; hx, hy, hhit), from ``features_path`` if it
    exists (written there otherwise)."""
    from safetensors.torch import load_file, save_file

    path = Path(config.features_path) if config.features_path else None
    if path is not None and path.is_file():
        return load_file(str(path))
    stream = token_stream(data, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    generator = torch.Generator().manual_seed(config.seed)
    device = next(sm.hf_model.parameters()).device
    windows = sample_windows(stream, config.prompts, config.prompt_len, generator)
    prompts = [w[None].to(device) for w in windows]
    seqs = greedy_continuations(sm, prompts, config.new_tokens, config.progress)
    feats = []
    bar = tqdm(seqs, desc="specee: features", disable=not config.progress)
    for seq, prompt in zip(bar, prompts, strict=True):
        feats.append(layer_features(sm, seq, prompt.shape[1] - 1))
    n_held = max(1, round(config.held_out * len(feats)))
    train, held = feats[n_held:], feats[:n_held]

    def cat(items, key):
        return torch.cat([f[key] for f in items], dim=1).contiguous()

    out = {"x": cat(train, "x"), "y": cat(train, "y"), "hx": cat(held, "x"),
           "hy": cat(held, "y"), "hhit": cat(held, "hit")}  # fmt: skip
    if path is not None:
        write_atomic(path, lambda tmp: save_file({k: v.cpu() for k, v in out.items()}, str(tmp)))
    return out


@on_plain_stages
def fit(sm, data: Any, *, tokenizer=None, **options: Any) -> SpecEEFitResult:
    """Train the exit predictors of ``sm`` (a specee SpeculativeModel) on ``data``.

    ``data``: token ids or texts with ``tokenizer=`` (as Kangaroo's fit); ``options`` are the
    fields of :class:`SpecEEFitConfig`. Sets the predictors, the offline subset and the
    recipe's options (``offline_layers``) in place.
    """
    config = fit_config(SpecEEFitConfig, options)
    begin = time.perf_counter()
    if sm.options.drafter == "eagle" and config.draft_steps > 0:
        from .eagle import fit as fit_eagle  # the draft head first: S comes from it

        fit_eagle(sm, data, tokenizer=tokenizer, steps=config.draft_steps,
                  progress=config.progress, seed=config.seed)  # fmt: skip
    held_x = _collect(sm, data, tokenizer, config)
    generator = torch.Generator().manual_seed(config.seed + 1)
    x, y, hx, hy, hhit = (held_x[k] for k in ("x", "y", "hx", "hy", "hhit"))
    bank = predictors_of(sm.graph_module)
    e, num_layers = sm.options.exit_layer, sm.config.num_hidden_layers
    result = SpecEEFitResult(samples=x.shape[1], held_out_samples=hx.shape[1])
    probs = []
    bar = tqdm(range(e - 1, num_layers - 1), desc="specee: predictors", disable=not config.progress)
    for j, layer in enumerate(bar):
        mlp = bank.exits[layer].mlp
        dtype = mlp[0].weight.dtype
        with torch.enable_grad():
            _train_layer(mlp, x[j].to(dtype), y[j].to(dtype), config, generator)
        with torch.no_grad():
            prob = mlp(hx[j].to(dtype))[:, 0].float()
        probs.append(prob)
        result.layers[layer] = _report(prob, hy[j], config.threshold or 0.5)
    # Exits on the held-out positions with every predictor on (the offline measurement).
    probs = torch.stack(probs)  # [L-E, N]
    for t in THRESHOLD_GRID:
        agreement, avg, _ = simulate(probs, hy, hhit, t, e, num_layers)
        result.curve.append((t, agreement, avg))
    threshold = 0.5 if config.threshold is None else config.threshold
    if config.target_agreement is not None and config.threshold is None:
        good = [(avg, t) for t, a, avg in result.curve if a >= config.target_agreement]
        threshold = min(good)[1] if good else THRESHOLD_GRID[-1]
    agreement, avg, counts = simulate(probs, hy, hhit, threshold, e, num_layers)
    result.threshold = threshold
    result.exit_counts = counts
    result.simulated_agreement, result.simulated_avg_layers = agreement, avg
    result.offline_layers = offline_subset(counts, config.offline_coverage)
    bank.offline.zero_()
    bank.offline[list(result.offline_layers)] = True
    _set_options(sm, offline_layers=result.offline_layers, threshold=threshold)
    result.seconds = time.perf_counter() - begin
    sm._specee_report = result.as_dict()
    log.info("specee predictors: %s", result.as_dict())
    return result


def _set_options(sm, **changes) -> None:
    """New options for ``sm`` (the schedule reads the offline subset from them)."""
    options = dataclasses.replace(sm.options, **changes)
    sm.recipe = dataclasses.replace(sm.recipe, options=options, schedule=specee_schedule(options))


def save_parts(sm, path: str | Path) -> Path:
    """Write the predictors (and a Kangaroo drafter's adapter) with the options they need."""
    o = sm.options
    options = {"drafter": o.drafter, "exit_layer": o.exit_layer, "threshold": o.threshold,
               "offline_layers": list(o.offline_layers)}  # fmt: skip
    report = getattr(sm, "_specee_report", None)
    gm = sm.graph_module
    return write_parts(
        predictors_of(gm), path, options=options, host=host_signature(sm.config), report=report,
        eagle_head=getattr(gm, "eagle_head", None), adapter=getattr(gm, "kangaroo_adapter", None),
    )  # fmt: skip  # with the drafter's trained part: the Kangaroo adapter or the EAGLE head
