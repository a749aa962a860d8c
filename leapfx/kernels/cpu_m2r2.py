"""M2R2's ARLA exit gate as one C++ custom op for CPU decoding: ``leapfx_cpu::m2r2_gate``.

A gate of ``m2r2_exit`` (``passes.fast_partition.exit_stages``' ``gate_j``) runs for every
decoded token at every gate it reaches: the fast stream of one row through the interval's
accelerated layers, the ARLA router and the final norm + LM head. On the reference model that
is ~0.5M multiply-adds spread over ~90 torch dispatches, ~0.5 ms on a 2-core CPU: as much as
the four slow layers a token skips when it exits, which kept the exit from paying. The op does
the same arithmetic in one call (``cpu_m2r2.cpp`` says what, step by step);
``passes.kernel_gate.KernelGate`` puts it in the gate stages.

=============================  ==================================================================
op                             signature
=============================  ==================================================================
``leapfx_cpu::m2r2_gate``      ``(hidden [1, 1, H], position_ids, layers (10 tensors a layer),
                               lengths, kv_heads, q_to_kv, inv_freq, rope_scale, scaling,
                               router (9 tensors), head_w, head_b, eps, offsets)
                               -> (score [1, 1], logits [1, 1, V])``
=============================  ==================================================================

float32 only, one row. The numbers equal the torch gate's up to summation order (tests hold
them to 1e-5). Built like :mod:`leapfx.kernels.cpu`'s kernels (its own extension, first use).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import cpu

SOURCE = Path(__file__).with_name("cpu_m2r2.cpp")


@functools.cache
def available() -> bool:
    """True once ``leapfx_cpu::m2r2_gate`` is built and registered (built on the first call)."""
    if hasattr(torch.ops, "leapfx_cpu") and hasattr(torch.ops.leapfx_cpu, "m2r2_gate"):
        return True
    if not cpu.load_extension("m2r2", SOURCE, "using the torch gate"):
        return False

    @torch.library.register_fake("leapfx_cpu::m2r2_gate")
    def _fake(hidden, position_ids, layers, lengths, kv_heads, q_to_kv, inv_freq, rope_scale,
              scaling, router, head_w, head_b, eps, offsets):  # fmt: skip
        return hidden.new_empty((1, 1)), hidden.new_empty((1, 1, head_w.shape[0]))

    return True
