"""Decode-step kernels: each a torch reference plus a Triton implementation, as one custom op.

Every kernel is registered with ``torch.library.custom_op`` in the ``leapfx`` namespace, with a
fake implementation (``register_fake``), so ``torch.compile(fullgraph=True)``, Inductor and
``torch.export`` keep it as one opaque node instead of graph-breaking on the Triton launch:

=================================  ===============================================================
op                                 signature
=================================  ===============================================================
``leapfx::greedy_accept``          ``(draft_tokens [B, d] int, target_logits [B, d+1, V])
                                   -> (n_accepted [B] int64, next_token [B] int64)``
``leapfx::speculative_accept``     ``(draft_tokens [B, d] int, draft_probs [B, d, V],
                                   target_probs [B, d+1, V], u_accept [B, d], u_sample [B])
                                   -> (n_accepted [B] int64, next_token [B] int64)``
``leapfx::subset_logits``          ``(hidden [B, H], weight [V, H], indices [K] int)
                                   -> (logits [B, K] float32, probs [B, K] float32)``
=================================  ===============================================================

The acceptance ops compute exactly the rules of :mod:`leapfx.kernels.reference` (their torch
references *are* those functions), on device and without a host sync. Which implementation runs is
one rule, :func:`implementation`: Triton for CUDA tensors, and for CPU tensors when Triton was
imported with ``TRITON_INTERPRET=1`` (the interpreter: slow, for testing); the torch reference
otherwise, including whenever Triton is not installed (``pip install -e '.[triton]'`` in leapfx's
checkout).

>>> import torch, leapfx.kernels
>>> torch.ops.leapfx.greedy_accept(torch.tensor([[2]]), torch.eye(3)[[2, 0]][None])
(tensor([1]), tensor([0]))
"""

from __future__ import annotations

from leapfx.kernels._triton import HAS_TRITON, INTERPRETING, implementation
from leapfx.kernels.greedy import greedy_accept, greedy_accept_reference, greedy_accept_triton
from leapfx.kernels.speculative import (
    speculative_accept,
    speculative_accept_reference,
    speculative_accept_triton,
)
from leapfx.kernels.subset import (
    subset_logits,
    subset_logits_reference,
    subset_logits_triton,
)

__all__ = [
    "HAS_TRITON",
    "INTERPRETING",
    "greedy_accept",
    "greedy_accept_reference",
    "greedy_accept_triton",
    "implementation",
    "speculative_accept",
    "speculative_accept_reference",
    "speculative_accept_triton",
    "subset_logits",
    "subset_logits_reference",
    "subset_logits_triton",
]
