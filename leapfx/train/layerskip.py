"""LayerSkip training: layer dropout and early-exit loss (Elhoushi et al. 2024, section 4.1).

The recipe works on any supported HF causal LM through ``decoder_pieces``: we run the decoder
layers ourselves so that a layer can be skipped for some samples of a batch, and we unembed the
output of every enabled layer through the model's own final norm and LM head (no extra heads).
Notation follows the paper: ``L`` layers ``l = 0 .. L-1``, ``x_{l+1}`` the output of layer ``l``,
iteration ``t = 0 .. T-1`` of ``T`` training steps.

Layer dropout (eq. 1-4). Per sample, layer ``l`` is skipped (``x_{l+1} = x_l``) with probability

    p_{l,t} = S(t) D(l) p_max,     D(l) = exp(l ln2 / (L-1)) - 1,
    S(t) = 1 ("none")   or   S_exp(t) = exp(t ln2 / (T-1)) - 1 ("exp", pretraining from scratch).

As in the paper the dropped samples are removed from the batch, the layer runs on the rest, and
the outputs are put back in place; the other samples of the batch are not affected.

Early-exit loss (eq. 5-6). ``J = sum_l e~(t,l) CE(g(x_{l+1}), Y)`` with

    e~(t,l) = C(t,l) e(l) / sum_i C(t,i) e(i),
    e(l) = e_scale * sum_{i=0..l} i               for 0 <= l < L-1,
    e(L-1) = L - 1 + e_scale * sum_{i=0..L-2} i.

``C(t,l)`` is the exit curriculum:

- ``"all"``: every layer at every step;
- ``"rotational"`` (C_rot,R): every R-th layer, rotating by one each step: ``C = 1`` iff
  ``(l - t) mod R == 0``, so each layer is enabled once every R steps and about ``ceil(L/R)``
  unembeddings run per step;
- ``"gradual"`` (C_grad): layers are enabled from ``L-1`` down to ``0``, one every ``T/(2L)``
  steps: ``C = 1`` iff ``t >= (L-1-l) T / (2L)``. The paper says "from L-1 to 0"; we read it as
  the last layer on from step 0 (its loss is the language-modelling loss itself), layer ``L-2``
  after ``T/(2L)`` steps, ..., layer 0 after ``(L-1)T/(2L)``.

Exit self-distillation (``exit_distill`` = beta > 0, not in the paper): each early exit's term
becomes ``(1 - beta) CE(g(x_{l+1}), Y) + beta KL(p_L || p_l)``, ``p_L`` the last layer's
distribution in the same forward, detached. The reference model's second phase uses it (see
reference.py).

With ``train_last_layer`` (default, as in the authors' reference code) the last layer's loss is
enabled at every step whatever the curriculum says; without it a rotational step can leave the
last layer untrained. Note that ``e(0) = 0``: the paper's scales never train the exit after the
first layer.

Example::

    >>> recipe = LayerSkipTrainConfig(p_max=0.1, e_scale=0.2, exit_curriculum="rotational")
    >>> out = layerskip_loss(model, batch, step=t, total_steps=T, config=recipe, generator=g)
    >>> out.loss.backward()
"""

# ruff: noqa: E741  -- ``l`` is the paper's layer index; the formulas read as in the paper.

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from leapfx.options import is_int
from leapfx.passes.capture import DecoderPieces, decoder_pieces
from leapfx.runtime.masks import masks_for

DROPOUT_CURRICULA = ("none", "exp")
EXIT_CURRICULA = ("all", "rotational", "gradual")


