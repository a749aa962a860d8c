"""``leapfx demo``: the whole flow on a tiny random Llama, checked against HF greedy.

Builds a small random model (no download), applies the ``layerskip`` recipe, generates, and
reports the draft/verify metrics and whether the output is token-identical to HF greedy. A random
model's early exit rarely agrees with its last layer, so acceptance is low here; the point is the
flow and the identity check. Real speedups need a model trained with early-exit loss.
"""

from __future__ import annotations

import torch
import transformers

from . import rewrite


def tiny_llama(seed: int = 0, layers: int = 8, vocab: int = 512) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def run_demo(
    *, seed: int = 0, exit_layer: int = 2, num_speculations: int = 4, max_new_tokens: int = 64,
    cpu_kernels: bool | None = None,
) -> dict:  # fmt: skip
    """Run the demo; returns a dict of results (``identical_to_hf_greedy`` among them).
    ``cpu_kernels``: as ``rewrite.apply``'s (None: auto)."""
    model = tiny_llama(seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=gen)
    sm = rewrite.apply(
        model, "layerskip", exit_layer=exit_layer, num_speculations=num_speculations,
        cpu_kernels=cpu_kernels,
    )  # fmt: skip
    with torch.inference_mode():
        ref = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    out = sm.generate(prompt, max_new_tokens=max_new_tokens)
    metrics = sm.last_metrics.as_dict()
    return {
        "recipe": "layerskip",
        "options": {"exit_layer": exit_layer, "num_speculations": num_speculations},
        "new_tokens": out.shape[1] - prompt.shape[1],
        "identical_to_hf_greedy": bool(torch.equal(out, ref)),
        "cpu_kernels": sm.cpu_kernels,
        **{k: metrics[k] for k in ("draft_calls", "verify_calls", "acceptance_rate",
                                   "mean_accepted_tokens", "ctar", "tokens_per_second")},
    }  # fmt: skip
