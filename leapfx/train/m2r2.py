"""Training M2R2's accelerator adapters (sec. 2.4, eq. 5); the base model stays frozen.

For every interval [E_j, E_{j+1}) the fast stream starts from the slow state h^{E_j} (detached:
an adapter gets gradient only from its own interval's gate) and eq. 5 sums

    a0 * CE(head(norm(p^{E_{j+1}})), y)                        at each gate
    a1 * ||p^{i+1} - h^{target(i)}||^2 / mean ||h^{target(i)}||^2   at each fast layer i

with ``target(i) = round((i + 1 - E_j) R_j + E_j)`` clipped to N (the slow state R_j layers
further per fast layer; ``h^N`` is the last layer's output before the final norm). ``y`` is
the next token of the data (the paper) or, with ``ce_target="model"``, the full model's
distribution (soft cross-entropy, as Kangaroo's eq. 3: what a drafter is judged by).

One step is "the same forward" of sec. 2.2: a no-grad slow pass of the frozen model fills a
batch-sized KV cache with every layer's slow keys and returns every h^l; then each fast layer
runs on all positions at once through one attention over [slow | fast] keys (fast row t sees
slow columns < t and its own fast column), exactly the mask the fast rows would get inside a
joint [slow | fast] batch -- the slow rows are computed separately only because no gradient
flows through them. Only the accelerator's parameters train: the host's are set
``requires_grad=False`` for the duration of ``fit`` and restored after.

Example::

    >>> sm = rewrite.apply(hf_model, "m2r2")
    >>> result = sm.fit(token_ids, steps=300, batch_size=8, seq_len=128)
    >>> report = evaluate(sm, held_out_ids)     # cosine and top-1 agreement per gate
    >>> sm.save_parts("m2r2-parts/")
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from leapfx.modules.hf import cache_kwarg
from leapfx.modules.m2r2 import target_layers
from leapfx.modules.m2r2_scratch import ChainScratch
from leapfx.options import check_bool, check_int, check_number
from leapfx.parts.io import host_signature
from leapfx.parts.kangaroo import write_adapter
from leapfx.passes.accelerator import accelerator_of
from leapfx.passes.capture import decoder_pieces
from leapfx.passes.draft_vocab import install_ranking, ranking_of, token_ranking
from leapfx.runtime.cache import StaticKVCache
from leapfx.train.features import tokens_digest
from leapfx.train.fit_checkpoint import run_steps, start_fit
from leapfx.train.fit_options import optimizer_step, parts_fit
from leapfx.train.kangaroo import kangaroo_loss, sample_windows, token_stream, window_inputs
from leapfx.train.trainer import warmup_cosine

CE_TARGETS = ("labels", "model")


@dataclass(frozen=True)
class M2R2FitConfig:
    """Options of ``fit``. The paper gives no hyperparameters; these are the spec's choices
    (AdamW, cosine with 3% warmup, a0 = a1 = 1) at a learning rate for rank-8 adapters."""

    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 2e-3  # small zero-initialised adapters: 2e-4 (the spec's) moves them too slowly
    weight_decay: float = 0.0
    warmup: float = 0.03  # share of steps with a linear warmup, then cosine to 0
    ce_weight: float = 1.0  # a0
    mse_weight: float = 1.0  # a1
    # Not in eq. 5: on an MoE host, the KL of the routing of layers 2i+2, 2i+3 predicted from
    # p^{i+1} (their norms and routers) from their actual routing (sec. 2.3.3's use of the
    # stream: the offload's m2r2 prefetch policy). 0: off.
    route_weight: float = 0.0
    ce_target: str = "labels"  # "labels" (eq. 5) or "model" (the full model's distribution)
    # Not in the paper: the CE of the first gate (the one m2r2 drafts from) also on draft
    # steps 2..chain of an unrolled draft chain (ChainScratch: each step reads the earlier
    # steps' fast keys where drafting has no slow ones), averaged over the steps. 1: eq. 5.
    chain: int = 1
    grad_clip: float = 1.0
    # ARLA routers (m2r2_exit), trained after the adapters (sec. 2.3.1) with BCE on whether
    # the gate's LM-head argmax equals the full model's; ignored where there are none.
    router_steps: int = 200
    router_lr: float = 1e-3
    seed: int = 0
    progress: bool = True  # a tqdm bar
    max_minutes: float = 0.0  # > 0: stop after this much wall time even if steps remain
    checkpoint_every: int = 0  # with fit's checkpoint_dir: steps between checkpoints (0: at end)

    def __post_init__(self) -> None:
        ints = (("steps", 1), ("batch_size", 1), ("seq_len", 2), ("seed", 0), ("router_steps", 0),
                ("chain", 1), ("checkpoint_every", 0))  # fmt: skip
        for name, low in ints:
            value = getattr(self, name)
            check_int(name, value, low)
        for name in ("lr", "router_lr", "weight_decay", "ce_weight", "mse_weight", "grad_clip",
                     "route_weight", "max_minutes"):  # fmt: skip
            value = getattr(self, name)
            positive = name in ("lr", "router_lr")
            check_number(name, value, 0, low_open=positive)
        if not (isinstance(self.warmup, (int, float)) and 0 <= self.warmup < 1):
            raise ValueError(f"warmup: {self.warmup!r} is invalid; allowed: a number in [0, 1)")
        if self.ce_target not in CE_TARGETS:
            raise ValueError(f"ce_target: {self.ce_target!r} is invalid; allowed: {CE_TARGETS}")
        check_bool("progress", self.progress)


@dataclass
class FitResult:
    """What ``fit`` did: eq. 5's loss and its two terms on every step's batch."""

    steps: int  # steps asked for; len(losses) ran (fewer when max_minutes stopped it)
    losses: list[float] = field(default_factory=list)
    ce: list[float] = field(default_factory=list)
    mse: list[float] = field(default_factory=list)
    router_losses: list[float] = field(default_factory=list)  # BCE, summed over the gates
    tokens: int = 0
    seconds: float = 0.0
    held_out_before: dict[str, Any] | None = None  # ``evaluate`` on eval_data, before training
    held_out_after: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """Every adapter step ran (the routers train only then)."""
        return len(self.losses) >= self.steps

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")


@dataclass
class SlowPass:
    """The frozen model on a batch: every slow state and a cache holding every layer's keys."""

    hidden: list[torch.Tensor]  # h^0..h^N, each [B, S, H] (h^N before the final norm)
    logits: torch.Tensor  # the full model's [B, S, V]
    cache: StaticKVCache
    rope: tuple[torch.Tensor, torch.Tensor]
    position_ids: torch.Tensor  # [1, S]


