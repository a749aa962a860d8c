"""Where a kernel runs: Triton (compiled on CUDA, interpreted on CPU) or the torch reference.

Triton decides once per process, when ``triton`` is first imported, whether ``@triton.jit``
compiles (GPU) or interprets (``TRITON_INTERPRET=1``: NumPy on the host, slow, for testing):
its own library functions (``tl.max``, ``tl.cumsum``, ...) are built in that mode at import.
Setting the variable later has no effect, and mixing modes breaks (an interpreted kernel cannot
call a compiled ``tl.max``). So this module reads the mode from Triton itself rather than from
the environment, and builds our kernels in the same mode.

:func:`implementation` is the one dispatch rule every op uses:

- a CUDA tensor runs the Triton kernel (the interpreter copies it to the host when interpreting);
- a CPU tensor runs the Triton kernel only when Triton is interpreting, and the torch reference
  otherwise;
- without Triton (not installed: ``pip install -e '.[triton]'`` in leapfx's checkout) everything
  runs the reference.

Both implementations compute the same function, so the rule changes speed, not results (the tests
pin the few float-rounding ties where they may differ; each kernel's docstring names them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable
from typing import Literal

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
tl = None  # triton.language where Triton is installed; kernels are defined under `if HAS_TRITON:`
INTERPRETING = False

if HAS_TRITON:
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError as e:  # installed but unusable (e.g. a wheel for another platform)
        warnings.warn(f"triton is installed but fails to import ({e}); leapfx kernels run "
                      "their torch references", stacklevel=2)  # fmt: skip
        HAS_TRITON = False
    else:
        # tl.max is itself a @triton.jit function of Triton's standard library: its type tells
        # which mode Triton was imported in.
        INTERPRETING = isinstance(tl.max, InterpretedFunction)

Implementation = Literal["triton", "torch"]


def jit(fn: Callable) -> Callable:
    """``triton.jit`` in the mode Triton was imported in (see the module docstring)."""
    assert HAS_TRITON, "jit() is only called where triton is installed"
    return InterpretedFunction(fn) if INTERPRETING else JITFunction(fn)


def implementation(tensor: torch.Tensor) -> Implementation:
    """Which implementation an op runs for inputs on ``tensor``'s device.

    >>> implementation(torch.zeros(1)) in ("triton", "torch")
    True
    """
    if not HAS_TRITON:
        return "torch"
    if tensor.device.type == "cuda" or (tensor.device.type == "cpu" and INTERPRETING):
        return "triton"
    return "torch"


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``max(n, 1)`` (``tl.arange`` needs power-of-two lengths)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for a grid size."""
    return -(-a // b)


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``tensor``'s GPU current for a launch (Triton launches on the current device)."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def require(name: str) -> None:
    """RuntimeError naming ``name`` (a ``*_triton`` function) where triton is not installed."""
    if not HAS_TRITON:
        raise RuntimeError(f"{name} needs triton: pip install -e '.[triton]' in leapfx's checkout")


def accept_outputs(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance kernels' outputs, unfilled: ``(n_accepted [B], next_token [B])`` int64."""
    n_accepted = torch.empty(batch, dtype=torch.long, device=device)  # [B]
    next_token = torch.empty(batch, dtype=torch.long, device=device)  # [B]
    return n_accepted, next_token