@dataclass(frozen=True)
class LayerSkipTrainConfig:
    """Options of the LayerSkip recipe. Defaults are the paper's pretraining-from-scratch ones.

    The paper (section 5) pretrains Llama 1.5B from scratch with ``p_max=0.1, e_scale=0.2,
    C_rot,R=23`` on 24 layers, i.e. ``R = L - 1``; ``rotation=None`` means exactly that.

    >>> LayerSkipTrainConfig(p_max=0.2, exit_curriculum="gradual")
    """

    # Maximum layer-dropout rate, reached by the last layer at the last step (paper: 0.1-0.2).
    p_max: float = 0.1
    # S(t): "exp" is eq. 4 (pretraining from scratch); "none" is S(t) = 1 (finetuning).
    dropout_curriculum: str = "exp"
    # Scale of the early layers' losses in e(l); the paper requires 0 <= e_scale <= 1.
    e_scale: float = 0.2
    # C(t, l): "all", "rotational" (C_rot,R) or "gradual" (C_grad).
    exit_curriculum: str = "rotational"
    # R of C_rot,R; None means L - 1 (the paper's choice for pretraining from scratch).
    rotation: int | None = None
    # Keep the last layer's loss on at every step, whatever C(t, L-1) says.
    train_last_layer: bool = True
    # Not in the paper, for a model deployed at one exit: the exit after ``focus_exit`` layers
    # takes ``focus_share`` of the early-exit loss whenever it is enabled; the other enabled
    # layers share the rest in eq. 6's proportions. Both None (the default): eq. 6 as is.
    focus_exit: int | None = None
    focus_share: float | None = None
    # Not in the paper: self-distillation of the early exits. Each early exit's term becomes
    # (1 - exit_distill) CE(g(x_{l+1}), Y) + exit_distill KL(p_last || p_l), p_last being the
    # last layer's distribution in the same forward, detached (a teacher, not trained by this
    # term). What self-speculation needs is agreement with the last layer, and the last layer's
    # full distribution says more about it than the one label. 0 (the default): eq. 5 as is.
    exit_distill: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_max <= 1.0:
            raise ValueError(f"p_max: got {self.p_max!r}; allowed range is 0 <= p_max <= 1")
        if self.dropout_curriculum not in DROPOUT_CURRICULA:
            raise ValueError(
                f"dropout_curriculum: got {self.dropout_curriculum!r}; "
                f"allowed values are {', '.join(DROPOUT_CURRICULA)}"
            )
        if not 0.0 <= self.e_scale <= 1.0:
            raise ValueError(f"e_scale: got {self.e_scale!r}; allowed range is 0 <= e_scale <= 1")
        if self.exit_curriculum not in EXIT_CURRICULA:
            raise ValueError(
                f"exit_curriculum: got {self.exit_curriculum!r}; "
                f"allowed values are {', '.join(EXIT_CURRICULA)}"
            )
        if self.rotation is not None and not is_int(self.rotation):
            raise ValueError(f"rotation: got {self.rotation!r}; expected an int >= 1 or None")
        if self.rotation is not None and self.rotation < 1:
            raise ValueError(f"rotation: got {self.rotation!r}; allowed range is rotation >= 1")
        if (self.focus_exit is None) != (self.focus_share is None):
            raise ValueError(
                f"focus_exit/focus_share: got {self.focus_exit!r}/{self.focus_share!r}; "
                "give both or neither"
            )
        if self.focus_exit is not None and not (is_int(self.focus_exit) and self.focus_exit >= 1):
            raise ValueError(f"focus_exit: got {self.focus_exit!r}; expected an int >= 1")
        if self.focus_share is not None and not 0.0 < self.focus_share < 1.0:
            raise ValueError(
                f"focus_share: got {self.focus_share!r}; allowed range is 0 < focus_share < 1"
            )

        if not 0.0 <= self.exit_distill <= 1.0:
            raise ValueError(
                f"exit_distill: got {self.exit_distill!r}; allowed range is 0 <= exit_distill <= 1"
            )

    def rotation_for(self, num_layers: int) -> int:
        """R for a model of ``num_layers`` layers (``L - 1`` when ``rotation`` is None)."""
        return self.rotation if self.rotation is not None else max(1, num_layers - 1)


def _check_lt(l: int | None, t: int, num_layers: int, total_steps: int) -> None:
    if num_layers < 2:
        raise ValueError(f"num_layers: got {num_layers}; LayerSkip needs num_layers >= 2")
    if total_steps < 1:
        raise ValueError(f"total_steps: got {total_steps}; allowed range is total_steps >= 1")
    if not 0 <= t < total_steps:
        raise ValueError(f"t: got {t}; allowed range is 0 <= t < total_steps={total_steps}")
    if l is not None and not 0 <= l < num_layers:
        raise ValueError(f"l: got {l}; allowed range is 0 <= l < num_layers={num_layers}")