@torch.no_grad()
def slow_pass(sm, ids: torch.Tensor) -> SlowPass:
    """Run the frozen model on ``ids`` [B, S], keeping each layer's output and keys/values."""
    model = sm.hf_model
    parts = decoder_pieces(model)
    config = model.config
    weight = next(model.parameters())
    ids = ids.to(weight.device)
    B, S = ids.shape
    heads = config.num_attention_heads
    cache = StaticKVCache(
        config.num_hidden_layers,
        getattr(config, "num_key_value_heads", None) or heads,
        getattr(config, "head_dim", None) or config.hidden_size // heads,
        S,
        batch_size=B,
        dtype=weight.dtype,
        device=weight.device,
    )
    h = parts.embed(ids)
    pos, rope, masks = window_inputs(model, parts, h, parts.attn_kinds)
    hidden = [h]
    for layer, kind in zip(parts.layers, parts.attn_kinds, strict=True):
        h = layer(
            h, attention_mask=masks[kind], position_embeddings=rope, position_ids=pos,
            **{cache_kwarg(layer): cache},
        )  # fmt: skip
        hidden.append(h)
    logits = parts.head(parts.norm(h))
    return SlowPass(hidden, logits, cache, rope, pos)


def fast_states(sm, slow: SlowPass, chain: ChainScratch | None = None) -> dict[int, torch.Tensor]:
    """Every fast layer's output (with autograd), keyed by the layer index i (state p^{i+1}).
    ``chain``: keeps the first interval's fast keys as the chain's step 1 (``draft_chain``)."""
    acc = accelerator_of(sm.graph_module)
    out: dict[int, torch.Tensor] = {}
    for a, b in acc.intervals:
        p = slow.hidden[a].detach()  # the reset p^{E_j} = h^{E_j}: no gradient crosses it
        scratch = chain if a == 0 else None
        for i in range(a, b):
            p = acc.layers[str(i)](p, slow.rope, slow.position_ids, slow.cache, scratch)
            out[i] = p
    return out


