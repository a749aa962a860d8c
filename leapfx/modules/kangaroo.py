"""Kangaroo's adapter (sec. 3.1): the module ``InsertKangarooAdapter`` inserts.

The draft model is ``M^s = A o M^b[:l]``: the first ``l`` decoder layers of the host, then the
adapter ``A`` -- an input norm, ONE attention block of the host's own attention class (GQA as in
the host) with a residual connection around it, and a last norm (Table 2: "Input LN, Attention,
Last LN"; no FFN) -- then the host's OWN LM head (no new head). The residual follows the
authors' code (``h + attn(norm(h))``); the paper's text does not spell it out.
``leapfx.passes.adapter`` puts it in the graph; ``leapfx.train.kangaroo`` trains it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .blocks import float_state_dict
from .hf import cache_kwarg


class KangarooAdapter(nn.Module):
    """Kangaroo's adapter: ``output_norm(h + attention(input_norm(h)))`` (then the host's head).

    ``forward`` is the same computation the graph's ``adapter_*`` nodes run; training calls it
    directly (see ``leapfx.train.kangaroo``).
    """

    def __init__(
        self,
        input_norm: nn.Module,
        attention: nn.Module,
        output_norm: nn.Module,
        *,
        exit_layer: int,
        attn_kind: str,
    ) -> None:
        super().__init__()
        self.input_norm = input_norm
        self.attention = attention
        self.output_norm = output_norm
        self.exit_layer = exit_layer
        self.attn_kind = attn_kind  # which of the host's attention masks it reads

    @property
    def cache_layer(self) -> int:
        """The adapter attention's layer index in the shared KV cache."""
        return self.attention.layer_idx

    @classmethod
    def from_host(
        cls,
        layer: nn.Module,
        final_norm: nn.Module,
        *,
        exit_layer: int,
        cache_layer: int,
        attn_kind: str,
    ) -> KangarooAdapter:
        """An adapter initialised from the host's decoder layer ``exit_layer`` and final norm.

        Why copy layer l: the adapter maps the residual stream after layer l-1 to something the
        final norm and LM head can read, in place of layers l..L-1. Layer l's input norm and
        attention were trained to read exactly that residual stream, so the copy starts the
        draft as "the first half of layer l, then the model's own final norm and head" -- a
        truncated forward pass of the host (a LayerSkip-style early exit plus one attention),
        instead of random noise added to the residual stream. The last norm starts as a copy of
        the final norm because it feeds the same LM head. Copies, not references: the adapter
        trains, the host must not change.
        """
        src = layer.self_attn
        state = float_state_dict(src)  # GGUF blocks: their floats (the adapter trains)
        weight = next(iter(state.values()))
        # Built on the meta device, so no random init runs (it would advance the caller's RNG),
        # then materialised and filled with layer l's weights. layer_idx=exit_layer lets the
        # class read per-layer config (sliding window, layer type); the cache layer is set after.
        with torch.device("meta"):
            attention = type(src)(src.config, layer_idx=exit_layer)
        attention = attention.to(dtype=weight.dtype).to_empty(device=weight.device)
        if any(True for _ in attention.buffers()):
            raise ValueError(
                f"{type(src).__name__} has buffers; the Kangaroo adapter supports attention "
                "classes whose state is all parameters"
            )
        attention.load_state_dict(state)
        attention.layer_idx = cache_layer
        adapter = cls(
            copy.deepcopy(layer.input_layernorm),
            attention,
            copy.deepcopy(final_norm),
            exit_layer=exit_layer,
            attn_kind=attn_kind,
        )
        return adapter.train(layer.training)  # a new module starts in training mode

    def forward(
        self,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache=None,
    ) -> torch.Tensor:
        # hidden: [B, S, H], the residual stream after layer l-1 -> [B, S, H], ready for the head
        attn, _ = self.attention(
            self.input_norm(hidden),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{cache_kwarg(self.attention): cache},
        )
        return self.output_norm(hidden + attn)
