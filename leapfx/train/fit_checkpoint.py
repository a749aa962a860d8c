"""Resumable parts training: a checkpoint of a ``fit`` every N steps, and its restore.

A parts trainer (the EAGLE head's, Kangaroo's adapter's) draws every batch and every noise
sample from one seeded CPU generator, so a checkpoint holds, besides the trained module and the
optimizer, the generator's state: restored, the run takes exactly the steps an uninterrupted
run takes, and ends with the same parts (same seed, same machine and thread count)::

    <directory>/  module.safetensors     the trained module's state dict
                  optimizer.safetensors  the optimizer's state tensors
                  state.json             {"format", "step", "identity", "param_groups",
                                          "history"}
                  generator.safetensors  the CPU generator's state (uint8)

The directory is written under a temporary name and renamed into place, so a directory with the
final name is always complete. ``identity`` holds the options that change the run (the fit
config without its runtime fields): restoring a checkpoint made with others is refused.

``run_steps`` is the loop both trainers share: steps from the restored one on, a tqdm bar, a
checkpoint every ``checkpoint_every`` steps and when the wall-clock budget stops the run.

    >>> ckpt = FitCheckpoint("run/ckpt", head, optimizer, generator, identity={...})
    >>> first = ckpt.restore(result)        # 0 without a checkpoint
    >>> run_steps(result, step, first=first, config=config, desc="eagle head", checkpoint=ckpt)
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from tqdm.auto import tqdm

from leapfx.files import write_atomic
from leapfx.train.trainer import (
    _load_optimizer,
    _optimizer_tensors,
)

FORMAT = 1
# Fit options that change how a run is watched or stopped, not the steps it takes.
RUNTIME_FIELDS = frozenset({"progress", "max_minutes", "checkpoint_every"})


class FitCheckpoint:
    """The checkpoint of one ``fit`` run in ``directory`` (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
        *,
        identity: dict[str, Any],
    ) -> None:
        self.directory = Path(directory)
        self.module = module
        self.optimizer = optimizer
        self.generator = generator
        self.identity = json.loads(json.dumps(identity))  # as JSON reads it back

    def restore(self, result: Any) -> int:
        """Load the checkpoint (module, optimizer, generator) and the fields of ``result`` (a
        fit's result dataclass) from it; returns the step to continue at (0: no checkpoint)."""
        state_file = self.directory / "state.json"
        if not state_file.is_file():
            return 0
        state = json.loads(state_file.read_text())
        if state.get("format") != FORMAT:
            raise ValueError(
                f"checkpoint_dir: {str(self.directory)!r} has format {state.get('format')!r}; "
                f"this leapfx reads format {FORMAT}"
            )
        saved = state.get("identity", {})
        diffs = sorted(k for k in {*saved, *self.identity} if saved.get(k) != self.identity.get(k))
        if diffs:
            pairs = "; ".join(
                f"{k}: checkpoint {saved.get(k)!r} vs now {self.identity.get(k)!r}" for k in diffs
            )
            raise ValueError(
                f"checkpoint_dir: {str(self.directory)!r} was made with other options ({pairs}); "
                "allowed: the same options, or another (or an emptied) checkpoint directory"
            )
        missing, unexpected = load_model(self.module, str(self.directory / "module.safetensors"))
        assert not missing and not unexpected, (missing, unexpected)
        _load_optimizer(
            self.optimizer,
            load_file(str(self.directory / "optimizer.safetensors")),
            state["param_groups"],
        )
        gen = load_file(str(self.directory / "generator.safetensors"))["state"]
        self.generator.set_state(gen)
        for name, value in state["history"].items():
            setattr(result, name, value)
        return int(state["step"])

    def save(self, step: int, result: Any) -> Path:
        """Write the module, optimizer, generator and the fields of ``result`` at ``step``."""

        def fill(tmp: Path) -> None:
            save_model(self.module, str(tmp / "module.safetensors"))
            tensors, groups = _optimizer_tensors(self.optimizer)
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            save_file({"state": self.generator.get_state()}, str(tmp / "generator.safetensors"))
            state = {
                "format": FORMAT,
                "step": step,
                "identity": self.identity,
                "param_groups": groups,
                "history": dataclasses.asdict(result),
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")

        return write_atomic(self.directory, fill, folder=True)


def fit_identity(config: Any) -> dict[str, Any]:
    """The options of a fit config that change the steps a run takes (for ``identity``)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in RUNTIME_FIELDS}


def run_steps(
    result: Any,
    step: Callable[[], None],
    *,
    first: int,
    config: Any,
    desc: str,
    checkpoint: FitCheckpoint | None,
) -> None:
    """Call ``step()`` for the steps ``first..config.steps-1`` (it appends to ``result.losses``);
    stop early past ``config.max_minutes`` (when the config has it, > 0). With ``checkpoint``:
    save every ``config.checkpoint_every`` steps and where the run stops. Adds the wall time to
    ``result.seconds``."""
    budget = getattr(config, "max_minutes", 0.0) * 60.0
    every = getattr(config, "checkpoint_every", 0)
    start = time.perf_counter()
    before = result.seconds
    done = saved = first
    bar = tqdm(range(first, config.steps), initial=first, total=config.steps, desc=desc,
               disable=not config.progress)  # fmt: skip
    for _ in bar:
        step()
        done += 1
        bar.set_postfix(loss=f"{result.losses[-1]:.4f}")
        result.seconds = before + time.perf_counter() - start
        if checkpoint is not None and every and done % every == 0:
            checkpoint.save(done, result)
            saved = done
        if budget and time.perf_counter() - start > budget:
            break  # the wall-clock budget; the result says how many steps ran
    bar.close()
    result.seconds = before + time.perf_counter() - start
    if checkpoint is not None and done != saved:
        checkpoint.save(done, result)


def start_fit(
    module: nn.Module, config: Any, result: Any, checkpoint_dir: str | Path | None,
    identity: dict[str, Any],
) -> tuple[torch.optim.Optimizer, torch.Generator, FitCheckpoint | None, int]:  # fmt: skip
    """What every parts fit starts with: AdamW over ``module``'s parameters (``config.lr``,
    ``config.weight_decay``), a generator seeded with ``config.seed``, and with
    ``checkpoint_dir`` the run's checkpoint (``identity`` added to ``fit_identity(config)``)
    restored into ``result``. Returns (optimizer, generator, checkpoint, the first step)."""
    params = list(module.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    checkpoint = None
    if checkpoint_dir is not None:
        identity = {**fit_identity(config), **identity}
        checkpoint = FitCheckpoint(checkpoint_dir, module, optimizer, generator, identity=identity)
    first = checkpoint.restore(result) if checkpoint is not None else 0
    return optimizer, generator, checkpoint, first


def train_module(
    module: nn.Module, optimizer: torch.optim.Optimizer, result: Any, step: Callable[[], None],
    **run: Any,
) -> None:  # fmt: skip
    """``run_steps(result, step, **run)`` with ``module`` in training mode, put back in eval mode
    and its gradients dropped however the run ends."""
    module.train()
    try:
        run_steps(result, step, **run)
    finally:
        module.eval()
        optimizer.zero_grad(set_to_none=True)