def draft_chain(sm, slow: SlowPass, chain: ChainScratch, steps: int) -> list[torch.Tensor]:
    """Gate logits [B, S, V] of chain steps 2..``steps`` of the first interval (E_0 = 0, the
    drafting one), after ``fast_states(sm, slow, chain)`` ran step 1. Row t of step j + 1
    is draft j + 1 of the round starting at t - j: only rows t >= j are such drafts."""
    acc = accelerator_of(sm.graph_module)
    b = acc.gates[0]
    out = []
    for _ in range(1, steps):
        p = acc.stream(slow.hidden[0].detach(), 0, b, slow.rope, slow.position_ids, slow.cache,
                       chain)  # fmt: skip
        out.append(gate_logits(sm, p))
    return out


def _gate_ce(logits, slow: SlowPass, ids: torch.Tensor, config: M2R2FitConfig, skip: int = 0):
    """CE of gate logits [B, S, V] on rows >= ``skip`` against the data or the full model."""
    if config.ce_target == "labels":
        labels = ids.to(logits.device)[:, skip + 1 :]
        return F.cross_entropy(logits[:, skip:-1].flatten(0, 1).float(), labels.flatten())
    return kangaroo_loss(logits[:, skip:], slow.logits[:, skip:])


def gate_logits(sm, p: torch.Tensor) -> torch.Tensor:
    """The final norm and LM head (frozen) on a fast state at a gate: [B, S, V]."""
    parts = decoder_pieces(sm.hf_model)
    return parts.head(parts.norm(p))