def dropout_rate(
    l: int, t: int, *, num_layers: int, total_steps: int, p_max: float, curriculum: str = "exp"
) -> float:
    """``p_{l,t} = S(t) D(l) p_max`` (eq. 2-4).

    >>> dropout_rate(3, 99, num_layers=4, total_steps=100, p_max=0.2)   # last layer, last step
    0.2
    """
    _check_lt(l, t, num_layers, total_steps)
    if curriculum not in DROPOUT_CURRICULA:
        raise ValueError(
            f"curriculum: got {curriculum!r}; allowed values are {', '.join(DROPOUT_CURRICULA)}"
        )
    d = math.exp(l * math.log(2) / (num_layers - 1)) - 1
    if curriculum == "none":
        s = 1.0
    else:  # S_exp(0) = 0, which also covers T = 1 where the formula divides by zero
        s = 0.0 if t == 0 else math.exp(t * math.log(2) / (total_steps - 1)) - 1
    return s * d * p_max


def enabled_exit_layers(
    t: int,
    *,
    num_layers: int,
    total_steps: int,
    curriculum: str = "rotational",
    rotation: int | None = None,
    train_last_layer: bool = True,
) -> list[int]:
    """The layers ``l`` with ``C(t, l) = 1``, ascending.

    >>> enabled_exit_layers(1, num_layers=8, total_steps=100, curriculum="rotational", rotation=3)
    [1, 4, 7]
    """
    _check_lt(None, t, num_layers, total_steps)
    last = num_layers - 1
    if curriculum == "all":
        on = set(range(num_layers))
    elif curriculum == "rotational":
        r = rotation if rotation is not None else max(1, last)
        if r < 1:
            raise ValueError(f"rotation: got {r}; allowed range is rotation >= 1")
        on = {l for l in range(num_layers) if (l - t) % r == 0}
    elif curriculum == "gradual":
        # t >= (L-1-l) T / (2L), in integers.
        on = {l for l in range(num_layers) if 2 * num_layers * t >= (last - l) * total_steps}
    else:
        raise ValueError(
            f"curriculum: got {curriculum!r}; allowed values are {', '.join(EXIT_CURRICULA)}"
        )
    if train_last_layer:
        on.add(last)
    return sorted(on)


def unnormalized_exit_scale(l: int, *, num_layers: int, e_scale: float) -> float:
    """``e(l)`` of eq. 6 (before normalisation)."""
    last = num_layers - 1
    if l < last:
        return e_scale * l * (l + 1) / 2
    return last + e_scale * (last - 1) * last / 2


def exit_loss_scales(
    t: int,
    *,
    num_layers: int,
    total_steps: int,
    e_scale: float,
    curriculum: str = "rotational",
    rotation: int | None = None,
    train_last_layer: bool = True,
    focus_exit: int | None = None,
    focus_share: float | None = None,
) -> list[float]:
    """``e~(t, l)`` for ``l = 0 .. L-1`` (eq. 6); they sum to 1 (or are all 0 when no enabled
    layer has a nonzero ``e(l)``, which only happens with ``train_last_layer=False``).

    ``focus_exit`` E and ``focus_share`` s (not in the paper): when layer ``E - 1`` is enabled,
    its scale is s and the other layers' eq.-6 scales are renormalised to sum to 1 - s.

    >>> exit_loss_scales(0, num_layers=3, total_steps=10, e_scale=1.0, curriculum="all")
    [0.0, 0.25, 0.75]
    """
    if not 0.0 <= e_scale <= 1.0:
        raise ValueError(f"e_scale: got {e_scale!r}; allowed range is 0 <= e_scale <= 1")
    on = set(
        enabled_exit_layers(
            t,
            num_layers=num_layers,
            total_steps=total_steps,
            curriculum=curriculum,
            rotation=rotation,
            train_last_layer=train_last_layer,
        )
    )
    e = [
        unnormalized_exit_scale(l, num_layers=num_layers, e_scale=e_scale) if l in on else 0.0
        for l in range(num_layers)
    ]
    check_focus(focus_exit, focus_share, num_layers)
    focus = focus_exit - 1 if focus_exit is not None and focus_exit - 1 in on else None
    if focus is not None:
        e[focus] = 0.0
    total = sum(e)
    if focus is None:
        return [x / total for x in e] if total > 0 else [0.0] * num_layers
    if total == 0:  # the focused exit is the only enabled layer with a scale
        return [1.0 if l == focus else 0.0 for l in range(num_layers)]
    scales = [x / total * (1.0 - focus_share) for x in e]
    scales[focus] = focus_share
    return scales


