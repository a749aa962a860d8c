"""The recipe as the runtime sees it: what a ``SpeculativeModel`` is handed about the recipe
that built it.

:class:`RecipeInfo` (its name, options, schedule, lookahead, capabilities, batch plan and a
factory of its training hook) is what ``rewrite.apply`` builds from the recipe table
(``leapfx.recipes``) and hands the model; :data:`Schedule` is the shape of a decode loop of
``schedules.py``; :class:`RecipeTraining` the shape of a trainer (``leapfx.train``), which the
recipes name and the model calls for ``fit`` and ``save_parts``. They live beside the model,
not in it, so that the recipes and the trainers name them without the model's machinery.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .batch import BatchPlan
from .capabilities import Capabilities
from .metrics import DecodeMetrics
from .runner import StageRunner
from .schedules import DecodeRequest

if TYPE_CHECKING:
    from .model import SpeculativeModel

# A schedule: (runner, prompt [1, n], request, metrics) -> new token ids.
Schedule = Callable[[StageRunner, torch.Tensor, DecodeRequest, DecodeMetrics], list[int]]


class RecipeTraining(Protocol):
    """How a recipe trains and saves the parts its passes inserted (e.g. Kangaroo's adapter)."""

    def fit(self, model: SpeculativeModel, data: Any, **options: Any) -> Any: ...

    def save(self, model: SpeculativeModel, path: Any) -> Any: ...


@dataclass(frozen=True)
class RecipeInfo:
    """What a SpeculativeModel needs to know about the recipe that built it."""

    name: str
    options: Any  # the recipe's frozen options dataclass
    schedule: Schedule
    lookahead: int  # positions a schedule may write past the last emitted token
    extra_cache_layers: int = 0  # KV-cache layers for attention blocks the rewrite added
    lossless: bool = True  # token-identical to greedy; lossy recipes support teacher forcing
    # Trains/saves what the recipe inserted; a factory so that decoding never imports training.
    training: Callable[[], RecipeTraining] | None = None
    # What its stages lower to (Inductor, ONNX, a draft chain ...): asked, never name-checked.
    capabilities: Capabilities = field(default_factory=Capabilities)
    # How it drafts in a batch (``runtime.batch``); None: it decodes one row at a time, and
    # ``batch_refusal`` says why.
    batch: BatchPlan | None = None
    batch_refusal: str = "it decodes one sequence at a time"

    @property
    def compiles(self) -> bool:
        """False: the stages do not compile with Inductor (whether they export to ONNX is
        ``capabilities.exportable``'s)."""
        return self.capabilities.compiles
