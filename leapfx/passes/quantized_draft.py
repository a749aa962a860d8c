"""A quantized copy of the model as its own draft (``qspec``; ML-SpecQD, arXiv 2503.13565).

``QuantizeDraft(fmt, head_fmt)`` puts, beside each module the graph calls that holds a linear
layer (a decoder layer, an MoE layer's attention or router, the head), a copy of it whose
linears are GGUF blocks of the model's own weights (``modules.blocks.quantized_copy``: Q8_0,
Q4_0 or Q4_1, the head in ``head_fmt``; norms, embeddings, biases and every other parameter
shared by reference), under ``leapfx_qdraft.<target>``; it records which copy stands for which
module on the graph (``gm.meta["leapfx.qdraft"]``) and changes no node. Linears whose input
size is not a multiple of 32 (no block holds them) stay float in the copy.

``qspec_stages`` cuts ``full`` (the float model) and ``draft``: ``full`` with each module
replaced by its copy, and without the decoder layers of ``skip`` (``skip_layers.SkipLayers``:
a second, cheaper level). The draft writes the cache of the layers it runs at the drafted
positions; the verify, one ``full`` call, writes every layer's there again
(``runtime.qspec``)::

    >>> gm = QuantizeDraft(fmt="Q8_0").run(capture(hf_model)).graph_module
    >>> sorted(qspec_stages(gm).modules)
    ['draft', 'full']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from ..modules.blocks import quantized_copy
from .base import GraphPass, PassResult
from .capture import ROLE
from .partition import Stages, full_stage
from .skip_layers import SkipLayers

QDRAFT = "leapfx.qdraft"  # gm.meta: {module target: its quantized copy's target}
QDRAFT_SIZE = "leapfx.qdraft_size"  # gm.meta: what the copy holds (see QuantizeDraft)
QDRAFT_SKIP = "leapfx.qdraft_skip"  # gm.meta: decoder layers the draft skips
PREFIX = "leapfx_qdraft"


@dataclass(frozen=True)
class QuantizeDraft(GraphPass):
    """Insert the quantized copies (see the module docstring); ``gm.meta[QDRAFT_SIZE]``: the
    linears quantized, their bytes as blocks and as float32, the formats."""

    name: ClassVar[str] = "quantize-draft"
    fmt: str = "Q8_0"
    head_fmt: str | None = None  # None: fmt
    skip: tuple[int, ...] = ()

    def run(self, gm: fx.GraphModule) -> PassResult:
        copies: dict[str, str] = {}
        count = nbytes = float_bytes = 0
        for node in gm.graph.nodes:
            if node.op != "call_module" or node.target in copies:
                continue
            module = gm.get_submodule(node.target)
            fmt = self.head_fmt or self.fmt if node.meta.get(ROLE) == "head" else self.fmt
            copy, n, b = quantized_copy(module, fmt)
            if not n:
                continue
            target = f"{PREFIX}.{node.target.replace('.', '_')}"
            gm.add_submodule(target, copy)
            copies[node.target] = target
            count, nbytes = count + n, nbytes + b
            float_bytes += sum(
                4 * m.weight.numel()
                for m, q in zip(module.modules(), copy.modules(), strict=True)
                if m is not q and hasattr(q, "blocks")
            )
        gm.meta[QDRAFT] = copies
        gm.meta[QDRAFT_SIZE] = {
            "linears": count, "bytes": nbytes, "float32_bytes": float_bytes,
            "format": self.fmt, "head_format": self.head_fmt or self.fmt,
        }  # fmt: skip
        gm.meta[QDRAFT_SKIP] = tuple(self.skip)
        return PassResult(gm, bool(copies), len(copies))


def quantized_stage(gm: fx.GraphModule) -> fx.GraphModule:
    """The ``draft`` stage: ``full_stage(gm)`` calling the quantized copies, without the
    decoder layers of ``gm.meta[QDRAFT_SKIP]``; its modules are ``gm``'s (shared)."""
    draft = full_stage(gm)
    copies = gm.meta[QDRAFT]
    for node in draft.graph.nodes:
        if node.op == "call_module" and node.target in copies:
            node.target = copies[node.target]
            draft.add_submodule(node.target, gm.get_submodule(node.target))
    draft.graph.lint()
    draft.recompile()
    skip = gm.meta.get(QDRAFT_SKIP, ())
    if skip:
        draft = SkipLayers(layers=skip).run(draft).graph_module
    draft.meta["leapfx.stage"] = "draft"
    draft.meta[QDRAFT_SIZE] = gm.meta[QDRAFT_SIZE]
    return draft


def qspec_stages(gm: fx.GraphModule) -> Stages:
    """``full`` (the float model) and ``draft`` (:func:`quantized_stage`)."""
    return Stages(modules={"full": full_stage(gm), "draft": quantized_stage(gm)})