def check_focus(focus_exit: int | None, focus_share: float | None, num_layers: int) -> None:
    """ValueError unless ``focus_exit`` is None or an early exit of an ``num_layers``-layer model
    with ``0 < focus_share < 1`` (see ``LayerSkipTrainConfig.focus_exit``)."""
    if focus_exit is None:
        return
    if focus_share is None or not 0.0 < focus_share < 1.0:
        raise ValueError(
            f"focus_share: got {focus_share!r} with focus_exit {focus_exit!r}; "
            "allowed range is 0 < focus_share < 1"
        )
    if not 1 <= focus_exit < num_layers:
        raise ValueError(
            f"focus_exit: got {focus_exit!r}; allowed range is 1 <= focus_exit < {num_layers} "
            "(an early exit of this model)"
        )


def dropout_rates(
    t: int, *, num_layers: int, total_steps: int, config: LayerSkipTrainConfig
) -> list[float]:
    """``p_{l,t}`` for every layer under ``config``."""
    return [
        dropout_rate(
            l,
            t,
            num_layers=num_layers,
            total_steps=total_steps,
            p_max=config.p_max,
            curriculum=config.dropout_curriculum,
        )
        for l in range(num_layers)
    ]


def scales_for(
    t: int, *, num_layers: int, total_steps: int, config: LayerSkipTrainConfig
) -> list[float]:
    """``e~(t, l)`` for every layer under ``config``."""
    return exit_loss_scales(
        t,
        num_layers=num_layers,
        total_steps=total_steps,
        e_scale=config.e_scale,
        curriculum=config.exit_curriculum,
        rotation=config.rotation_for(num_layers),
        train_last_layer=config.train_last_layer,
        focus_exit=config.focus_exit,
        focus_share=config.focus_share,
    )


