"""EAGLE draft-head training (Li et al. 2024, sec. 4): only the head trains.

The head (``leapfx.modules.eagle``) reads (h_{t-1}, x_t) and outputs g_t; its logits are
the host's LM head on the host's final norm of g_t. EAGLE trains it with two losses at every
position t, against one no-grad forward of the host per batch (the teacher features)::

    L_reg = SmoothL1(g_t / s, h_t / s)                      (feature regression)
    L_cls = sum_n -p_n(x_{t+1}) log q_n(x_{t+1})            (the head's distribution q against
                                                             the host's p, same position)
    loss  = w_reg * L_reg + w_cls * L_cls                   (EAGLE: w_reg = 1, w_cls = 0.1)

``h`` is the pre-norm residual stream after the last layer (the state the head reads and
predicts, see the pass's docstring); EAGLE regresses the post-norm feature, whose scale is
about 1. ``s`` (the batch's RMS of h, detached) brings the pre-norm regression to that scale, so
EAGLE's weights and SmoothL1's threshold of 1 mean what they mean there. EAGLE also adds
uniform noise to the input features (U(-0.1, 0.1) on unit-scale features) so the head learns
to read its own imperfect g while chaining: here ``noise * s * U(-0.5, 0.5)``.

The host runs without autograd and its LM head is called with detached weights; only the head's
parameters (fc, one decoder layer) get gradients. AdamW at a constant rate, gradient clipping, a
tqdm bar when ``progress`` (the CLI turns it on only when stderr is a terminal). ``eval_data``
reports the head's held-out top-1 agreement with the host (teacher-forced: the share of
positions where argmax q = argmax p), the number a greedy chain's acceptance follows.

Data is what ``leapfx.train.kangaroo.token_stream`` takes (token ids, or texts with
``tokenizer=``), drawn as ``batch_size`` random windows of ``seq_len`` tokens per step.

Example::

    >>> sm = rewrite.apply(hf_model, "eagle")
    >>> result = sm.fit(token_ids, steps=300, eval_data=held_out_ids)
    >>> result.agreement_before, result.agreement_after
    >>> sm.save_parts("eagle-parts/")      # rewrite.apply(hf_model, "eagle", parts=...) loads it
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from leapfx.options import check_bool, check_int, check_number
from leapfx.parts.eagle import write_eagle_head
from leapfx.passes.capture import decoder_pieces
from leapfx.passes.draft_vocab import install_ranking, token_ranking
from leapfx.passes.eagle_head import eagle_head_of, previous_hidden
from leapfx.train.features import TeacherFeatures, tokens_digest
from leapfx.train.fit_checkpoint import start_fit, train_module
from leapfx.train.fit_options import optimizer_step, parts_fit
from leapfx.train.kangaroo import (
    FitResult,
    kangaroo_loss,
    parts_record,
    sample_windows,
    token_stream,
    window_inputs,
)


@dataclass(frozen=True)
class EagleFitConfig:
    """Options of ``fit``. EAGLE trains for epochs over ShareGPT; here steps are explicit."""

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128  # window length; shorter data trains on whole documents
    lr: float = 1e-3  # one layer from a host copy: a high rate converges in minutes
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # max global grad norm (EAGLE clips values at 0.5); 0: none
    reg_weight: float = 1.0  # w_reg (EAGLE's v_w)
    cls_weight: float = 0.1  # w_cls (EAGLE's p_w)
    noise: float = 0.2  # width of the uniform input noise, in units of the features' RMS
    seed: int = 0  # window sampling and noise
    max_minutes: float = 0.0  # > 0: stop after this much wall time even if steps remain
    checkpoint_every: int = 0  # with fit's checkpoint_dir: steps between checkpoints (0: at end)
    eval_seq_len: int = 256  # held-out windows for the agreement report
    progress: bool = True  # tqdm bar

    def __post_init__(self) -> None:
        ints = (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("seed", 0), ("eval_seq_len", 2),
                ("checkpoint_every", 0))  # fmt: skip
        for name, low in ints:
            value = getattr(self, name)
            check_int(name, value, low)
        positive = {"lr"}
        names = ("lr", "weight_decay", "grad_clip", "reg_weight", "cls_weight", "noise")
        for name in (*names, "max_minutes"):
            value = getattr(self, name)
            check_number(name, value, 0, low_open=name in positive)
        if self.reg_weight == 0 and self.cls_weight == 0:
            raise ValueError("reg_weight, cls_weight: both 0; allowed: at least one > 0")
        check_bool("progress", self.progress)


@dataclass
class EagleFitResult(FitResult):
    """What ``fit`` did: Kangaroo's record (``losses``: w_reg * L_reg + w_cls * L_cls; held-out
    agreement with the host when ``eval_data`` was given) and the loss's two terms."""

    reg_losses: list[float] = field(default_factory=list)
    cls_losses: list[float] = field(default_factory=list)