def m2r2_loss(
    sm, ids: torch.Tensor, config: M2R2FitConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eq. 5 on a batch [B, S]: (loss, CE term, MSE term)."""
    acc = accelerator_of(sm.graph_module)
    slow = slow_pass(sm, ids)
    chain = ChainScratch() if config.chain > 1 else None
    fast = fast_states(sm, slow, chain)
    targets = target_layers(acc.gates, acc.num_layers)
    mse = torch.zeros((), device=slow.logits.device)
    for i, p in fast.items():
        h = slow.hidden[targets[i]]
        scale = h.float().pow(2).sum(-1).mean()
        mse = mse + (p.float() - h.float()).pow(2).sum(-1).mean() / scale
    ce = torch.zeros((), device=slow.logits.device)
    for a, b in acc.intervals:
        first = _gate_ce(gate_logits(sm, fast[b - 1]), slow, ids, config)
        if a == 0 and chain is not None:  # the draft chain: mean over its steps
            later = draft_chain(sm, slow, chain, config.chain)
            steps = [_gate_ce(x, slow, ids, config, skip=j) for j, x in enumerate(later, 1)]
            first = (first + sum(steps)) / config.chain
        ce = ce + first
    loss = config.ce_weight * ce + config.mse_weight * mse
    if config.route_weight:
        loss = loss + config.route_weight * routing_loss(sm, ids, fast)
    return loss, ce, mse


def routing_loss(sm, ids: torch.Tensor, fast: dict[int, torch.Tensor]) -> torch.Tensor:
    """Sum over fast layers i and MoE layers L in {2i+2, 2i+3} of KL(actual || predicted): L's
    norm and router on its own post-attention residual (no grad) vs on p^{i+1}."""
    from leapfx.models.routing import moe_layers, post_attention_residuals, route_hidden
    from leapfx.runtime.expert_prediction import predicted_layers

    model = sm.hf_model
    moe = moe_layers(model)
    n = model.config.num_hidden_layers
    with torch.no_grad():
        actual = post_attention_residuals(model, moe, [ids.to(next(model.parameters()).device)])
    loss = torch.zeros((), device=ids.device)
    for i, p in fast.items():
        for target in (t for t in predicted_layers(i, n) if t in moe):
            with torch.no_grad():
                want = route_hidden(model, target, actual[target])[0]  # [T, E]
            got = route_hidden(model, target, p.reshape(-1, p.shape[-1]))[0]
            loss = loss + F.kl_div(got.clamp_min(1e-9).log(), want, reduction="batchmean")
    return loss


def router_loss(sm, ids: torch.Tensor) -> torch.Tensor:
    """BCE of every gate's ARLA router on a batch [B, S]: label 1 where the gate's LM-head
    argmax equals the full model's (the adapters frozen: their states are detached)."""
    acc = accelerator_of(sm.graph_module)
    slow = slow_pass(sm, ids)
    with torch.no_grad():
        fast = fast_states(sm, slow)
        full = slow.logits.argmax(-1)
    loss = torch.zeros((), device=full.device)
    for a, b in acc.intervals:
        states = [slow.hidden[a], *(fast[i] for i in range(a, b))]
        with torch.no_grad():
            label = (gate_logits(sm, fast[b - 1]).argmax(-1) == full).float()
        logit = acc.routers[str(b)].logit(states)
        loss = loss + F.binary_cross_entropy_with_logits(logit.float(), label)
    return loss


def chain_accepted(agree: list[torch.Tensor]) -> tuple[int, int]:
    """Greedy drafts accepted over every round start of a window: ``agree[j]`` [B, S] says
    whether chain step j + 1's argmax at row t equals the full model's (row t is draft j + 1
    of the round starting at t - j); a round accepts drafts while they agree. Returns
    (accepted drafts, rounds), over the round starts with a whole chain in the window."""
    g = len(agree)
    S = agree[0].shape[1]
    if S < g:
        return 0, 0
    alive = torch.ones_like(agree[0][:, : S - g + 1])
    accepted = 0
    for j, a in enumerate(agree):
        alive = alive & a[:, j : j + S - g + 1]
        accepted += int(alive.sum())
    return accepted, alive.numel()


@torch.no_grad()
def evaluate(
    sm, data: Any, *, tokenizer=None, seq_len: int = 256, chain: int | None = None
) -> dict[str, Any]:
    """Held-out alignment per gate: cosine of the gate's fast state with h^N, and top-1
    agreement of the gate's LM-head argmax with the full model's, over consecutive windows.

    ``chain`` (default: the recipe's ``num_speculations``, if it drafts): also the first
    gate's unrolled draft chain (``ChainScratch``, teacher-forced): each step's agreement and
    the greedy drafts a round accepts out of ``chain`` -- what decoding speed follows, where
    the gate's agreement is only the first draft's."""
    acc = accelerator_of(sm.graph_module)
    if chain is None:
        chain = getattr(sm.options, "num_speculations", None) or 0
    stream = token_stream(data, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    cos = {b: 0.0 for _, b in acc.intervals}
    agree = {b: 0 for _, b in acc.intervals}
    router_right = {b: 0 for _, b in acc.intervals}
    step_agree, step_rows, accepted, rounds = [0] * chain, [0] * chain, 0, 0
    count = 0
    for start in range(0, stream.numel() - 1, seq_len):
        window = stream[start : start + seq_len][None]
        slow = slow_pass(sm, window)
        scratch = ChainScratch() if chain else None
        fast = fast_states(sm, slow, scratch)
        full = slow.logits.argmax(-1)
        if chain:
            first = gate_logits(sm, fast[acc.gates[0] - 1])
            steps = [first, *draft_chain(sm, slow, scratch, chain)]
            hits = [x.argmax(-1) == full for x in steps]
            for j, h in enumerate(hits):
                step_agree[j] += int(h[:, j:].sum())
                step_rows[j] += h[:, j:].numel()
            a, r = chain_accepted(hits)
            accepted, rounds = accepted + a, rounds + r
        final = slow.hidden[-1]
        for a, b in acc.intervals:
            p = fast[b - 1]
            cos[b] += float(F.cosine_similarity(p.float(), final.float(), dim=-1).sum())
            agreed = gate_logits(sm, p).argmax(-1) == full
            agree[b] += int(agreed.sum())
            if str(b) in acc.routers:
                states = [slow.hidden[a], *(fast[i] for i in range(a, b))]
                says = acc.routers[str(b)](states) >= 0.5
                router_right[b] += int((says == agreed).sum())
        count += window.shape[1]
    report = {
        "tokens": count,
        "cosine": {str(b): cos[b] / count for b in cos},
        "agreement": {str(b): agree[b] / count for b in agree},
    }
    if len(acc.routers):  # the router's accuracy at 0.5 on "the gate agrees with the model"
        report["router_accuracy"] = {str(b): router_right[b] / count for b in router_right}
    if chain:
        report["chain"] = {
            "steps": chain,
            "agreement": [a / max(1, r) for a, r in zip(step_agree, step_rows, strict=True)],
            "accepted": accepted / max(1, rounds),
        }
    return report


@parts_fit(M2R2FitConfig)
def fit(sm, data: Any, config: M2R2FitConfig, tokenizer, eval_data, checkpoint_dir) -> FitResult:
    """Train the accelerator of ``sm`` on ``data`` (eq. 5); returns a FitResult.

    ``options`` are the fields of :class:`M2R2FitConfig`. Only the accelerator's parameters
    change; the stages share them, so ``sm.generate`` drafts with them at once. With
    ``eval_data`` the result holds ``evaluate`` before and after training.
    ``checkpoint_dir``: resumable (``train.fit_checkpoint``): a run finds its checkpoint there
    and continues; every ``checkpoint_every`` steps and where it stops it writes one. Step i's
    learning rate is the schedule's at i, so a resumed run takes the steps of a run never
    stopped. ``max_minutes`` stops the adapters' steps early; the routers (``m2r2_exit``) train
    only once every adapter step has run.
    """
    stream = token_stream(data, vocab_size=sm.config.vocab_size, tokenizer=tokenizer)
    acc = accelerator_of(sm.graph_module)
    # The training data's token ranking: the subset of draft_vocab, saved with the parts.
    install_ranking(sm.graph_module, token_ranking(stream, sm.config.vocab_size),
                    decoder_pieces(sm.hf_model).head)  # fmt: skip
    params = list(acc.parameters())
    warm = max(1, round(config.warmup * config.steps))
    result = FitResult(steps=config.steps)
    identity = {"recipe": sm.recipe.name, "options": parts_options(sm),
                "data": tokens_digest(stream)}  # fmt: skip
    optimizer, generator, checkpoint, first = start_fit(
        acc, config, result, checkpoint_dir, identity
    )
    if eval_data is not None and first == 0:
        result.held_out_before = evaluate(sm, eval_data, tokenizer=tokenizer)

    def step() -> None:
        for group in optimizer.param_groups:
            group["lr"] = config.lr * warmup_cosine(len(result.losses), config.steps, warm)
        batch = sample_windows(stream, config.batch_size, config.seq_len, generator)
        loss, ce, mse = m2r2_loss(sm, batch, config)
        optimizer_step(optimizer, loss, params, config.grad_clip)
        result.losses.append(float(loss.detach()))
        result.ce.append(float(ce.detach()))
        result.mse.append(float(mse.detach()))
        result.tokens += batch.numel()

    host = [p for p in sm.hf_model.parameters() if p.requires_grad]
    acc.train()
    try:
        for p in host:  # no gradient into the user's model; restored in finally
            p.requires_grad_(False)
        run_steps(result, step, first=first, config=config, desc="m2r2 accelerator",
                  checkpoint=checkpoint)  # fmt: skip
        if result.finished and len(acc.routers) and config.router_steps:
            start = time.perf_counter()
            _fit_routers(sm, stream, config, generator, result, config.progress)
            result.seconds += time.perf_counter() - start
    finally:
        for p in host:
            p.requires_grad_(True)
        acc.eval()
        optimizer.zero_grad(set_to_none=True)
    if eval_data is not None:
        result.held_out_after = evaluate(sm, eval_data, tokenizer=tokenizer)
    return result


def _fit_routers(sm, stream, config, generator, result, show: bool) -> None:
    """Sec. 2.3.1: the routers train after the adapters, every gate's in parallel."""
    acc = accelerator_of(sm.graph_module)
    acc.layers.requires_grad_(False)
    try:
        params = list(acc.routers.parameters())
        optimizer = torch.optim.AdamW(params, lr=config.router_lr)
        bar = tqdm(range(config.router_steps), desc="m2r2 routers", disable=not show)
        for _ in bar:
            batch = sample_windows(stream, config.batch_size, config.seq_len, generator)
            loss = router_loss(sm, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            result.router_losses.append(float(loss.detach()))
            bar.set_postfix(bce=f"{result.router_losses[-1]:.3f}")
    finally:
        acc.layers.requires_grad_(True)


def parts_options(sm) -> dict[str, Any]:
    """What a parts directory records: the gates, heads and rank of the accelerator (and the
    recipe's other options)."""
    acc = accelerator_of(sm.graph_module)
    first = next(iter(acc.layers.values()))
    # draft_vocab is a decoding choice (the ranking is saved whole), never a part's option
    skip = ("parts", "draft_vocab")
    options = {k: v for k, v in dataclasses.asdict(sm.options).items() if k not in skip}
    options.update(gates=list(acc.gates), heads=len(first.q_heads), rank=first.down.shape[0])
    return options


def save_parts(sm, path: str | Path) -> Path:
    """Write the accelerator of ``sm`` (see parts.m2r2)."""
    return write_adapter(
        accelerator_of(sm.graph_module),
        path,
        recipe=sm.recipe.name,
        options=parts_options(sm),
        host=host_signature(sm.config),
        ranking=ranking_of(sm.graph_module),
    )
