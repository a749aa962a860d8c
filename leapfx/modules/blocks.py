"""Linear layers and embeddings whose weights stay GGUF blocks (``leapfx.kernels.cpu_blocks``).

A model loaded with ``weights="native"`` (``leapfx.models.load_model`` of a GGUF file) holds
its projections as :class:`BlockLinear` and its embedding as :class:`BlockEmbedding`: the file's
bytes (memory-mapped: the resident weights are about the file's size), multiplied by float32
activations through ``leapfx_cpu::block_mm``, whose weights are bitwise gguf's dequantized ones.
A tied head is a BlockLinear over the embedding's own blocks.

Code that needs a float weight (``module.weight``: HF paths without kernels, training, export,
the transposed copies of a compiled stage without kernels) gets it dequantized on demand: the
same floats, at float32's memory, logged once per module. ``forward`` never does: without the
kernels (another dtype or device, or no build) it dequantizes per call, and so it does under
an export or when a gradient flows to its input (the op has no backward).

    >>> lin = BlockLinear(blocks)               # a Blocks [n, k] weight
    >>> lin(x).shape == (*x.shape[:-1], blocks.n)
    True
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_blocks
from ..kernels.cpu_blocks import Blocks

log = logging.getLogger(__name__)


class _BlockWeight(nn.Module):
    """What BlockLinear and BlockEmbedding share: the blocks as a (non-persistent) buffer."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__()
        _kernels()  # built (first use) with the model, not inside a compiled stage's trace
        self.register_buffer("blocks", blocks.data, persistent=False)  # uint8 [n, row bytes]
        self.fmt = blocks.fmt
        self._shape = (blocks.n, blocks.k)
        self._said = False
        self._float: torch.Tensor | None = None  # the weight as floats, while float_weights holds

    @property
    def weights(self) -> Blocks:
        """The weight as :class:`Blocks` (no copy)."""
        return Blocks(self.blocks, self.fmt, *self._shape)

    @property
    def weight(self) -> torch.Tensor:
        """The weight dequantized to float32 ``[n, k]`` (a new tensor on each read, but
        inside :func:`float_weights`: its one tensor)."""
        if self._float is not None:
            return self._float
        if not self._said:
            self._said = True
            log.info(
                "leapfx: dequantizing a %s %s weight %s to float32 on demand (a path that "
                "needs float weights; the kernels read the blocks)", self.fmt,
                type(self).__name__, list(self._shape),
            )  # fmt: skip
        return dequantize(self.weights)


_KERNELS: list[bool] = []  # whether the block kernels built, once asked (see _kernels)


def _kernels() -> bool:
    """``cpu_blocks.available()``, remembered here as a plain value: a compiled stage reads it
    without calling a cached function (which dynamo warns about)."""
    if not _KERNELS:
        _KERNELS.append(cpu_blocks.available())
    return _KERNELS[0]


def dequantize(w: Blocks) -> torch.Tensor:
    """``w`` as float32: the kernels' own dequantization where they built, else torch's."""
    if w.data.device.type == "cpu" and _kernels():
        return torch.ops.leapfx_cpu.block_dequantize(w.data, w.type_id, w.n, w.k)
    return cpu_blocks.dequantize(w)


class BlockLinear(_BlockWeight):
    """``nn.Linear`` over a weight held as GGUF blocks. ``bias``: a float bias (shared with
    the float layer a quantized copy was made of: Qwen2's q, k and v); GGUF's projections
    have none in the architectures leapfx loads natively."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None) -> None:
        super().__init__(blocks)
        self.out_features, self.in_features = blocks.n, blocks.k
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting() or (torch.is_grad_enabled() and x.requires_grad):
            # an export (the weight a constant of the graph) or a gradient to x (training
            # inserted parts through the head): float weights, dequantized on demand
            return F.linear(x, self.weight.to(x.dtype), self.bias)
        if x.dtype == torch.float32 and x.device.type == "cpu" and _kernels():
            w = self.weights
            out = torch.ops.leapfx_cpu.block_mm(x, w.data, w.type_id, w.n, w.k)
            return out if self.bias is None else out + self.bias
        return F.linear(x, dequantize(self.weights).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class BlockEmbedding(_BlockWeight):
    """``nn.Embedding`` over GGUF blocks: the looked-up rows dequantized (exactly)."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__(blocks)
        self.num_embeddings, self.embedding_dim = blocks.n, blocks.k
        self.padding_idx = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_exporting():  # the table a constant of the graph, as BlockLinear's
            return F.embedding(ids, self.weight)
        w = self.weights
        if ids.device.type == "cpu" and _kernels():
            return torch.ops.leapfx_cpu.block_rows(w.data, w.type_id, w.n, w.k, ids.long())
        flat = ids.reshape(-1).long()
        return cpu_blocks.dequantize(w.rows(flat)).reshape(*ids.shape, w.k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"


@contextlib.contextmanager
def float_weights(*modules: nn.Module):
    """While open, every block module under ``modules`` holds its weight dequantized, one
    float32 tensor per blocks buffer (a tied head and its embedding share one): what an export
    takes as its graph's constants, instead of tracing the kernels' ops (which ONNX has no
    function for). Yields how many weights it dequantized; they are dropped on exit."""
    found = [m for root in modules for m in root.modules() if is_blocks(m)]
    floats: dict[int, torch.Tensor] = {}
    for m in found:
        key = m.blocks.data_ptr()
        if key not in floats:
            floats[key] = dequantize(m.weights)
        m._float = floats[key]
    if floats:
        log.info("leapfx: %d block weights dequantized to float32 for an export", len(floats))
    try:
        yield len(floats)
    finally:
        for m in found:
            m._float = None


def is_blocks(module: nn.Module) -> bool:
    """Whether ``module`` holds its weight as blocks (BlockLinear or BlockEmbedding)."""
    return isinstance(module, _BlockWeight)


def float_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with each block module's ``weight`` dequantized in: what a float
    copy of ``module`` (an inserted part that starts as a host layer) loads."""
    out = dict(module.state_dict())
    for name, sub in module.named_modules():
        if is_blocks(sub):
            out[f"{name}.weight" if name else "weight"] = sub.weight
    return out


def quantized_copy(module: nn.Module, fmt: str) -> tuple[nn.Module, int, int]:
    """``module`` with every ``nn.Linear`` inside it (itself included) whose input size is a
    multiple of 32 as a :class:`BlockLinear` over its weight quantized to ``fmt``
    (``cpu_blocks.quantize``; the bias shared): (the copy, linears quantized, their bytes).

    A copy only where something changed: the modules on the way to a quantized linear are
    shallow copies (their other children, parameters and buffers shared by reference), and a
    module without one is returned as it is. ``module`` itself is never changed.

        >>> draft, count, nbytes = quantized_copy(hf_layer, "Q8_0")
    """
    if type(module) is nn.Linear:  # (subclasses may compute more than x @ W.T + b)
        if module.in_features % cpu_blocks.WEIGHTS_PER_BLOCK:
            return module, 0, 0
        blocks = cpu_blocks.quantize(module.weight, fmt)
        return BlockLinear(blocks, module.bias), 1, blocks.nbytes
    children, count, nbytes = {}, 0, 0
    for name, child in module.named_children():
        new, n, b = quantized_copy(child, fmt)
        children[name], count, nbytes = new, count + n, nbytes + b
    if not count:
        return module, 0, 0
    clone = copy.copy(module)  # nn.Module's __dict__ copied: its dicts still the original's
    clone._modules = children
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone, count, nbytes
