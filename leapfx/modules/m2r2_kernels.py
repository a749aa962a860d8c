"""M2R2 on the ``leapfx_cpu`` kernels: a fast layer's products, and whole stages as one call.

``KernelAcceleratedLayer``: a decoding copy of an ``AcceleratedLayer`` whose products run the
small-M kernels (``lower.cpu_kernels`` builds it); :func:`fused_op_layers` says whether fast
layers are ones a fused op (``leapfx.kernels.cpu_m2r2``) can run.
``KernelGate``: an ARLA exit gate stage of ``m2r2_exit`` as one ``leapfx_cpu::m2r2_gate`` call;
``KernelDraft``: ``m2r2``'s draft stage as the token's embedding and one
``leapfx_cpu::m2r2_draft`` call (the same fast stream, reading the round's earlier drafts'
fast keys, without the router). A gate stage is a few dozen small torch ops (~90 dispatches),
which on a CPU cost about as much as the slow layers an exit skips
(``leapfx.kernels.cpu_m2r2``). ``leapfx.passes.kernel_gate.kernel_gate`` recognises the stages
these modules replace and builds them where the op covers the model. The merged weights are
taken when a module is built: build it again after training (as ``KernelAcceleratedLayer``).
:func:`rope_table`, :func:`pack_fast_layers` and :func:`op_dims` pack what every
``leapfx_cpu::m2r2_*`` op reads (``leapfx.modules.moe.M2R2Prefetcher`` too).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import pack_weight
from ..kernels.cpu_m2r2 import pack_gate
from .draft_vocab import SubsetLMHead
from .kernel_layers import kernel_rope, require_kernels, rms_params
from .m2r2 import AcceleratedLayer, _rms
from .m2r2_scratch import FastScratch

_DYNAMIC_ROPE = ("dynamic", "longrope")  # inv_freq changes with the sequence: not a table


class KernelAcceleratedLayer(nn.Module):
    """A decoding copy of an AcceleratedLayer whose products run the ``leapfx_cpu`` kernels.

    A draft is a handful of one-row products a layer (the reference model: [1, 192] by
    [384, 192]), where MKL's per-call cost, not arithmetic, is the price; the slow layers
    already multiply through the small-M kernels (``KernelDecoderLayer``), so the drafter does
    too. The merged weights (LoRA and the gate folded in) are packed when it is built, as
    ``KernelDecoderLayer`` packs the host's: build it again after training. A norm that
    ``F.rms_norm`` reproduces (checked on a probe when built) runs as that one op instead of
    HF's seven. The same math as the layer up to summation order: drafts only propose, the
    slow stream decides, so decoding stays lossless.
    """

    def __init__(self, layer: AcceleratedLayer) -> None:
        super().__init__()
        require_kernels()
        self.layer = layer  # the trainable parameters stay shared
        w_qkv, b_qkv, w_o, b_o = layer._merged()
        self.register_buffer("w_qkv", pack_weight(w_qkv), persistent=False)
        self.register_buffer("w_o", pack_weight(w_o), persistent=False)
        self.register_buffer("w_down", pack_weight(layer.down.detach()), persistent=False)
        self.register_buffer("w_up", pack_weight(layer.up.detach()), persistent=False)
        self.b_qkv, self.b_o = b_qkv, b_o
        self._sizes = (w_qkv.shape[0], w_o.shape[0], layer.down.shape[0], layer.up.shape[0])
        host = layer.host
        self._norms = [_rms_norm(host.input_layernorm), _rms_norm(host.post_attention_layernorm)]
        self.rope = kernel_rope(layer._rope)  # HF's rotary as one op where it gives its values

    def forward(self, p, position_embeddings, position_ids, cache, scratch=None, *, ahead=False):
        return self.layer.step(
            p, position_embeddings, position_ids, cache, scratch, self, ahead=ahead
        )

    # The ops ``AcceleratedLayer.step`` calls.
    def norm_in(self, p):
        return self._norms[0](p)

    def qkv(self, x):
        out = torch.ops.leapfx_cpu.small_mm(x, self.w_qkv, self._sizes[0])
        return out if self.b_qkv is None else out + self.b_qkv

    def out(self, o):
        out = torch.ops.leapfx_cpu.small_mm(o, self.w_o, self._sizes[1])
        return out if self.b_o is None else out + self.b_o

    def rms(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """:func:`_rms` (OLMoE's full-width q/k norms) as one ``leapfx_cpu::rms_norm`` call on
        float32 CPU inputs in eager code: the same float32 math up to summation order."""
        if torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu":
            return _rms(x, weight, eps)
        return torch.ops.leapfx_cpu.rms_norm(x, weight, eps, 0.0)

    def low_rank_mlp(self, p):  # M_i
        mm = torch.ops.leapfx_cpu.small_mm
        h = F.silu(mm(self._norms[1](p), self.w_down, self._sizes[2]))
        return mm(h, self.w_up, self._sizes[3])


def _rms_norm(norm: nn.Module):
    """``norm.forward``, or one ``F.rms_norm`` where that gives the same values on a probe
    (:func:`rms_params`), weights taken now."""
    found = rms_params(norm)
    if found is None:
        return norm.forward
    weight, eps, offset = found
    w = weight.detach() + offset if offset else weight.detach()
    return partial(F.rms_norm, normalized_shape=(weight.shape[0],), weight=w, eps=eps)


def fused_op_layers(layers: list, same: tuple[str, ...]) -> bool:
    """Whether a fused CPU op (``leapfx.kernels.cpu_m2r2``) can run ``layers`` as the torch
    code does, as far as they all need: plain ``AcceleratedLayer`` modules in float32 on a
    CPU, equal in the attributes ``same``, whose host norms are RMSNorms (``rms_params``).
    Each op's caller checks what only it covers (q/k norms, clip, windows)."""
    first = layers[0]
    for m in layers:
        if type(m) is not AcceleratedLayer or any(getattr(m, a) != getattr(first, a) for a in same):
            return False
        if m.w_o.dtype != torch.float32 or m.w_o.device.type != "cpu":
            return False
        host = m.host
        if rms_params(host.input_layernorm) is None:
            return False
        if rms_params(host.post_attention_layernorm) is None:
            return False
    return True


def rope_table(rotary: nn.Module, head_dim: int) -> tuple[torch.Tensor, float] | None:
    """(inv_freq, attention_scaling) where ``rotary(x, t)`` is HF's default form
    ``cat(t * inv_freq, t * inv_freq).cos() * scaling`` (and sin) over the whole head, checked
    on probe positions; None otherwise (partial or dynamic rotary)."""
    inv = getattr(rotary, "inv_freq", None)
    scale = getattr(rotary, "attention_scaling", None)
    if getattr(rotary, "rope_type", "default") in _DYNAMIC_ROPE:
        return None
    if not isinstance(inv, torch.Tensor) or inv.dtype != torch.float32 or inv.dim() != 1:
        return None
    if not isinstance(scale, (int, float)) or 2 * inv.numel() != head_dim:
        return None
    positions = torch.tensor([[0, 1, 7, 1000]])
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    freqs = positions[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    want = (emb.cos() * scale, emb.sin() * scale)
    pairs = zip((cos, sin), want, strict=True)
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    return (inv.detach().contiguous(), float(scale)) if ok else None


def _bias(b: torch.Tensor | None, rows: int) -> torch.Tensor:
    return torch.zeros(rows) if b is None else b


def pack_fast_layers(layers, hidden: int) -> tuple[list[list], list[float], list[float]]:
    """The fast layers' part of a ``leapfx_cpu.m2r2_*`` op's inputs: per layer the merged
    ``[w_qkv, b_qkv, w_o, b_o, down, up, ln_in, ln_post]`` (:func:`cpu_m2r2.pack_gate`'s
    layout, absent biases as zeros), and the two RMSNorms' eps and weight offsets, in order."""
    packed, eps, offsets = [], [], []
    for m in layers:
        w_qkv, b_qkv, w_o, b_o = m._merged()
        ln_in = rms_params(m.host.input_layernorm)
        ln_post = rms_params(m.host.post_attention_layernorm)
        packed.append([w_qkv, _bias(b_qkv, w_qkv.shape[0]), w_o, _bias(b_o, hidden),
                       m.down, m.up, ln_in[0], ln_post[0]])  # fmt: skip
        eps += [ln_in[1], ln_post[1]]
        offsets += [ln_in[2], ln_post[2]]
    return packed, eps, offsets


def op_dims(layers, hidden: int, latent: int = 0, vocab: int = 0) -> list[int]:
    """A ``leapfx_cpu.m2r2_*`` op's ``dims``: layers, hidden, head dim, query and KV heads,
    MLP rank, router latent, vocabulary, then the kept KV heads and each query head's."""
    first = layers[0]
    return [len(layers), hidden, first.head_dim, len(first.q_heads), len(first.kv_heads),
            first.down.shape[0], latent, vocab, *first.kv_heads,
            *(int(x) for x in first.q_to_kv)]  # fmt: skip


class KernelGate(nn.Module):
    """The gate stage ``{logits, score} = gate(hidden, position_ids, cache)`` in one op call.

    Same numbers as the torch stage up to summation order (a test holds them to 1e-5; an exit
    decision may flip only for a score within that of the threshold)."""

    def __init__(self, rotary, layers, router, norm, head, *, fallback: nn.Module) -> None:
        super().__init__()
        self.fallback = fallback
        self.cache_layers = [m.cache_layer for m in layers]
        first = layers[0]
        inv_freq, rope_scale = rope_table(rotary, first.head_dim)
        # A SubsetLMHead (draft_vocab): the op computes its N rows' logits, put back at their
        # ids among -inf (``_vocab``) as the module does.
        self.subset = head if isinstance(head, SubsetLMHead) else None
        head_w = head.rows if self.subset is not None else head.weight
        hidden = head_w.shape[1]
        packed, eps, offsets = pack_fast_layers(layers, hidden)
        final = rms_params(norm)
        eps.append(final[1])
        offsets.append(final[2])
        latent = 0 if router is None else router.q.weight.shape[0]
        parts = [final[0]]
        for lin in () if router is None else (router.q, router.k, router.v, router.out):
            parts += [lin.weight, _bias(lin.bias, lin.weight.shape[0])]
        self.weights = pack_gate(packed, parts, (head_w, head.bias), inv_freq)
        self.dims = op_dims(layers, hidden, latent, head_w.shape[0])
        self.params = [rope_scale, float(first.scaling), *eps, *offsets]

    def forward(self, hidden, position_ids, cache):
        keys = getattr(cache, "keys", None)
        if (
            hidden.dtype != torch.float32
            or hidden.numel() != hidden.shape[-1]
            or (torch.is_grad_enabled() and hidden.requires_grad)
            or not isinstance(keys, list)
            or keys[self.cache_layers[0]].shape[0] != 1  # one sequence: the op reads batch row 0
        ):
            return self.fallback(hidden=hidden, position_ids=position_ids, cache=cache)
        kv = [t for s in self.cache_layers for t in (keys[s], cache.values[s])]
        # slow keys < t (the row's own: t)
        lengths = [cache.lengths[s] - 1 for s in self.cache_layers]
        score, logits = torch.ops.leapfx_cpu.m2r2_gate.default(
            hidden.contiguous(), position_ids.contiguous(), self.weights, self.dims,
            self.params, kv, lengths,
        )  # fmt: skip
        return {"logits": self._vocab(logits), "score": score}

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The op's logits over the whole vocabulary (a subset head's: -inf off its rows)."""
        return logits if self.subset is None else self.subset.spread(logits)


class KernelDraft(KernelGate):
    """M2R2's draft stage ``{logits, hidden} = draft(input_ids, position_ids, cache, scratch)``
    as the token's embedding plus one ``leapfx_cpu::m2r2_draft`` call.

    The op reads the slow keys of the verified positions and the round's earlier drafts' fast
    keys, and returns this draft's, which go into ``scratch`` both as the torch layers keep
    them (``scratch.kv``, so that any later call may take the torch path) and packed for the
    op (``scratch.packed``). Drafts only propose (the slow verify decides), so decoding stays
    lossless; the op's numbers equal the torch stage's up to summation order."""

    def __init__(self, embed, rotary, layers, router, norm, head, *, fallback) -> None:
        super().__init__(rotary, layers, router, norm, head, fallback=fallback)
        self.embed = embed
        self.kv_shape = (len(layers), 2, 0, len(layers[0].kv_heads), layers[0].head_dim)

    def forward(self, input_ids, position_ids, cache, scratch):
        keys = getattr(cache, "keys", None)
        if (
            type(scratch) is not FastScratch
            or input_ids.numel() != 1
            or not isinstance(keys, list)
            or keys[self.cache_layers[0]].shape[0] != 1
            or (torch.is_grad_enabled() and self.embed.weight.requires_grad)
        ):
            return self.fallback(
                input_ids=input_ids, position_ids=position_ids, cache=cache, scratch=scratch
            )
        hidden = self.embed(input_ids)
        if hidden.dtype != torch.float32:
            return self.fallback(
                input_ids=input_ids, position_ids=position_ids, cache=cache, scratch=scratch
            )
        earlier = scratch.packed
        drafted = len(scratch.kv.get(self.cache_layers[0], []))
        if earlier is None or earlier.shape[2] != drafted:
            earlier = self._packed(scratch, drafted)
        kv = [t for s in self.cache_layers for t in (keys[s], cache.values[s])]
        lengths = [cache.lengths[s] for s in self.cache_layers]  # every verified slow key
        logits, out, new = torch.ops.leapfx_cpu.m2r2_draft.default(
            hidden.contiguous(), position_ids.contiguous(), self.weights, self.dims,
            self.params, kv, lengths, earlier,
        )  # fmt: skip
        scratch.packed = torch.cat([earlier, new[:, :, None]], dim=2)
        for i, s in enumerate(self.cache_layers):
            scratch.kv.setdefault(s, []).append(
                (new[i, 0][None, :, None], new[i, 1][None, :, None])
            )
        return {"logits": self._vocab(logits), "hidden": out}

    def _packed(self, scratch: FastScratch, drafted: int) -> torch.Tensor:
        """The round's earlier fast keys/values as the op reads them: [L, 2, m, h_kv, D]."""
        if drafted == 0:
            return torch.zeros(self.kv_shape)
        per_layer = []
        for s in self.cache_layers:
            ks, vs = zip(*scratch.kv[s], strict=True)  # each [1, h_kv, 1, D]
            per_layer.append(torch.stack([torch.cat(ks, 2)[0], torch.cat(vs, 2)[0]]))
        return torch.stack(per_layer).transpose(2, 3).contiguous()  # [L, 2, m, h_kv, D]
