"""Eager CPU-kernel lowering (``lower(sm, "cpu_kernels")``): eager copies of the stages on the
``leapfx_cpu`` kernels.

``kernel_stages`` copies each stage with its fused layers' projections (``KernelDecoderLayer``,
``KernelLinear``; a layer over GGUF blocks as one call, ``BlockDecoderLayer``), an MoE layer's
attention and resident experts (``KernelAttention``, ``KernelExperts``), M2R2's fast layers and
SpecEE's exit checks on the kernels; its norms as one op each and its rotary read from a table
(``_eager_norms_and_rotary``); M2R2's gate stages as one op where one covers them
(``passes.kernel_gate``). Where only the attention kernel reads a stage's masks, the runner
builds none for the rows it takes (``mask_free``), and LayerSkip's greedy rounds draft through
one ``EagerChain`` call. ``with_transposed_weights`` is shared with the Inductor lowering
(``compile.py``), whose CPU stages multiply by transposed copies.

    >>> lower(sm, "cpu_kernels").cpu_kernels     # a float32 CPU model
    True
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from ..kernels import cpu
from ..modules.block_layer import kernel_decoder_layer
from ..modules.draft_vocab import KernelSubsetHead, SubsetLMHead
from ..modules.fused import (
    FusedAttention,
    FusedDecoderLayer,
    TransposedDecoderLayer,
    TransposedLinear,
)
from ..modules.kernel_layers import (
    KernelAttention,
    KernelDecoderLayer,
    KernelExperts,
    KernelLinear,
    KernelRMSNorm,
    RotaryTable,
    experts_kernel_covers,
)
from ..modules.m2r2 import AcceleratedLayer
from ..modules.m2r2_kernels import KernelAcceleratedLayer
from ..modules.specee import KernelLayerExit, LayerExit
from ..passes.kernel_gate import kernel_gate
from ..runtime.cache import StaticKVCache
from ..runtime.executor import mask_free
from .chain import chain_length, greedy_chain
from .stage_signature import POSITION_MASKS


def use_kernels(sm, enabled: bool):
    """``sm`` (an eager SpeculativeModel) with its stages on the kernels, or back on the plain
    eager stages; returns ``sm`` (``lower(sm, "cpu_kernels" | "eager")``,
    ``sm.use_cpu_kernels``). ValueError for a compiled model, or where the kernels cannot run."""
    if sm.backend != "eager":
        raise ValueError(
            f"use_cpu_kernels: the stages run on {sm.backend!r}; pass cpu_kernels= to "
            "compile() instead (allowed here: an eager SpeculativeModel)"
        )
    sm.set_executors(kernel_stages(sm) if enabled else None, "eager")
    if sm.offload is not None:  # an MoE model's offloaded experts: over the slots
        sm.offload.kernels = enabled
    return sm


def with_transposed_weights(
    stage: fx.GraphModule, shared: dict, *, kernels: bool = False
) -> fx.GraphModule:
    """A copy of ``stage`` whose fused layers and plain linear heads use transposed weights.

    ``shared`` maps original modules to their transposed versions, so that stages cut from
    one model hold one copy of each weight. Other modules (unfused layers, an adapter) stay.
    ``kernels``: multiply through the ``leapfx_cpu`` small-M kernels (KernelDecoderLayer,
    KernelLinear, KernelSubsetHead for a draft head over a vocabulary subset, and
    KernelAcceleratedLayer for M2R2's fast layers) instead of
    ``torch.matmul``, and run SpecEE's exit checks as one op each (KernelLayerExit).
    """
    layer_cls = kernel_decoder_layer if kernels else TransposedDecoderLayer
    linear_cls = KernelLinear if kernels else TransposedLinear
    gm = fx.GraphModule(stage, copy.deepcopy(stage.graph), class_name=type(stage).__name__)
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if type(module) is FusedDecoderLayer:
            make = layer_cls
            source = module.layer
        elif type(module) is torch.nn.Linear:
            make, source = linear_cls, module
        elif kernels and type(module) is AcceleratedLayer:  # M2R2's fast stream
            make, source = KernelAcceleratedLayer, module
        elif kernels and type(module) is SubsetLMHead:  # a draft head over N rows
            make, source = KernelSubsetHead, module
        elif kernels and type(module) is LayerExit:  # SpecEE's exit checks: one call each
            make, source = KernelLayerExit, module
        elif kernels and type(module) is FusedAttention:  # an MoE layer's attention
            make, source = KernelAttention, module
        elif kernels and experts_kernel_covers(module):  # an MoE layer's experts (resident)
            make, source = KernelExperts, module
        else:
            continue
        if source not in shared:
            shared[source] = make(source)
        target = f"leapfx_transposed.{node.target.replace('.', '_')}"
        gm.add_submodule(target, shared[source])
        node.target = target
    gm.graph.lint()
    gm.recompile()
    gm.meta.update(stage.meta)
    return gm


def kernel_stages(sm) -> dict[str, fx.GraphModule]:
    """Eager copies of ``sm``'s stages whose projections run the ``leapfx_cpu`` kernels.

    Raises ValueError when the model is not a float32 CPU model or the kernels did not build.
    """
    cpu.resolve(True, sm._layout.device, sm._layout.dtype)  # raises where they cannot run
    shared: dict = {}
    out = {}
    for name, stage in sm.stages.modules.items():
        converted = with_transposed_weights(stage, shared, kernels=True)
        converted = _eager_norms_and_rotary(converted, shared, sm)
        if _masks_read_by_kernels_only(converted):
            converted.mask_free = _mask_free
        # M2R2's exit gates: the whole stage as one op where it covers the model
        out[name] = kernel_gate(stage, converted) or converted
    length = chain_length(sm)
    if length and mask_free(out["draft"]) is not None:
        out["draft_chain"] = EagerChain(out["draft"], length, sm._layout.kinds)
    return out


class EagerChain(torch.nn.Module):
    """LayerSkip's d greedy draft steps as one executor call on eager kernel stages (the
    runner's ``draft_chain``, as ``CompiledChain`` is for compiled ones). A module over the
    draft stage, like the other eager executors.

    The steps are the draft stage's own forward calls without the runner around each (its
    timing, positions and mask bookkeeping: ~20 us of a ~0.7 ms draft step on the reference
    model). A one-token step of a stage whose masks only the attention kernel reads needs none
    (``mask_free``), so the tokens, exit states and cache writes are the d draft calls'.
    """

    builds_masks = True  # one-token steps of a mask-free stage: none to build

    def __init__(self, draft: fx.GraphModule, length: int, kinds: tuple[str, ...]) -> None:
        super().__init__()
        self.draft = draft
        self.chain_length = length
        self._masks = dict.fromkeys(kinds)

    def forward(
        self, *, cache: StaticKVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
        masks=None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        del masks
        forward = self.draft.forward  # a GraphModule has no hooks to run
        return greedy_chain(
            lambda ids, positions: forward(ids, positions, self._masks, cache),
            input_ids, position_ids, self.chain_length,
        )  # fmt: skip


def _masks_read_by_kernels_only(gm: fx.GraphModule) -> bool:
    """Whether every node that reads ``gm``'s masks is a kernel layer or attention that attends
    through ``leapfx_cpu::attention`` (plain causal attention): for rows where that kernel runs,
    the masks go unread, and the StageRunner need not build them (``_mask_free``)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.name not in POSITION_MASKS.values():
            continue
        for item in node.users:
            if item.op != "call_function" or item.target is not operator.getitem:
                return False  # the masks go somewhere whole
            for user in item.users:
                module = gm.get_submodule(user.target) if user.op == "call_module" else None
                if not isinstance(module, KernelDecoderLayer | KernelAttention):
                    return False
                if not module._kernel_attention:
                    return False
    return True


