"""Fused decoder layers: what ``FuseDecoderLayers`` puts in place of HF's modules, and the base
of the kernel-backed ones the CPU-kernel lowering builds (``kernel_layers``).

In eager mode on a CPU, a small model's decode step is dominated by Python: an HF decoder layer
goes through ~14 ``nn.Module.__call__`` dispatches (norms, projections, activation, attention)
before any arithmetic. ``FusedDecoderLayer`` runs the same operations, in the same order, on the
same (shared) parameters, calling ``F.linear``, the norms' ``forward`` and HF's own rotary and
attention functions directly. The result is bitwise identical to the HF layer (the tests check
it for every architecture it handles); it is about a quarter faster per layer on a 2-core CPU.

It handles the Llama-shaped layers: Llama, Mistral, Qwen2, Qwen3 (q/k norms) and Gemma, the
dense layers of Qwen MoE models, and the attention of MoE layers (``FusedAttention``: Mixtral,
Qwen2/3-MoE, OLMoE). Other layers (Phi-3's fused projections) are left as they are.
Forward hooks registered on the HF layer do not fire for a fused layer.

The ``Transposed*`` modules multiply by transposed weight copies (what the compiled CPU backend
runs). The ``Kernel*`` modules (and ``RotaryTable``), which run the same math on the
``leapfx_cpu`` kernels (the same numbers up to summation order), are
``leapfx.modules.kernel_layers``'s; ``_attend`` here sends their attention to the kernel.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .blocks import BlockLinear

FUSABLE = frozenset(
    {
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
        "GemmaDecoderLayer",
        # Dense layers of MoE models (mlp_only_layers); their MoE layers are captured as
        # several nodes.
        "Qwen2MoeDecoderLayer",
        "Qwen3MoeDecoderLayer",
    }
)


def _attention_functions(attn: nn.Module):
    """The HF module's own rotary and the attention function its config selects."""
    module = sys.modules[type(attn).__module__]
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, module.eager_attention_forward
    )
    return module.apply_rotary_pos_emb, attention


def _attend(
    owner, attn, q, k, v, position_embeddings, past_key_values, attention_mask, shape,
    position_ids=None,
):  # fmt: skip
    """q, k, v [B, heads, S, D] (normed) -> rotary, cache update, attention: [*shape, heads * D]
    (``shape``: the input's [B, S]).

    ``owner`` holds ``_rope``, ``_attention`` and ``_attn_kwargs`` (a fused layer or attention),
    and ``_kernel_attention``: attend with ``leapfx_cpu::attention`` at ``position_ids`` (one
    sequence) over the cache, or ``leapfx_cpu::attention_rows`` over a batch's ragged rows
    (``RowKVCache.spans``), instead of the mask.
    """
    cos, sin = position_embeddings
    q, k = owner._rope(q, k, cos, sin)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, attn.layer_idx)
        if (
            owner._kernel_attention
            and position_ids is not None
            and position_ids.shape[0] == 1
            and not getattr(past_key_values, "ragged", False)
        ):
            # One sequence's rows, however many over however many keys: the kernel reads each
            # query's own prefix and shares each key's loads among a kv head's query rows, and
            # is as fast as SDPA or faster at every size measured (docs/benchmarks.md); a
            # compiled stage's rows over the whole buffer (the other choice there is masked
            # attention over every slot).
            out = torch.ops.leapfx_cpu.attention(q, k, v, position_ids[0], attn.scaling)
            return out.reshape(*shape, -1)  # [B, S, heads, D], contiguous
        if owner._kernel_attention and getattr(past_key_values, "ragged", False):
            # A batch's ragged rows (runtime.rows.RowKVCache, or a compiled stage's
            # RowSlotKVCache over the whole buffer): each row from its first real column to
            # each query's own.
            first, last = past_key_values.spans(attn.layer_idx, q.shape[2])
            out = torch.ops.leapfx_cpu.attention_rows(q, k, v, first, last, attn.scaling)
            return out.reshape(*shape, -1)
    out, _ = owner._attention(
        attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **owner._attn_kwargs
    )
    return out.reshape(*shape, -1).contiguous()