def sample_keep_mask(
    rates: list[float], batch_size: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``M(p_{l,t})`` per layer and sample: ``keep[l, b]`` is False where layer l is dropped."""
    p = torch.tensor(rates, dtype=torch.float64)[:, None].expand(len(rates), batch_size)
    return torch.rand(p.shape, generator=generator, dtype=torch.float64) >= p  # keep: [L, B]


def run_decoder(
    model: nn.Module,
    input_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
    *,
    parts: DecoderPieces | None = None,
) -> list[torch.Tensor]:
    """Run the decoder with per-sample layer skipping; return ``[x_1, ..., x_L]``.

    ``keep[l, b]`` False skips layer ``l`` for sample ``b`` (``x_{l+1} = x_l`` for it); the
    layer runs on the kept samples only. ``keep=None`` runs every layer on every sample.

    >>> hs = run_decoder(model, input_ids)          # hs[-1] is the last layer's output
    >>> logits = exit_logits(model, hs[2])          # exit after 3 layers
    """
    parts = parts or decoder_pieces(model)
    batch, seq = input_ids.shape  # input_ids: [B, S]
    n = parts.num_layers
    if keep is not None and tuple(keep.shape) != (n, batch):
        raise ValueError(f"keep: expected shape ({n}, {batch}), got {tuple(keep.shape)}")
    hidden = parts.embed(input_ids)  # [B, S, D]
    position_ids = torch.arange(seq, device=input_ids.device)[None].expand(batch, seq)
    cos, sin = parts.rotary(hidden, position_ids)  # [B, S, Dh] each
    masks = masks_for(
        model.config._attn_implementation,
        parts.attn_kinds,
        0,
        seq,
        window=parts.sliding_window,
        dtype=hidden.dtype,
        device=hidden.device,
    )
    outputs = []
    for l, layer in enumerate(parts.layers):
        mask = masks[parts.attn_kinds[l]]
        if keep is None or bool(keep[l].all()):
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=(cos, sin),
                position_ids=position_ids,
            )
        elif bool(keep[l].any()):
            # kept samples: [B']; drawn on the host, copied without a stream sync
            idx = keep[l].nonzero().squeeze(1).to(hidden.device, non_blocking=True)
            ran = layer(
                hidden[idx],
                attention_mask=mask,
                position_embeddings=(cos[idx], sin[idx]),
                position_ids=position_ids[idx],
            )
            hidden = hidden.index_copy(0, idx, ran)  # out of place: autograd sees both paths
        outputs.append(hidden)
    return outputs


def exit_logits(
    model: nn.Module, hidden: torch.Tensor, *, parts: DecoderPieces | None = None
) -> torch.Tensor:
    """``g(x)``: the shared final norm and LM head applied to any layer's output."""
    parts = parts or decoder_pieces(model)
    return parts.head(parts.norm(hidden))  # [B, S, V]


def distill_kl(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_teacher || p_student)`` in nats, averaged over positions.

    ``teacher_logp`` [..., V] holds log-probabilities (no gradient flows into it);
    ``student_logits`` [..., V] raw logits.
    """
    student = F.log_softmax(student_logits.float(), -1)
    teacher = teacher_logp.detach()
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


@dataclass
class LayerSkipLoss:
    """What one LayerSkip forward returns."""

    loss: torch.Tensor  # J(X, Y, t), a scalar with grad
    layer_losses: dict[int, float]  # CE of each layer with e~(t, l) > 0 (detached)
    scales: list[float]  # e~(t, l), l = 0 .. L-1
    rates: list[float]  # p_{l,t}, l = 0 .. L-1
    keep: torch.Tensor = field(repr=False)  # [L, B] bool
    tokens: int = 0  # number of target tokens


def layerskip_loss(
    model: nn.Module,
    batch: torch.Tensor,
    *,
    step: int,
    total_steps: int,
    config: LayerSkipTrainConfig,
    generator: torch.Generator | None = None,
) -> LayerSkipLoss:
    """The LayerSkip objective ``J(X, Y, t)`` (eq. 5) on ``batch`` ``[B, S+1]`` of token ids.

    Inputs are ``batch[:, :-1]``, targets ``batch[:, 1:]``. ``generator`` drives the dropout
    draws (seed it per step for reproducible, resumable training).
    """
    parts = decoder_pieces(model)
    n = parts.num_layers
    inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, S] each
    rates = dropout_rates(step, num_layers=n, total_steps=total_steps, config=config)
    scales = scales_for(step, num_layers=n, total_steps=total_steps, config=config)
    keep = sample_keep_mask(rates, inputs.shape[0], generator)
    hidden = run_decoder(model, inputs, keep, parts=parts)
    loss = hidden[-1].sum() * 0.0  # keeps the graph connected if every scale is 0
    ces: dict[int, torch.Tensor] = {}
    last = n - 1
    beta = config.exit_distill
    teacher = last_logits = None  # teacher: log p_last [B, S, V], detached
    if beta > 0 and any(s > 0 for s in scales[:last]):
        last_logits = exit_logits(model, hidden[-1], parts=parts)  # reused by the last layer's CE
        teacher = F.log_softmax(last_logits.detach().float(), -1)
    for l, scale in enumerate(scales):
        if scale == 0.0:
            continue
        if l == last and last_logits is not None:
            logits = last_logits
        else:
            logits = exit_logits(model, hidden[l], parts=parts)  # [B, S, V]
        ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        ces[l] = ce.detach()
        if teacher is not None and l < last:
            ce = (1.0 - beta) * ce + beta * distill_kl(teacher, logits)
        loss = loss + scale * ce
    # One device -> host copy for all layers (a float() per layer would sync a GPU per layer).
    values = torch.stack(list(ces.values())).tolist() if ces else []
    layer_losses = dict(zip(ces, values, strict=True))
    return LayerSkipLoss(loss, layer_losses, scales, rates, keep, targets.numel())
