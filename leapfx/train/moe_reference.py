"""The MoE reference model: an OLMoE-shaped byte-level model trained with LayerSkip + balancing.

The dense reference model (``reference.py``) cannot exercise expert offload; this one can. It
is trained the same way (the same corpus, split, byte tokenizer, LayerSkip recipe, trainer,
checkpoints and resumption), with two differences:

- the architecture is ``OlmoeForCausalLM``: 12 layers of 128 (4 heads of 32, 2 KV heads),
  16 experts of width 128 per layer, top-2 routing (``norm_topk_prob`` off, as OLMoE), an untied
  head: ~10.1M parameters, ~20 MB in float16 (<= 25 MB), ~2.5M of them active per token;
- the loss adds the Switch-Transformer load-balancing term (``E * sum_e f_e P_e``, HF's
  ``load_balancing_loss_func``) of each layer's router logits (read with forward hooks on the
  routers), averaged over the layers, times ``aux_coef`` (OLMoE: 0.01). Without it a freshly
  initialised router sends most tokens to a few experts, and a cache of half the slots would
  hit almost always: no offload problem left to measure. It balances each layer on its own:
  the same term over every layer's logits at once (HF's call with all of them) balances only
  their sum, and trained that way the busiest expert of a layer took 2.7-5.1 times the mean
  share (1.2-1.5 balanced per layer).

The report (``moe_reference_report.json`` beside the model) holds what the dense one does
(held-out loss, per-exit agreement) and the routing: per layer, entropy, expert load, reuse of the
previous token's experts and the next-gate predictability at distance 1 and 2
(``leapfx.bench.routing``).

>>> report = train_moe_reference("runs/moe-reference", minutes=60)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leapfx.files import write_text_atomic
from leapfx.models.routing import routing_stats
from leapfx.train.data import byte_tokenizer, token_byte_lengths
from leapfx.train.evaluate import eval_windows, evaluate_exits
from leapfx.train.layerskip import LayerSkipTrainConfig
from leapfx.train.reference import (
    REFERENCE_RECIPE,
    _report_model,
    _report_training,
    _run_phase,
    _set_up,
    check_shape,
    config_kwargs,
    reference_corpus,
)
from leapfx.train.trainer import resolve_device

log = logging.getLogger(__name__)

REPORT_NAME = "moe_reference_report.json"
MOE_REFERENCE_RECIPE: LayerSkipTrainConfig = REFERENCE_RECIPE


@dataclass(frozen=True)
class MoEReferenceSpec:
    """Shape of the MoE reference model (OLMoE-shaped; defaults ~10.1M parameters, ~20 MB fp16)."""

    num_layers: int = 12
    hidden_size: int = 128
    intermediate_size: int = 128  # per expert
    num_experts: int = 16
    top_k: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k: got {self.top_k}; allowed range is 1..num_experts ({self.num_experts})"
            )
        check_shape(self)


def build_moe_model(spec: MoEReferenceSpec, tokenizer, seed: int):
    """A freshly initialised ``OlmoeForCausalLM`` of ``spec`` (untied LM head)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        **config_kwargs(spec, tokenizer),
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
    )
    torch.manual_seed(seed)
    model = OlmoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            # HF initialises the router at zero: every token then ties across all experts and
            # topk picks by index. A small random router breaks the tie from the start.
            layer.mlp.gate.weight.normal_(0.0, config.initializer_range)
    return model


