"""A tiny Llama as a GGUF file, written with the ``gguf`` package as llama.cpp's converter would
(q/k rows permuted for its rotary layout, a GPT-2 style byte-level BPE vocabulary, a chat
template), so tests can load a GGUF file without any download."""

from __future__ import annotations

import numpy as np
import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary() -> list[str]:
    """Special tokens, the 256 byte symbols of GPT-2's byte-level alphabet, then the merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [*SPECIALS, *bytes_to_unicode().values(), *(m.replace(" ", "") for m in MERGES)]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (HF's rotate-half layout -> interleaved pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def q6_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes for an [n, k] weight (k a multiple of 256; gguf's numpy code
    dequantizes K-quants but does not quantize them): 210 bytes a block of 256, ql (128) | qh
    (64) | int8 scales (16) | fp16 d, the scales and d small."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    raw[..., 192:208] = rng.integers(-8, 8, size=(n, k // 256, 16), dtype=np.int8).view(np.uint8)
    raw[..., 208:210] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw.reshape(n, -1)


def write_tiny_llama_gguf(path, model, *, quantized: bool = False, q6_k: str = "") -> None:
    """Write ``model`` (a tied-embedding HF Llama whose vocab is ``len(vocabulary())``) to
    ``path`` as a float32 GGUF file; ``quantized``: as SmolLM2's file is, the projections Q4_1
    and the embedding Q8_0 (norms float32); ``q6_k``: the GGUF name of one tensor written as
    random Q6_K blocks instead (a K-quant, which leapfx's kernels do not read)."""
    import gguf
    from gguf import quants

    def add(name: str, t: np.ndarray, kind: str = "F32") -> None:
        if name == q6_k:
            qt = gguf.GGMLQuantizationType.Q6_K
            w.add_tensor(name, q6_k_blocks(*t.shape, seed=len(name)), raw_dtype=qt)
            return
        if kind == "F32":
            w.add_tensor(name, np.ascontiguousarray(t))
            return
        qt = getattr(gguf.GGMLQuantizationType, kind)
        w.add_tensor(name, quants.quantize(np.ascontiguousarray(t), qt), raw_dtype=qt)

    c = model.config
    assert c.vocab_size == len(vocabulary()) and c.tie_word_embeddings
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(3 if quantized else 0)  # mostly Q4_1, or all float32
    tokens = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    add("token_embd.weight", sd["model.embed_tokens.weight"], "Q8_0" if quantized else "F32")
    add("output_norm.weight", sd["model.norm.weight"])
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            t = sd[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                t = _permute(t, c.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, c.num_key_value_heads)
            kind = "Q4_1" if quantized and "norm" not in gg else "F32"
            add(f"blk.{i}.{gg}.weight", t, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
