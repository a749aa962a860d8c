"""Input checks shared by the ops' real and fake implementations.

They run on fake tensors too (``register_fake``), so they only read shapes, dtypes and devices,
never values: a value check would be a host sync on the GPU.
"""

from __future__ import annotations

import torch


def check_integer(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (token ids); got dtype {t.dtype}")


def check_floating(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = ()) -> None:
    if not t.is_floating_point() or (allowed and t.dtype not in allowed):
        names = ", ".join(str(d) for d in allowed) if allowed else "a floating dtype"
        raise ValueError(f"{name} must have dtype {names}; got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"inputs must be on one device; got {devices}")


def check_draft(draft_tokens: torch.Tensor, target: torch.Tensor, target_name: str) -> None:
    """``draft_tokens [B, d]`` (integer) against ``target [B, d+1, V]`` with ``V >= 1``."""
    check_integer("draft_tokens", draft_tokens)
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"draft_tokens must be [B, d] and {target_name} [B, d+1, V]; got "
            f"{tuple(draft_tokens.shape)} and {tuple(target.shape)}"
        )
    B, d = draft_tokens.shape
    if target.shape[0] != B or target.shape[1] != d + 1 or target.shape[2] < 1:
        raise ValueError(
            f"{target_name} must be [B, d+1, V] = [{B}, {d + 1}, V >= 1] for draft_tokens "
            f"{tuple(draft_tokens.shape)}; got {tuple(target.shape)}"
        )
