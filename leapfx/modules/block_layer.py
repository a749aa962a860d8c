"""A kernel decoder layer over GGUF blocks as one call: ``BlockDecoderLayer``.

A native GGUF model's decode step (``leapfx.models.gguf_native``: every projection a
``BlockLinear``) runs ~10 kernel calls a layer through ``KernelDecoderLayer`` (the input norm,
q, k and v, the rotary, the cache write, attention, o, the residual, the post-attention norm,
the gated MLP, the residual) and the Python between them: on a 2-vCPU Xeon, ~1/3 of SmolLM2's
step outside the products themselves (docs/quantized.md). ``BlockDecoderLayer`` is that layer
with one ``leapfx_cpu::block_decoder_layer`` call where the op computes it: every step is the
computation of the op the eager layer calls for it, so the numbers (and the keys and values
written into the cache) are bitwise the per-op path's, tested over the block formats, 1..8
rows, prefills and a batch's ragged rows. It takes one sequence's rows on the runtime's static
cache (a step, a verify, a prefill) and a batch's rows on its ragged cache
(``runtime.rows.RowKVCache``, each row at its own fill length). Anywhere else (a compiled
stage, another cache, gradients, a layer with biases or q/k norms) it is
``KernelDecoderLayer``.

    >>> layer = kernel_decoder_layer(hf_layer)   # BlockDecoderLayer where q..down are blocks
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_blocks
from .blocks import BlockLinear
from .fused import PROJECTIONS
from .kernel_layers import KernelDecoderLayer, rms_params


def kernel_decoder_layer(layer: nn.Module) -> KernelDecoderLayer:
    """``layer`` (an HF decoder layer) on the kernels: a ``BlockDecoderLayer`` where every
    projection holds GGUF blocks, else a ``KernelDecoderLayer``."""
    projections = [getattr(getattr(layer, b), p) for b, p in PROJECTIONS.values()]
    if all(isinstance(p, BlockLinear) for p in projections):
        return BlockDecoderLayer(layer)
    return KernelDecoderLayer(layer)


class BlockDecoderLayer(KernelDecoderLayer):
    """``KernelDecoderLayer`` as one ``leapfx_cpu::block_decoder_layer`` call where that op
    computes it (see the module docstring); ``_whole``: the op's fixed arguments, or None."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        self._whole = self._whole_layer_args(layer)

    def _whole_layer_args(self, layer: nn.Module) -> tuple | None:
        """The arguments of ``leapfx_cpu::block_decoder_layer`` that do not change between
        calls, where that op computes this layer: every projection GGUF blocks (q, k and v of
        one format, no biases), SiLU gating, plain causal attention through the kernel, both
        norms RMSNorms and the rotary HF's (checked on probes). Else None."""
        attn = layer.self_attn
        norms = [rms_params(n) for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        qkv, o = self._blocks_qkv, self._blocks_o
        gu, down = self._blocks_gate_up, self._blocks_down
        if (
            None in (qkv, o, gu, down, *norms) or len(qkv[1]) != 3 or self.b_qkv is not None
            or attn.o_proj.bias is not None or not self._silu or self._qk_norm
            or not self._kernel_attention or not self._rope_kernel
            or not cpu_blocks.available()
        ):  # fmt: skip
            return None
        (w_in, eps_in, off_in), (w_post, eps_post, off_post) = norms
        return (
            w_in.detach(), eps_in, off_in, self.w_qkv_0, self.w_qkv_1, self.w_qkv_2, qkv[0],
            self.w_o_0, o[0], w_post.detach(), eps_post, off_post, self.w_gate_up_0,
            self.w_gate_up_1, gu[0], gu[1][0], self.w_down_0, down[0],
        )  # fmt: skip

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
    ) -> torch.Tensor:
        """The layer as one ``leapfx_cpu::block_decoder_layer`` call where it computes it
        (blocks, see ``_whole_layer_args``; one sequence's rows on a cache whose ``update``
        appends, or a batch's rows on a ragged cache whose ``update`` appends each row at its
        own length; eager code without gradients): the same numbers as the calls below it,
        bitwise."""
        whole = self._whole
        cache = past_key_values
        appends = getattr(cache, "appends", False)
        rows = not appends and getattr(cache, "appends_rows", False)
        cos, sin = position_embeddings if position_embeddings is not None else (None, None)
        if (
            whole is None or cache is None or position_ids is None or not (appends or rows)
            or (appends and position_ids.shape[0] != 1)
            or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and hidden_states.requires_grad)
            or hidden_states.dtype != torch.float32 or hidden_states.device.type != "cpu"
            or cos is None or cos.dim() != 3 or cos.dtype != torch.float32
            or cos.shape[0] != hidden_states.shape[0]
        ):  # fmt: skip
            return super().forward(
                hidden_states, attention_mask, position_embeddings, position_ids,
                past_key_values,
            )  # fmt: skip
        index = self.layer.self_attn.layer_idx
        scale = self.layer.self_attn.scaling
        if rows:  # each row's columns from its own fill length, as RowKVCache.update writes
            starts, first = cache.claim_rows(index, hidden_states.shape[1])
            return torch.ops.leapfx_cpu.block_decoder_layer(
                hidden_states, *whole, cache.keys[index], cache.values[index], 0, cos, sin,
                position_ids[0], scale, starts, first,
            )  # fmt: skip
        start = cache.lengths[index]
        end = start + hidden_states.shape[1]
        cache.check_room(end)
        out = torch.ops.leapfx_cpu.block_decoder_layer(
            hidden_states, *whole, cache.keys[index], cache.values[index], start, cos, sin,
            position_ids[0], scale,
        )  # fmt: skip
        cache.lengths[index] = end
        return out
