"""Llama-shaped models with random weights, for throughput runs without a trained model.

``leapfx bench --random-model SIZE`` times decoding on a model of a realistic shape without
downloading or training one. Random weights make acceptance meaningless (the exit heads of an
untrained model agree with its last layer by chance), so such a run times only the systems whose
speed does not depend on acceptance: ``hf_greedy``, ``hf_static`` and ``leapfx_autoregressive``
on each backend. Prompts are tokenized with the reference model's byte-level tokenizer (ids
below 259), which every size's vocabulary covers.

Sizes (untied input and output embeddings, SwiGLU MLP, RoPE; ``parameter_count`` counts them):

=======  ======  ======  =============  ============  =====  ===========
size     layers  hidden  heads (kv)     intermediate  vocab  parameters
=======  ======  ======  =============  ============  =====  ===========
tiny     4       64      4 (2)          128           512    for tests
0.5b     16      1536    12 (4)         4096          32000  ~0.50 B
1b       16      2048    32 (8)         8192          32000  ~1.10 B
=======  ======  ======  =============  ============  =====  ===========

``0.5b`` is the shape the GPU measurements of issue 17 used (16 layers, hidden 1536, 12/4
heads); ``1b`` is Llama-3.2-1B's shape with a 32k vocabulary.

>>> model, tokenizer = random_model("0.5b", device="cuda", dtype=torch.bfloat16)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from ..models import model_device, model_dtype
from ..train.data import byte_tokenizer


@dataclass(frozen=True)
class RandomModelSize:
    """The shape of a random Llama (head dim = hidden / heads)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000


RANDOM_MODELS = {
    "tiny": RandomModelSize(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512),
    "0.5b": RandomModelSize(layers=16, hidden=1536, heads=12, kv_heads=4, intermediate=4096),
    "1b": RandomModelSize(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192),
}


def random_config(size: str):
    """The ``transformers.LlamaConfig`` of a size in ``RANDOM_MODELS``.

    No EOS token: every run generates exactly ``max_new_tokens``, so tokens/s compare.
    """

    if size not in RANDOM_MODELS:
        raise ValueError(
            f"--random-model: {size!r} is invalid; allowed: {', '.join(RANDOM_MODELS)}"
        )
    s = RANDOM_MODELS[size]
    tok = byte_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.hidden // s.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    return config


def parameter_count(size: str) -> int:
    """Parameters of a size, counted on the meta device (no memory allocated)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(random_config(size))
    return sum(p.numel() for p in model.parameters())


def random_model(size: str, *, device: str | torch.device = "cpu", dtype=None, seed: int = 0):
    """A ``size`` Llama with random weights (``torch.manual_seed(seed)``; HF's initialisation),
    in ``dtype`` on ``device``, in eval mode, and the byte-level tokenizer of its prompts."""

    dev = model_device(device)
    dtype = model_dtype(dtype, dev)
    config = random_config(size)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval(), byte_tokenizer()
