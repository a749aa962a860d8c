"""Quickstart: LayerSkip self-speculative decoding on a tiny random Llama.

    python examples/quickstart.py

Rewrites the model with the ``layerskip`` recipe, generates greedily, prints the draft/verify
metrics, and checks the output is token-identical to HuggingFace greedy ``generate``.
"""

import torch
import transformers

from leapfx import rewrite

config = transformers.LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
)  # fmt: skip
torch.manual_seed(0)
hf_model = transformers.LlamaForCausalLM(config).eval()
input_ids = torch.randint(0, 512, (1, 16))

model = rewrite.apply(hf_model, "layerskip", exit_layer=2, num_speculations=4)
out = model.generate(input_ids, max_new_tokens=64)
ref = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                        max_new_tokens=64)  # fmt: skip

m = model.last_metrics
print(f"acceptance rate {m.acceptance_rate:.3f}, mean accepted tokens {m.mean_accepted_tokens:.2f}")
print(f"CTAR(1..4) {[round(c, 2) for c in m.ctar_curve]}, {m.tokens_per_second:.0f} tokens/s")
print("identical to HF greedy:", torch.equal(out, ref))