def _mask_free(start: int, length: int) -> bool:
    """Whether kernel layers attend to rows start..start+length-1 of one sequence through
    ``leapfx_cpu::attention`` (``fused._attend``), reading no mask: always, whatever the rows
    and the prefix. A kernel stage's ``mask_free``."""
    return True


ROTARY_TABLE_MAX = 4096  # positions a rotary table holds at most (2 x 4096 x head_dim floats)


def _eager_norms_and_rotary(gm: fx.GraphModule, shared: dict, sm) -> fx.GraphModule:
    """``gm`` (a kernel stage, edited in place) with its RMSNorm modules as one ATen op each
    (KernelRMSNorm) and its rotary embedding read from a table (RotaryTable), where each gives
    the HF module's own values; per-call ops that cost a one-token step as much as a layer's
    worth of products on a CPU. ``shared``: one replacement per original module."""
    lay = sm._layout
    config = getattr(sm._hf_model, "config", None)
    max_positions = min(getattr(config, "max_position_embeddings", 0) or 0, ROTARY_TABLE_MAX)
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        key = ("eager", module)
        if key not in shared:
            if KernelRMSNorm.covers(module):
                shared[key] = KernelRMSNorm(module)
            elif type(module).__name__.endswith("RotaryEmbedding"):
                shared[key] = RotaryTable.of(module, max_positions, lay.dtype, lay.device)
            else:
                shared[key] = None
        if shared[key] is None:
            continue
        target = f"leapfx_eager.{node.target.replace('.', '_')}"
        gm.add_submodule(target, shared[key])
        node.target = target
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