class FusedDecoderLayer(nn.Module):
    """The math of one HF decoder layer with its modules' dispatch stripped (weights shared)."""

    _kernel_attention = False  # see _attend

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        attn = layer.self_attn
        self._rope, self._attention = _attention_functions(attn)
        self._qk_norm = hasattr(attn, "q_norm")
        # Mistral reads the window from the config, Qwen2/3 from the module; the mask applies
        # it for sdpa/eager either way, but HF passes it on, and so do we.
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        self._attn_kwargs = {} if type(layer).__name__ == "LlamaDecoderLayer" else {
            "sliding_window": window
        }  # fmt: skip
        self._norm_in = layer.input_layernorm.forward
        self._norm_post = layer.post_attention_layernorm.forward

    def _linear(self, x: torch.Tensor, module: nn.Linear, name: str) -> torch.Tensor:
        if isinstance(module, BlockLinear):  # GGUF blocks: its own kernel
            return module(x)
        return F.linear(x, module.weight, module.bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
    ) -> torch.Tensor:
        layer = self.layer
        attn = layer.self_attn
        residual = hidden_states
        h = self._norm_in(hidden_states)
        input_shape = h.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)  # [B, S, heads, D]
        q, k, v = (t.view(hidden_shape) for t in self._qkv(h, attn))
        if self._qk_norm:
            q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        out = _attend(
            self, attn, q, k, v, position_embeddings, past_key_values, attention_mask,
            input_shape, position_ids,
        )  # fmt: skip
        hidden_states = residual + self._linear(out, attn.o_proj, "o")
        residual = hidden_states
        h = self._norm_post(hidden_states)
        return residual + self._mlp(h, layer.mlp)

    def _qkv(self, h: torch.Tensor, attn: nn.Module) -> tuple[torch.Tensor, ...]:
        q = self._linear(h, attn.q_proj, "q")
        return q, self._linear(h, attn.k_proj, "k"), self._linear(h, attn.v_proj, "v")

    def _mlp(self, h: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        gate = mlp.act_fn.forward(self._linear(h, mlp.gate_proj, "gate"))
        up = self._linear(h, mlp.up_proj, "up")
        return self._linear(gate * up, mlp.down_proj, "down")


class FusedAttention(nn.Module):
    _kernel_attention = False  # see _attend

    """An MoE layer's ``attention`` node: HF's self-attention math without module dispatch.

    Capture splits an MoE decoder layer into several nodes (see capture.py), so the layer cannot be
    fused whole; its attention can. The same operations in the same order on the same (shared)
    weights as the HF attention module: per-head q/k norms (Qwen3-MoE), full-width q/k norms
    and ``clip_qkv`` (OLMoE). Returns ``(output, None)`` like the HF module.
    """

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self._rope, self._attention = _attention_functions(attn)
        norm = getattr(attn, "q_norm", None)
        # OLMoE normalises the whole projection before splitting heads; Qwen3-MoE each head.
        self._norm = None if norm is None else (
            "head" if norm.weight.shape[-1] == attn.head_dim else "full"
        )  # fmt: skip
        self._clip = getattr(attn.config, "clip_qkv", None)
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        self._attn_kwargs = {"sliding_window": window}
        if norm is not None:
            self._q_norm, self._k_norm = attn.q_norm.forward, attn.k_norm.forward

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attn = self.attn
        return tuple(_apply(p, h) for p in (attn.q_proj, attn.k_proj, attn.v_proj))

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return _apply(self.attn.o_proj, o)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
    ) -> tuple[torch.Tensor, None]:
        attn = self.attn
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)  # [B, S, heads, D]
        q, k, v = self._qkv(hidden_states)
        if self._norm == "full":
            q, k = self._q_norm(q), self._k_norm(k)
        if self._clip is not None:
            q, k, v = (t.clamp(min=-self._clip, max=self._clip) for t in (q, k, v))
        q, k, v = q.reshape(hidden_shape), k.reshape(hidden_shape), v.reshape(hidden_shape)
        if self._norm == "head":
            q, k = self._q_norm(q), self._k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        out = _attend(
            self, attn, q, k, v, position_embeddings, past_key_values, attention_mask,
            input_shape, position_ids,
        )  # fmt: skip
        return self._out(out), None


FUSABLE_ATTENTION = frozenset(
    {"MixtralAttention", "Qwen2MoeAttention", "Qwen3MoeAttention", "OlmoeAttention"}
)


PROJECTIONS = {
    "q": ("self_attn", "q_proj"),
    "k": ("self_attn", "k_proj"),
    "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"),
    "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}


class TransposedDecoderLayer(FusedDecoderLayer):
    """A fused layer whose projections multiply by a transposed, contiguous weight copy.

    ``x @ W.T`` from a ``[in, out]`` contiguous copy is what the compiled CPU backend runs:
    MKL's small-row products are faster this way than through ``F.linear``'s ``[out, in]``
    weight (docs/benchmarks.md, "Why the defaults"). The copies are buffers of this module: the
    same math up to summation order (not bitwise equal to the HF layer), at the cost of one more
    copy of the layer's weights, taken when the module is built (later in-place training is not
    seen; rebuild it).
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        for name, (block, proj) in PROJECTIONS.items():
            linear = getattr(getattr(layer, block), proj)
            self.register_buffer(f"w_{name}", linear.weight.detach().t().contiguous())

    def _linear(self, x: torch.Tensor, module: nn.Linear, name: str) -> torch.Tensor:
        out = torch.matmul(x, getattr(self, f"w_{name}"))
        return out if module.bias is None else out + module.bias


class TransposedLinear(nn.Module):
    """``linear`` (no bias, e.g. the LM head) through a transposed contiguous weight copy."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight_t)
        return out if self.bias is None else out + self.bias


def fusable(layer: nn.Module) -> bool:
    dense = hasattr(getattr(layer, "mlp", None), "gate_proj")
    return type(layer).__name__ in FUSABLE and dense and not layer.training


def _apply(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``: F.linear on a float weight, a BlockLinear's own kernel on blocks."""
    if isinstance(linear, BlockLinear):
        return linear(x)
    return F.linear(x, linear.weight, linear.bias)
