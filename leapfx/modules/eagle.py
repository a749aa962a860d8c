"""EAGLE's draft head: the module ``InsertEagleHead`` inserts.

``layer(fc(cat(embed(x_t), h_{t-1})))``, then the host's final norm and LM head: one decoder
layer (a copy of a host layer) over the embedding of the token and the target's last-layer
feature of the previous position. ``leapfx.passes.eagle_head`` puts it in the graph and cuts its
stages; ``leapfx.train.eagle`` trains it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .blocks import float_state_dict
from .hf import cache_kwarg


class EagleHead(nn.Module):
    """EAGLE's draft head: ``layer(fc(cat(embed(x_t), h_{t-1})))`` (then the host's norm, head).

    ``forward`` is the computation of the graph's ``eagle_fc`` and ``eagle_layer`` nodes;
    training calls it directly (``leapfx.train.eagle``).
    """

    def __init__(self, fc: nn.Linear, layer: nn.Module, *, init_layer: int, attn_kind: str):
        super().__init__()
        self.fc = fc
        self.layer = layer
        self.init_layer = init_layer  # the host layer the decoder layer was copied from
        self.attn_kind = attn_kind  # which of the host's attention masks it reads

    @property
    def cache_layer(self) -> int:
        """The head attention's layer index in the shared KV cache."""
        return self.layer.self_attn.layer_idx

    @classmethod
    def from_host(
        cls, layer: nn.Module, *, init_layer: int, cache_layer: int, attn_kind: str
    ) -> EagleHead:
        """A head whose decoder layer is a copy of the host's layer ``init_layer``.

        Why a copy of a host layer (the last one by default) rather than EAGLE's random init:
        the head maps a last-layer state plus a token to the next last-layer state, and the
        last layer's norms, attention and MLP were trained on residual streams at exactly that
        depth; starting there trains in minutes instead of hours. ``fc`` starts as
        ``[I | I]`` (embedding plus previous state), so the copied layer first sees a residual
        stream of the usual scale that carries both. Copies, not references: the head trains,
        the host must not change.
        """
        held = [n for n, p in layer.named_parameters() if p.is_meta]
        if held:
            raise ValueError(
                f"init_layer: the host layer {init_layer}'s {held[0]} is in the checkpoint only "
                "(leapfx.offload.load_offloaded), and the EAGLE head starts as a copy of "
                "that layer; allowed: a model loaded with its weights (e.g. from_pretrained)"
            )
        weight = next(layer.parameters())
        config = layer.self_attn.config
        # Built on the meta device (no random init, the caller's RNG is untouched), then filled
        # with the host layer's weights. layer_idx=init_layer lets the class read per-layer
        # config (sliding window, layer type); the attention's cache layer is set after.
        with torch.device("meta"):
            fresh = _decoder_layer_class(layer)(config, layer_idx=init_layer)
            fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        fresh = fresh.to(dtype=weight.dtype).to_empty(device=weight.device)
        if any(True for _ in fresh.buffers()):
            raise ValueError(
                f"{type(layer).__name__} has buffers; the EAGLE head supports decoder layers "
                "whose state is all parameters"
            )
        fresh.load_state_dict(float_state_dict(layer))  # GGUF blocks: their floats
        fresh.self_attn.layer_idx = cache_layer
        fc = fc.to(dtype=weight.dtype).to_empty(device=weight.device)
        with torch.no_grad():
            eye = torch.eye(config.hidden_size, dtype=weight.dtype, device=weight.device)
            fc.weight.copy_(torch.cat([eye, eye], dim=1))
            fc.bias.zero_()
        head = cls(fc, fresh, init_layer=init_layer, attn_kind=attn_kind)
        return head.train(layer.training)

    def forward(
        self,
        prev_hidden: torch.Tensor,
        embeds: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        # prev_hidden: [B, S, D] (h_{t-1}), embeds: [B, S, D] (embed(x_t)) -> g: [B, S, D]
        x = self.fc(torch.cat([embeds, prev_hidden], dim=-1))
        return self.layer(
            x,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            **{cache_kwarg(self.layer): cache},
        )


def _decoder_layer_class(layer: nn.Module) -> type[nn.Module]:
    """The HF decoder-layer class of ``layer``: its own, or for an MoE layer (which capture
    holds as a plain container of its submodules, ``layer_module``) the ``*DecoderLayer`` class of
    its attention's modeling module."""
    if type(layer) is not nn.Module:
        return type(layer)
    module = sys.modules[type(layer.self_attn).__module__]
    found = [c for name, c in vars(module).items()
             if name.endswith("DecoderLayer") and isinstance(c, type)
             and issubclass(c, nn.Module) and c.__module__ == module.__name__]  # fmt: skip
    if len(found) != 1:
        raise ValueError(
            f"the host layer's decoder-layer class: {len(found)} candidates in "
            f"{module.__name__}; allowed: exactly one *DecoderLayer class"
        )
    return found[0]