class RouterLogits:
    """Forward hooks on every router that keep its logits; ``balance_loss`` reads and clears."""

    def __init__(self, model, coef: float) -> None:
        self.logits: list[torch.Tensor] = []
        self.coef = coef
        self.num_experts = model.config.num_experts
        self.top_k = model.config.num_experts_per_tok
        routers = [layer.mlp.gate for layer in model.model.layers]
        self._routers = {id(r) for r in routers}
        self._hooks = [r.register_forward_hook(self._keep) for r in routers]

    def _keep(self, module, args, output) -> None:
        # A deep copy of the model (the trainer's throughput probe) copies the hooks too: keep
        # only this model's routers.
        if id(module) in self._routers:
            self.logits.append(output[0])  # [T, E]

    def balance_loss(self) -> torch.Tensor:
        """``coef`` times the mean over layers of each layer's own balancing term.

        HF's ``load_balancing_loss_func`` given every layer's logits at once balances their
        aggregate: each layer can then keep a few favourite experts as long as the layers favour
        different ones. An expert cache is per layer, so each layer is balanced on its own.
        """
        from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func

        k, e = self.top_k, self.num_experts
        terms = [load_balancing_loss_func((logits,), e, k) for logits in self.logits]
        self.logits.clear()
        return self.coef * torch.stack(terms).mean()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def train_moe_reference(
    out_dir: str | Path,
    *,
    minutes: float = 60.0,
    seed: int = 0,
    spec: MoEReferenceSpec | None = None,
    recipe: LayerSkipTrainConfig = MOE_REFERENCE_RECIPE,
    aux_coef: float = 0.01,
    steps: int | None = None,
    batch_size: int = 8,
    seq_len: int = 256,
    lr: float = 2e-3,
    threads: int | None = None,
    eval_tokens: int = 16384,
    resume: bool = True,
    progress: bool = True,
    device: str = "cpu",
    corpus_root: str | Path | None = None,
) -> dict:
    """Train the MoE reference model into ``out_dir/model`` within about ``minutes``.

    Resumable: calling it again on the same ``out_dir`` continues from the last checkpoint (a
    run stopped by its clock leaves a usable model flagged ``finished: false``). ``steps=None``
    sizes the run from a throughput probe.

    >>> report = train_moe_reference("runs/moe-reference", minutes=60)
    """
    if not minutes > 0:
        raise ValueError(f"minutes: got {minutes!r}; allowed range is minutes > 0")
    if not aux_coef >= 0:
        raise ValueError(f"aux_coef: got {aux_coef!r}; allowed range is aux_coef >= 0")
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    dev = resolve_device(device)
    corpus = reference_corpus(corpus_root)
    spec = spec or MoEReferenceSpec()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = byte_tokenizer()  # fixed ids: a resumed run needs nothing saved first
    setup = _set_up(
        "MoE reference", lambda tok: build_moe_model(spec, tok, seed), tokenizer, corpus,
        out_dir=out_dir, minutes=minutes, batch_size=batch_size, seq_len=seq_len, lr=lr,
        seed=seed, dev=dev,
    )  # fmt: skip
    model, final_dir = setup.model, setup.final_dir
    routers = RouterLogits(model, aux_coef)
    try:
        phase = _run_phase(
            model, setup.train_ids, out_dir=out_dir, base=setup.base, recipe=recipe, steps=steps,
            final_dir=final_dir, fallback_dir=final_dir,
            probe_steps=min(4, recipe.rotation_for(spec.num_layers)), max_warmup=100,
            checkpoints=12, deadline_s=minutes * 60.0 - setup.reserve_s, start=start,
            tokenizer=tokenizer, resume=resume, progress=progress, save_dtype="float16",
            name="moe-layerskip", aux_loss=routers.balance_loss,
        )  # fmt: skip
    finally:
        routers.remove()

    saved = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).to(dev).eval()
    exits = evaluate_exits(saved, setup.held_ids, seq_len=seq_len, max_tokens=eval_tokens,
                           byte_lengths=token_byte_lengths(tokenizer))  # fmt: skip
    windows = eval_windows(setup.held_ids, seq_len, min(eval_tokens, 8192))
    routing = routing_stats(saved, [w[None].to(dev) for w in windows])
    model_entry = _report_model("OlmoeForCausalLM", setup, "float16", spec, tokenizer)
    size = model_entry["weights_bytes"]
    report = {
        "model": model_entry,
        "training": {
            **_report_training(phase, recipe, dev),
            "aux_coef": aux_coef,
        },
        "held_out": {
            "tokens": exits.tokens,
            "loss_nats_per_token": exits.loss[exits.last],
            "bits_per_byte": exits.bits_per_byte,
        },
        "exits": {
            str(e): {"agreement_top1": exits.agreement[e], "loss_nats_per_token": exits.loss[e]}
            for e in sorted(exits.loss)
        },
        "routing": routing,
    }
    if size > 25 * 2**20:
        log.warning("MoE reference weights are %.1f MB, above the 25 MB target", size / 2**20)
    write_text_atomic(final_dir / REPORT_NAME, json.dumps(report, indent=2) + "\n")
    return report