@torch.no_grad()
def teacher_features(sm, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One no-grad host forward: (h [B, S, D], pre-norm last-layer states; logits [B, S, V])."""
    model = sm.hf_model
    norm = decoder_pieces(model).norm
    seen: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        hook.remove()
    assert len(seen) == 1, "the final norm runs once per forward"
    return seen[0], logits


def head_outputs(
    sm, input_ids: torch.Tensor, hidden: torch.Tensor, noise: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over whole windows, teacher-forced: (g [B, S, D], logits [B, S, V]).

    Position t reads h_{t-1} (+ ``noise`` [B, S, D] if given) and x_t; gradients reach the
    head's parameters only.
    """
    head = eagle_head_of(sm.graph_module)
    parts = decoder_pieces(sm.hf_model)
    with torch.no_grad():
        prev = previous_hidden(hidden)  # [B, S, D]
        if noise is not None:
            prev = prev + noise
        embeds = parts.embed(input_ids)  # [B, S, D]
    position_ids, rope, masks = window_inputs(sm.hf_model, parts, embeds, [head.attn_kind])
    g = head(prev, embeds, rope, masks[head.attn_kind], position_ids)
    frozen_norm = {k: v.detach() for k, v in parts.norm.named_parameters()}
    frozen_head = {k: v.detach() for k, v in parts.head.named_parameters()}
    normed = functional_call(parts.norm, frozen_norm, (g,))
    return g, functional_call(parts.head, frozen_head, (normed,))


def eagle_losses(
    g: torch.Tensor, logits: torch.Tensor, h: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_reg, L_cls) of the module docstring, in float32; all inputs [B, S, *]."""
    scale = h.float().pow(2).mean().sqrt().clamp(min=1e-6).detach()
    reg = F.smooth_l1_loss(g.float() / scale, h.float() / scale)
    return reg, kangaroo_loss(logits, target_logits)


@torch.no_grad()
def evaluate_agreement(sm, data: Any, *, tokenizer=None, seq_len: int = 256) -> float:
    """Held-out top-1 agreement of the head with the host over consecutive windows of
    ``data`` (teacher-forced: the head reads the host's true h)."""
    stream = token_stream(data, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    device = next(sm.hf_model.parameters()).device
    agree, count = 0, 0
    for start in range(0, stream.numel() - 1, seq_len):
        window = stream[start : start + seq_len][None].to(device)
        h, target = teacher_features(sm, window)
        _, logits = head_outputs(sm, window, h)
        agree += int((logits.argmax(-1) == target.argmax(-1)).sum())
        count += window.numel()
    return agree / count


@parts_fit(EagleFitConfig)
def fit(sm, data: Any, config: EagleFitConfig, tokenizer, eval_data, checkpoint_dir):
    """Train the EAGLE head of ``sm`` on ``data``; returns an EagleFitResult.

    ``options`` are the fields of :class:`EagleFitConfig`. Only the head's parameters change;
    the stages share them, so ``sm.generate`` drafts with the trained head at once. With
    ``eval_data`` (same forms as ``data``) the result holds the held-out top-1 agreement
    before and after training. ``data`` may also be ``TeacherFeatures`` (``train.features``:
    windows and the host's h on them, collected once), which spares the host's forward.
    ``checkpoint_dir``: resumable (``train.fit_checkpoint``): a run finds its checkpoint
    there and continues; every ``checkpoint_every`` steps and at the end it writes one.
    """
    cached = data if isinstance(data, TeacherFeatures) else None
    num_layers = sm.config.num_hidden_layers
    source = cached.tokens if cached is not None else data
    stream = token_stream(source, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    head = eagle_head_of(sm.graph_module)
    params = list(head.parameters())
    device = next(sm.hf_model.parameters()).device
    if params[0].device != device:
        raise ValueError(
            f"fit: the EAGLE head is on {params[0].device} but the model on {device}; move the "
            "model to the device before rewrite.apply (the head is built where the model is)"
        )
    # The training data's token ranking: the vocabulary subset of draft_vocab, saved with the
    # parts (any N can be chosen when they are applied).
    install_ranking(sm.graph_module, token_ranking(stream, sm.config.vocab_size),
                    decoder_pieces(sm.hf_model).head)  # fmt: skip
    result = EagleFitResult(steps=config.steps)
    identity = {"recipe": "eagle", "data": tokens_digest(stream)}
    optimizer, generator, checkpoint, first = start_fit(
        head, config, result, checkpoint_dir, identity
    )
    if eval_data is not None and first == 0:
        result.agreement_before = evaluate_agreement(
            sm, eval_data, tokenizer=tokenizer, seq_len=config.eval_seq_len
        )

    def step() -> None:
        if cached is None:
            batch = sample_windows(stream, config.batch_size, config.seq_len, generator)
            batch = batch.to(device, non_blocking=True)
            h, target = teacher_features(sm, batch)
        else:
            batch, (h,) = cached.batch(config.batch_size, generator, (num_layers,))
            batch = batch.to(device)
            h = h.to(device=device, dtype=params[0].dtype)
            target = host_logits(sm, h)
        noise = None
        if config.noise > 0:
            scale = h.float().pow(2).mean().sqrt()
            u = torch.rand(h.shape, generator=generator).to(device=device, dtype=h.dtype)
            noise = (u - 0.5) * (config.noise * scale).to(h.dtype)
        g, logits = head_outputs(sm, batch, h, noise)
        reg, cls = eagle_losses(g, logits, h, target)
        loss = config.reg_weight * reg + config.cls_weight * cls
        optimizer_step(optimizer, loss, params, config.grad_clip)
        result.losses.append(float(loss.detach()))
        result.reg_losses.append(float(reg.detach()))
        result.cls_losses.append(float(cls.detach()))
        result.tokens += batch.numel()

    train_module(head, optimizer, result, step, first=first, config=config, desc="eagle head",
                 checkpoint=checkpoint)  # fmt: skip
    if eval_data is not None:
        result.agreement_after = evaluate_agreement(
            sm, eval_data, tokenizer=tokenizer, seq_len=config.eval_seq_len
        )
    return result


@torch.no_grad()
def host_logits(sm, hidden: torch.Tensor) -> torch.Tensor:
    """The host's logits from its pre-norm last-layer states h [B, S, D]: head(norm(h)), the
    last step of its forward (what ``teacher_features`` returns beside h)."""
    parts = decoder_pieces(sm.hf_model)
    return parts.head(parts.norm(hidden))


def save_parts(sm, path: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
    """Write the head of ``sm`` and its recipe options (see parts.eagle)."""
    record = parts_record(sm, "parts")
    return write_eagle_head(eagle_head_of(sm.graph_module), path, **record, extra=extra)
