"""The ``leapfx_cpu`` kernel versions of the fused layers: what ``lower(sm, "cpu_kernels")`` and
the fast eager stages put in place of HF's modules (CPU, float32 or GGUF blocks).

``KernelDecoderLayer`` and ``KernelAttention`` are ``FusedDecoderLayer`` and ``FusedAttention``
(``leapfx.modules.fused``) with their products on the small-M kernels (``leapfx.kernels.cpu``):
q, k and v as one product over weights packed side by side, the gated MLP as one call, plain
causal attention as ``leapfx_cpu::attention`` (``cpu_attention``). ``KernelLinear``,
``KernelExperts`` (an MoE layer's experts as one ``leapfx_cpu::moe_experts`` call),
``KernelRMSNorm`` and ``RotaryTable`` (the rotary read from a table) replace single modules.
All compute HF's math up to summation order; each is built only where a probe or a check of
the module says the kernel covers it.

:func:`rms_params`, :func:`kernel_rope`, :func:`kernel_weight`, :func:`kernel_mm` and
:func:`require_kernels` are shared with the other kernel-backed modules (``block_layer``,
``m2r2_kernels``, ``moe``, ``draft_vocab``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import SiLUActivation

from ..kernels import cpu, cpu_attention
from ..kernels.cpu import pack_weight
from .blocks import BlockLinear
from .fused import FusedAttention, FusedDecoderLayer
from .hf import expert_tensors

SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' SiLU modules


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
