"""Fused and kernel-backed decoder layers: what ``FuseDecoderLayers`` and the CPU-kernel
lowering put in place of HF's modules.

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

The ``Kernel*`` modules (and ``RotaryTable``) run the same math on the ``leapfx_cpu`` kernels
(``leapfx.kernels.cpu``, ``cpu_attention``): the same numbers up to summation order; the
``Transposed*`` ones multiply by transposed weight copies (what the compiled CPU backend runs).
:func:`rms_params`, :func:`kernel_rope` and :func:`require_kernels` are shared with the other
kernel-backed modules (``leapfx.modules.m2r2``, ``m2r2_kernels``, ``moe``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels import cpu, cpu_attention
from ..kernels.cpu import pack_weight
from .blocks import BlockLinear
from .hf import expert_tensors

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


SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' SiLU modules


def _apply(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``: F.linear on a float weight, a BlockLinear's own kernel on blocks."""
    if isinstance(linear, BlockLinear):
        return linear(x)
    return F.linear(x, linear.weight, linear.bias)


def kernel_weight(owner: nn.Module, name: str, linears: list[nn.Module]) -> None:
    """The weight of ``linears`` (stacked by rows) for the kernels, as ``owner``'s buffer
    ``w_<name>``: packed float32 for ``leapfx_cpu::small_mm``, or, where every one holds GGUF
    blocks of one format, the blocks as they are (``owner._blocks_<name>``: the ggml type id
    and the parts' row counts, multiplied one by one: no copy of the file's bytes)."""
    if all(isinstance(p, BlockLinear) for p in linears) and len({p.fmt for p in linears}) == 1:
        ws = [p.weights for p in linears]
        for i, w in enumerate(ws):
            owner.register_buffer(f"w_{name}_{i}", w.data, persistent=False)
        setattr(owner, f"_blocks_{name}", (ws[0].type_id, tuple(w.n for w in ws), ws[0].k))
        return
    weight = torch.cat([p.weight.detach() for p in linears])
    owner.register_buffer(f"w_{name}", pack_weight(weight))
    setattr(owner, f"_blocks_{name}", None)


def kernel_mm(owner: nn.Module, name: str, x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``x`` times the weight ``kernel_weight`` stored as ``name``: one [..., n] product for
    a packed float weight, one per part (rows of q, k, v ...) for blocks."""
    blocks = getattr(owner, f"_blocks_{name}")
    if blocks is None:
        return [torch.ops.leapfx_cpu.small_mm(x, getattr(owner, f"w_{name}"), n)]
    fmt, rows, k = blocks
    return [
        torch.ops.leapfx_cpu.block_mm(x, getattr(owner, f"w_{name}_{i}"), fmt, r, k)
        for i, r in enumerate(rows)
    ]


def _kernel_attention_weights(owner: nn.Module, attn: nn.Module) -> None:
    """What ``KernelDecoderLayer`` and ``KernelAttention`` share: q, k and v packed side by side
    and the output projection packed (``leapfx_cpu::small_mm``), SDPA without ``repeat_kv``,
    ``leapfx_cpu::attention`` for plain causal attention where it builds, and the rotary as one
    op where it gives HF's values. ``owner`` is a FusedDecoderLayer or a FusedAttention."""
    require_kernels()
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    owner._split = [p.out_features for p in qkv]
    kernel_weight(owner, "qkv", qkv)
    biases = [p.bias for p in qkv]
    owner.register_buffer("b_qkv", None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else p.weight.new_zeros(p.out_features)
         for b, p in zip(biases, qkv, strict=True)]
    ))  # fmt: skip
    owner._o_out = attn.o_proj.out_features
    kernel_weight(owner, "o", [attn.o_proj])
    if attn.config._attn_implementation == "sdpa":
        owner._attention = _sdpa_gqa
    owner._kernel_attention = _plain_causal(attn, owner._attn_kwargs) and _attention_kernel()
    rope = owner._rope
    owner._rope = kernel_rope(rope)
    owner._rope_kernel = owner._rope is not rope  # leapfx_cpu::rope gives HF's values


