"""Kangaroo adapter distillation (sec. 3.1, eq. 3): only the adapter trains.

The adapter A learns to map the residual stream after layer l-1 to what the full model predicts,
through the model's own (frozen) LM head. The loss is eq. 3, the cross-entropy of the self-draft
distribution M^s = softmax(head(A(h_l))) against the full model's distribution M^b at the same
positions, averaged over positions::

    loss = mean_t  sum_n  -M^b_n(x_t) * log M^s_n(x_t)

The targets and the early features come from one no-grad forward pass of the HF model itself
(so they are exactly the model the adapter drafts for); only the adapter's forward runs with
autograd, and the LM head is called with detached weights, so no gradient ever reaches the
user's model. AdamW at a constant learning rate, gradient clipping, a tqdm bar.

Data is token ids (a 1-D tensor, a list of 1-D tensors or of int lists, or a [N, S] tensor whose
rows are documents), or texts with ``tokenizer=`` (anything with ``encode(text) -> ids`` or a
callable). Documents are concatenated into one stream, and each step trains on ``batch_size``
windows of ``seq_len`` tokens drawn at random offsets from a seeded generator.

Device: training and evaluation run where the model is. Move the model before
``rewrite.apply`` (the adapter is built on its device); windows are drawn on the CPU, so a seed
gives the same batches on every device, and are copied over. ``save_adapter`` writes CPU tensors.

Example::

    >>> sm = rewrite.apply(hf_model, "kangaroo", exit_layer=2)
    >>> result = sm.fit(token_ids, steps=300, batch_size=8, seq_len=128)
    >>> sm.save_adapter("kangaroo-adapter/")     # rewrite.apply(..., adapter=...) loads it
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from leapfx.options import check_bool, check_int, check_number
from leapfx.parts.io import host_signature
from leapfx.parts.kangaroo import write_adapter
from leapfx.passes.adapter import adapter_of
from leapfx.passes.capture import decoder_pieces
from leapfx.passes.draft_vocab import install_ranking, ranking_of, token_ranking
from leapfx.runtime.masks import masks_for
from leapfx.train.features import TeacherFeatures, tokens_digest
from leapfx.train.fit_checkpoint import start_fit, train_module
from leapfx.train.fit_options import optimizer_step, parts_fit


@dataclass(frozen=True)
class KangarooFitConfig:
    """Options of ``fit``. The paper trains 10 epochs with AdamW; here steps are explicit."""

    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128  # window length; shorter data trains on whole documents
    lr: float = 1e-3  # one attention block from a sensible init: a high rate converges fast
    weight_decay: float = 0.0  # norms and a single attention: nothing to regularise
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0  # window sampling
    progress: bool = True  # tqdm bar
    max_minutes: float = 0.0  # > 0: stop after this much wall time even if steps remain
    checkpoint_every: int = 0  # with fit's checkpoint_dir: steps between checkpoints (0: at end)

    def __post_init__(self) -> None:
        ints = (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("seed", 0),
                ("checkpoint_every", 0))  # fmt: skip
        for name, low in ints:
            value = getattr(self, name)
            check_int(name, value, low)
        numbers = (("lr", True), ("weight_decay", False), ("grad_clip", False),
                   ("max_minutes", False))  # fmt: skip
        for name, positive in numbers:
            value = getattr(self, name)
            check_number(name, value, 0, low_open=positive)
        check_bool("progress", self.progress)


@dataclass
class FitResult:
    """What ``fit`` did: the eq.-3 loss of every step (on that step's batch)."""

    steps: int
    losses: list[float] = field(default_factory=list)
    tokens: int = 0  # training tokens seen (batch_size * seq_len * steps)
    seconds: float = 0.0
    agreement_before: float | None = None  # held-out top-1 agreement with the model
    agreement_after: float | None = None

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")


def kangaroo_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Eq. 3, averaged over positions: cross-entropy of the draft against the target.

    ``draft_logits``, ``target_logits``: [..., V] -> a scalar. Computed in float32.

    >>> logits = torch.randn(2, 5, 11)
    >>> bool(kangaroo_loss(logits, logits) <= kangaroo_loss(torch.zeros_like(logits), logits))
    True
    """
    target = torch.softmax(target_logits.float(), dim=-1)
    log_draft = F.log_softmax(draft_logits.float(), dim=-1)
    return -(target * log_draft).sum(dim=-1).mean()


def token_stream(data: Any, *, vocab_size: int, tokenizer=None) -> torch.Tensor:
    """All of ``data`` as one 1-D LongTensor of token ids (documents concatenated)."""
    if isinstance(data, torch.Tensor):
        docs = [data.reshape(-1)] if data.dim() <= 2 else None
        if docs is None:
            raise ValueError(f"data: a token tensor must be 1-D or 2-D, got {tuple(data.shape)}")
    elif isinstance(data, str) or not isinstance(data, Sequence):
        raise ValueError(
            "data: expected token ids (a tensor, or a list of tensors / int lists) or a list of "
            f"texts with tokenizer=; got {type(data).__name__}"
        )
    else:
        docs = [_document(item, tokenizer) for item in data]
    stream = torch.cat([d.long().reshape(-1) for d in docs]) if docs else torch.zeros(0)
    if stream.numel() < 2:
        raise ValueError("data: at least 2 tokens are needed to train on")
    if int(stream.min()) < 0 or int(stream.max()) >= vocab_size:
        raise ValueError(f"data: token ids must lie in 0..{vocab_size - 1}")
    return stream.long()


def _document(item: Any, tokenizer) -> torch.Tensor:
    if isinstance(item, str):
        if tokenizer is None:
            raise ValueError("tokenizer: texts need a tokenizer (encode(text) -> ids); got None")
        ids = tokenizer.encode(item) if hasattr(tokenizer, "encode") else tokenizer(item)
        return torch.as_tensor(ids, dtype=torch.long)
    if isinstance(item, torch.Tensor):
        return item.reshape(-1)
    if isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
        return torch.as_tensor(list(item), dtype=torch.long)
    raise ValueError(
        f"data: each item must be a text, a token tensor or a list of ints; got "
        f"{type(item).__name__}"
    )


def sample_windows(
    stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """``batch_size`` windows of ``min(seq_len, len(stream))`` tokens at random offsets: [B, S]."""
    s = min(seq_len, stream.numel())
    starts = torch.randint(0, stream.numel() - s + 1, (batch_size,), generator=generator)
    return torch.stack([stream[i : i + s] for i in starts.tolist()])


@torch.no_grad()
def window_inputs(
    model, parts, x: torch.Tensor, kinds
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], dict]:
    """What a decoder layer reads besides its hidden states on whole windows from position 0:
    ``(position_ids [1, S], the rotary embeddings of x [B, S, D] at them, the causal masks of
    the attention kinds)``, the masks in the model's dtype and on its device."""
    weight = next(model.parameters())
    n = x.shape[1]
    position_ids = torch.arange(n, device=x.device)[None]  # [1, S]
    rope = parts.rotary(x, position_ids)
    masks = masks_for(
        model.config._attn_implementation, kinds, 0, n,
        window=parts.sliding_window, dtype=weight.dtype, device=weight.device,
    )  # fmt: skip
    return position_ids, rope, masks


def parts_record(sm, *skip: str) -> dict[str, Any]:
    """What a drafter's parts file records beside its weights (the keywords of its writer):
    the recipe, its options but ``skip`` (the option naming the parts folder), the host and the
    draft head's token ranking."""
    options = {k: v for k, v in dataclasses.asdict(sm.options).items() if k not in skip}
    return {"recipe": sm.recipe.name, "options": options, "host": host_signature(sm.config),
            "ranking": ranking_of(sm.graph_module)}  # fmt: skip


def adapter_and_target_logits(sm, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter's logits (with autograd) and the full model's (without): both [B, S, V]."""
    model = sm.hf_model
    adapter = adapter_of(sm.graph_module)
    weight = next(model.parameters())
    ids = input_ids.to(weight.device, non_blocking=True)  # no stream sync for the host copy
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        target = out.logits  # [B, S, V]
        features = out.hidden_states[adapter.exit_layer]  # [B, S, H]: after layer l-1
    return adapter_logits(sm, features), target


def adapter_logits(sm, features: torch.Tensor) -> torch.Tensor:
    """The adapter's logits [B, S, V] (with autograd) on the residual stream after layer l-1,
    ``features`` [B, S, H] (a whole window from position 0)."""
    adapter = adapter_of(sm.graph_module)
    parts = decoder_pieces(sm.hf_model)
    _, rope, masks = window_inputs(sm.hf_model, parts, features, [adapter.attn_kind])
    hidden = adapter(features, rope, masks[adapter.attn_kind])  # [B, S, H]
    frozen = {k: v.detach() for k, v in parts.head.named_parameters()}
    return functional_call(parts.head, frozen, (hidden,))


@torch.no_grad()
def evaluate_agreement(sm, data: Any, *, tokenizer=None, seq_len: int = 256) -> float:
    """Held-out top-1 agreement of the adapter's draft with the full model over consecutive
    windows of ``data`` (teacher-forced: the draft reads the true prefix): the share of
    positions where the two pick the same token, the number a greedy chain's acceptance
    follows."""
    stream = token_stream(data, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    agree, count = 0, 0
    for start in range(0, stream.numel() - 1, seq_len):
        draft, target = adapter_and_target_logits(sm, stream[start : start + seq_len][None])
        agree += int((draft.argmax(-1) == target.argmax(-1)).sum())
        count += target.shape[1]
    return agree / count


@torch.no_grad()
def evaluate_loss(sm, data: Any, *, tokenizer=None, seq_len: int = 128) -> float:
    """Eq. 3 over all of ``data``, in consecutive windows of ``seq_len`` tokens."""
    stream = token_stream(data, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    total, count = 0.0, 0
    for start in range(0, stream.numel() - 1, seq_len):
        window = stream[start : start + seq_len][None]
        draft, target = adapter_and_target_logits(sm, window)
        total += float(kangaroo_loss(draft, target)) * window.shape[1]
        count += window.shape[1]
    return total / count


@parts_fit(KangarooFitConfig)
def fit(
    sm, data: Any, config: KangarooFitConfig, tokenizer, eval_data, checkpoint_dir
) -> FitResult:
    """Distil the Kangaroo adapter of ``sm`` on ``data`` (eq. 3); returns a FitResult.

    ``options`` are the fields of :class:`KangarooFitConfig`. Only the adapter's parameters
    change; the stages share them, so ``sm.generate`` drafts with the trained adapter at once.
    Runs on the model's device (see the module docstring). ``eval_data``: the result holds the
    held-out top-1 agreement before and after. ``data`` may be ``TeacherFeatures`` holding the
    states after layer l-1 and the last layer (``train.features``); ``checkpoint_dir``: a
    resumable run (``train.fit_checkpoint``), as EAGLE's ``fit``.
    """
    cached = data if isinstance(data, TeacherFeatures) else None
    source = cached.tokens if cached is not None else data
    stream = token_stream(source, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    adapter = adapter_of(sm.graph_module)
    params = list(adapter.parameters())
    model_device = next(sm.hf_model.parameters()).device
    adapter_device = params[0].device if params else model_device
    if adapter_device != model_device:
        raise ValueError(
            f"fit: the adapter is on {adapter_device} but the model on {model_device}; move the "
            "model to the device before rewrite.apply (the adapter is built where the model is)"
        )
    parts = decoder_pieces(sm.hf_model)
    # The training data's token ranking: the subset of draft_vocab, saved with the adapter.
    install_ranking(sm.graph_module, token_ranking(stream, sm.config.vocab_size), parts.head)
    result = FitResult(steps=config.steps)
    identity = {"recipe": "kangaroo", "data": tokens_digest(stream),
                "exit_layer": adapter.exit_layer}  # fmt: skip
    optimizer, generator, checkpoint, first = start_fit(
        adapter, config, result, checkpoint_dir, identity
    )
    if eval_data is not None and first == 0:
        result.agreement_before = evaluate_agreement(sm, eval_data, tokenizer=tokenizer)
    layers = (adapter.exit_layer, sm.config.num_hidden_layers)

    def step() -> None:
        if cached is None:
            batch = sample_windows(stream, config.batch_size, config.seq_len, generator)
            draft, target = adapter_and_target_logits(sm, batch)
        else:
            batch, (features, h) = cached.batch(config.batch_size, generator, layers)
            dtype = next(sm.hf_model.parameters()).dtype
            features = features.to(device=model_device, dtype=dtype)
            with torch.no_grad():
                target = parts.head(parts.norm(h.to(device=model_device, dtype=dtype)))
            draft = adapter_logits(sm, features)
        loss = kangaroo_loss(draft, target)
        optimizer_step(optimizer, loss, params, config.grad_clip)
        result.losses.append(float(loss.detach()))
        result.tokens += batch.numel()

    train_module(adapter, optimizer, result, step, first=first, config=config,
                 desc="kangaroo adapter", checkpoint=checkpoint)  # fmt: skip
    if eval_data is not None:
        result.agreement_after = evaluate_agreement(sm, eval_data, tokenizer=tokenizer)
    return result


def save_adapter(sm, path: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
    """Write the adapter of ``sm`` and its recipe options (see parts.kangaroo);
    ``extra``: more entries of its JSON file (a training run's summary)."""
    record = parts_record(sm, "adapter")
    return write_adapter(adapter_of(sm.graph_module), path, **record, extra=extra)