def _kernel_qkv(owner: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v of ``h`` as one product over ``owner``'s packed weights (see above)."""
    parts = kernel_mm(owner, "qkv", h, sum(owner._split))
    if len(parts) == 3:  # blocks: q, k and v apart
        if owner.b_qkv is not None:
            parts = list(torch.cat(parts, dim=-1).add(owner.b_qkv).split(owner._split, dim=-1))
        return tuple(parts)
    out = parts[0]
    if owner.b_qkv is not None:
        out = out + owner.b_qkv
    return out.split(owner._split, dim=-1)


class KernelDecoderLayer(FusedDecoderLayer):
    """A fused layer whose projections run the ``leapfx_cpu`` small-M kernels (CPU, float32).

    Three kernel calls per layer: q, k and v as one product (their weights packed side by
    side), the output projection, and the gated MLP as one call (``gated_mlp``) when the
    activation is SiLU without biases (otherwise gate and up are one product, then the
    activation, then down). Plain causal attention (no sliding window, soft-capping or sinks)
    runs ``leapfx_cpu::attention`` over the cache at the layer's positions
    (``leapfx.kernels.cpu_attention``) where it builds, instead of SDPA behind a mask. Each
    weight is read once for all the rows of a verify pass (see ``leapfx.kernels.cpu``). The
    packed weights are copies made when the module is built, as in ``TransposedDecoderLayer``:
    the same math up to summation order.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer)
        mlp = layer.mlp
        _kernel_attention_weights(self, layer.self_attn)
        self._silu = type(mlp.act_fn).__name__ in SILU and all(
            getattr(mlp, p).bias is None for p in ("gate_proj", "up_proj", "down_proj")
        )
        # RMSNorms as one op each where they cover the model (see _rms_norm)
        self._norm_in = _rms_norm(layer.input_layernorm)
        self._norm_post = _rms_norm(layer.post_attention_layernorm)
        self._gate_up_out = mlp.gate_proj.out_features + mlp.up_proj.out_features
        self._down_out = mlp.down_proj.out_features
        kernel_weight(self, "gate_up", [mlp.gate_proj, mlp.up_proj])
        kernel_weight(self, "down", [mlp.down_proj])

    def _linear(self, x: torch.Tensor, module: nn.Linear, name: str) -> torch.Tensor:
        # Only o_proj reaches _linear here: q/k/v go through _qkv, the MLP through _mlp.
        (out,) = kernel_mm(self, "o", x, self._o_out)
        return out if module.bias is None else out + module.bias

    def _qkv(self, h: torch.Tensor, attn: nn.Module) -> tuple[torch.Tensor, ...]:
        return _kernel_qkv(self, h)

    def _mlp(self, h: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        ops = torch.ops.leapfx_cpu
        gu, down = self._blocks_gate_up, self._blocks_down
        if self._silu and gu is None and down is None:
            return ops.gated_mlp(h, self.w_gate_up, self._gate_up_out, self.w_down, self._down_out)
        if self._silu and gu is not None and down is not None:  # GGUF blocks
            return ops.block_gated_mlp(
                h, self.w_gate_up_0, self.w_gate_up_1, gu[0], gu[1][0], self.w_down_0, down[0],
                self._down_out,
            )  # fmt: skip
        parts = kernel_mm(self, "gate_up", h, self._gate_up_out)
        gate, up = parts if len(parts) == 2 else parts[0].chunk(2, dim=-1)
        gate = mlp.act_fn.forward(gate if mlp.gate_proj.bias is None else gate + mlp.gate_proj.bias)
        up = up if mlp.up_proj.bias is None else up + mlp.up_proj.bias
        (out,) = kernel_mm(self, "down", gate * up, self._down_out)
        return out if mlp.down_proj.bias is None else out + mlp.down_proj.bias


def _plain_causal(attn: nn.Module, attn_kwargs: dict) -> bool:
    """Whether ``attn`` is causal attention that ``leapfx_cpu::attention`` computes: HF's sdpa
    or eager implementation, no sliding window, no logit soft-capping, no attention sinks."""
    config = attn.config
    return (
        config._attn_implementation in ("sdpa", "eager")
        and attn_kwargs.get("sliding_window") is None
        and getattr(config, "sliding_window", None) is None
        and getattr(config, "attn_logit_softcapping", None) is None
        and not hasattr(attn, "sinks")
    )


def _attention_kernel() -> bool:
    return cpu_attention.available()


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF's sdpa attention without ``repeat_kv``: grouped heads through ``enable_gqa``.

    HF copies the cache's keys and values once per query group whenever a mask is given (every
    verify and prefill chunk); ``enable_gqa`` reads them in place (on a CPU: 21 against 48 us
    for 5 queries over 69 cached positions, equal results). Windows are in the mask, as in HF.
    """
    is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal, enable_gqa=query.shape[1] != key.shape[1],
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


class KernelLinear(nn.Module):
    """``linear`` through ``leapfx_cpu::small_mm`` on a packed weight copy."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        require_kernels()
        self.out_features = linear.out_features
        self.register_buffer("weight_packed", pack_weight(linear.weight))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.leapfx_cpu.small_mm(x, self.weight_packed, self.out_features)
        return out if self.bias is None else out + self.bias


class KernelAttention(FusedAttention):
    """An MoE layer's attention (``FusedAttention``) on ``KernelDecoderLayer``'s kernels: q, k
    and v as one ``small_mm`` over their packed weights, the output projection, the q/k
    RMSNorms and the rotary as one op each where they cover the model (``_rms_norm``,
    ``kernel_rope``), and ``leapfx_cpu::attention`` over the cache for plain causal attention.
    The same math as HF's module up to summation order."""

    def __init__(self, fused: FusedAttention) -> None:
        super().__init__(fused.attn)
        attn = self.attn
        _kernel_attention_weights(self, attn)
        if self._norm is not None:
            self._q_norm, self._k_norm = _rms_norm(attn.q_norm), _rms_norm(attn.k_norm)

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _kernel_qkv(self, h)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        (out,) = kernel_mm(self, "o", o, self._o_out)
        bias = self.attn.o_proj.bias
        return out if bias is None else out + bias


def experts_kernel_covers(module: nn.Module) -> bool:
    """Whether ``leapfx_cpu::moe_experts`` computes ``module`` (an HF ``<X>Experts``): fused
    ``gate_up_proj [E, 2I, H]`` ([gate | up] rows) and ``down_proj [E, H, I]`` in float32 on a
    CPU, no biases, SiLU gating, HF's default gate and no post-expert norm. Others run HF's."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return False
    # load_offloaded's modules hold meta tensors and read their experts from a checkpoint
    device = expert_tensors(module)[0].device
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    e, i2, h = gate_up.shape
    if i2 % 2 or tuple(down.shape) != (e, h, i2 // 2):
        return False
    if device.type != "cpu" or any(t.dtype != torch.float32 for t in (gate_up, down)):
        return False
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False,
             "is_concatenated": True, "has_post_expert_norm": False}  # fmt: skip
    if any(getattr(module, k, v) != v for k, v in flags.items()):
        return False
    # Lazy: transformers' MoE integration module, read only for a fused <X>Experts module.
    from transformers.integrations import moe

    gate = getattr(type(module), "_apply_gate", moe._default_apply_gate)
    return gate is moe._default_apply_gate and isinstance(
        getattr(module, "act_fn", None), (nn.SiLU, SiLUActivation)
    )


class KernelExperts(nn.Module):
    """An MoE layer's experts (HF ``<X>Experts``, see :func:`experts_kernel_covers`) as one
    ``leapfx_cpu::moe_experts`` call on the module's own weights: HF's math up to summation
    order, without HF's sort, histogram and grouped products, which cost a one-token call
    many times the products themselves (docs/benchmarks.md, "Why the defaults")."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        require_kernels()
        self.experts = experts

    def forward(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        e = self.experts
        return torch.ops.leapfx_cpu.moe_experts(
            hidden, top_k_index, top_k_weights.to(hidden.dtype), e.gate_up_proj, e.down_proj
        )


def rms_params(norm: nn.Module) -> tuple[torch.Tensor, float, float] | None:
    """``(weight, eps, offset)`` where ``norm.forward(x)`` equals ``F.rms_norm(x, (H,), weight +
    offset, eps)`` on a probe (Llama's ``weight * x / rms``: offset 0; Gemma's ``(1 + weight)``:
    offset 1), else None: what a fused op may compute instead of HF's seven ops."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    shape = (weight.shape[0],)
    probe = torch.randn(3, shape[0], generator=torch.Generator().manual_seed(0))
    probe = probe.to(weight.device, weight.dtype)
    with torch.no_grad():
        want = norm.forward(probe)
        for offset in (0.0, 1.0):
            w = weight.detach() + offset if offset else weight.detach()
            if torch.allclose(F.rms_norm(probe, shape, w, eps), want, rtol=1e-5, atol=1e-6):
                return weight, eps, offset
    return None


def _rms_norm(norm: nn.Module):
    """``norm.forward``, or where :func:`rms_params` finds it an
    RMSNorm: one ``leapfx_cpu::rms_norm`` call on float32 CPU inputs in eager code (HF's math up
    to summation order; seven ATen ops otherwise), one ``F.rms_norm`` (HF's values) when
    compiling or on other inputs."""
    found = rms_params(norm)
    if found is None:
        return norm.forward
    weight, eps, offset = found
    w = weight.detach() + offset if offset else weight.detach()
    shape = (weight.shape[0],)
    raw = weight.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.rms_norm(x, shape, w, eps)
        return torch.ops.leapfx_cpu.rms_norm(x, raw, eps, offset)

    return forward


def kernel_rope(rope):
    """HF's ``apply_rotary_pos_emb`` as one ``leapfx_cpu::rope`` call in eager code, where the
    op gives exactly its values on a probe (six ATen ops a call otherwise); ``rope`` itself
    when compiling, on other inputs, or where the probe differs (partial or interleaved
    rotary)."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen)
    cos, sin = torch.randn(1, 3, 16, generator=gen), torch.randn(1, 3, 16, generator=gen)
    try:
        want = rope(q, k, cos, sin)
        got = torch.ops.leapfx_cpu.rope(q, k, cos, sin)
        same = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    except Exception:  # another signature or shape rule: keep HF's
        same = False
    if not same:
        return rope

    def forward(q, k, cos, sin, *args, **kwargs):
        if (
            args or kwargs or torch.compiler.is_compiling() or cos.dim() != 3
            or q.dtype != torch.float32 or q.device.type != "cpu"
        ):  # fmt: skip
            return rope(q, k, cos, sin, *args, **kwargs)
        return torch.ops.leapfx_cpu.rope(q, k, cos, sin)

    return forward


class KernelRMSNorm(nn.Module):
    """An RMSNorm module as one op (:func:`_rms_norm`): built only where
    :func:`rms_params` finds it an RMSNorm on a probe."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self._forward = _rms_norm(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    @staticmethod
    def covers(norm: nn.Module) -> bool:
        return type(norm).__name__.endswith("RMSNorm") and rms_params(norm) is not None


class RotaryTable(nn.Module):
    """A rotary embedding module's (cos, sin) read from a table of every position below
    ``max_positions`` instead of computed per call (HF: ~10 ops, ~20 us a call on a CPU).

    Build with :meth:`of`, which returns None unless the table gives exactly the module's own
    values (checked at single positions and windows) and the rotary is static (no dynamic or
    long-rope scaling). A position at or past the table's end, or another dtype or device,
    falls back to the module. Eager stages only: a compiled graph computes its rotary inline.
    """

    def __init__(self, rotary: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.rotary = rotary
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, D]
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def of(cls, rotary: nn.Module, max_positions: int, dtype, device) -> RotaryTable | None:
        if getattr(rotary, "rope_type", "default") != "default" or max_positions < 1:
            return None
        try:
            with torch.no_grad():
                probe = torch.zeros(1, 1, 1, dtype=dtype, device=device)
                positions = torch.arange(max_positions, device=device)[None]
                cos, sin = rotary(probe, positions)
                table = cls(rotary, cos[0].contiguous(), sin[0].contiguous())
                step = max(1, max_positions // 64)
                for start, length in [(p, 1) for p in range(0, max_positions, step)] + [
                    (p, min(5, max_positions - p)) for p in range(0, max_positions, 4 * step)
                ]:
                    ids = positions[:, start : start + length]
                    want, got = rotary(probe, ids), table(probe, ids)
                    if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
                        return None
        except (TypeError, ValueError, RuntimeError, IndexError):
            return None  # another signature (e.g. a layer type argument) or output layout
        return table

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        if args or kwargs or x.dtype != self.cos.dtype or x.device != self.cos.device:
            return self.rotary(x, position_ids, *args, **kwargs)
        try:  # F.embedding raises on a position outside [0, max_positions)
            return F.embedding(position_ids, self.cos), F.embedding(position_ids, self.sin)
        except IndexError:
            return self.rotary(x, position_ids)


def require_kernels() -> None:
    if not cpu.available():
        raise RuntimeError("the leapfx_cpu kernels did not build here (see the warning above)")
