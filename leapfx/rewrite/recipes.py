"""Recipes: data that says which passes run, how the graph is cut, and which schedule decodes.

Every recipe has one frozen options dataclass. Options are validated against the model when
``apply`` builds the recipe, so a bad value fails before anything is captured.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import fx

from ..passes.base import GraphPass
from ..passes.exit_head import InsertExitHead
from ..passes.partition import Stages, early_exit_stages, full_stage, partition
from ..runtime import schedules
from ..runtime.model import Schedule


def default_exit_layer(num_layers: int) -> int:
    """A quarter of the depth (LayerSkip exits around L/4..L/2), at least 1."""
    return max(1, num_layers // 4)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: {value!r} is invalid; allowed: an integer {allowed}")


def _check_cache(value) -> None:
    if value is not None:
        _check_int("max_cache_len", value, 2)


@dataclass(frozen=True)
class AutoregressiveOptions:
    """The runtime's own autoregressive schedule (no rewrite): the baseline."""

    max_cache_len: int | None = None  # None: sized per generate call

    def validate(self, num_layers: int) -> AutoregressiveOptions:
        _check_cache(self.max_cache_len)
        return self


@dataclass(frozen=True)
class EarlyExitOptions:
    """LayerSkip sec. 4.2: exit after the first ``exit_layer`` layers for every token (lossy)."""

    exit_layer: int | None = None  # None: default_exit_layer(L)
    max_cache_len: int | None = None

    def validate(self, num_layers: int) -> EarlyExitOptions:
        e = default_exit_layer(num_layers) if self.exit_layer is None else self.exit_layer
        _check_int("exit_layer", e, 1, num_layers - 1)
        _check_cache(self.max_cache_len)
        return dataclasses.replace(self, exit_layer=e)


@dataclass(frozen=True)
class LayerSkipOptions:
    """LayerSkip sec. 4.3: draft with layers < exit_layer, verify with the rest (lossless)."""

    exit_layer: int | None = None  # None: default_exit_layer(L)
    # Draft tokens per verify step (the paper's d). Its tables use 4..12; 6 suits an exit
    # layer around L/4 with acceptance rates near 0.7-0.8.
    num_speculations: int = 6
    max_cache_len: int | None = None

    def validate(self, num_layers: int) -> LayerSkipOptions:
        e = default_exit_layer(num_layers) if self.exit_layer is None else self.exit_layer
        _check_int("exit_layer", e, 1, num_layers - 1)
        _check_int("num_speculations", self.num_speculations, 1)
        _check_cache(self.max_cache_len)
        return dataclasses.replace(self, exit_layer=e)


@dataclass(frozen=True)
class Recipe:
    """A named recipe: options type, passes, partition, schedule."""

    name: str
    description: str
    options_type: type
    passes: Callable[[object], list[GraphPass]]
    cut: Callable[[fx.GraphModule], Stages]
    schedule: Callable[[object], Schedule]
    lookahead: Callable[[object], int]
    lossless: bool


def _full_only(gm: fx.GraphModule) -> Stages:
    return Stages(modules={"full": full_stage(gm)})


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="autoregressive",
            description="the leapfx runtime without speculation (baseline)",
            options_type=AutoregressiveOptions,
            passes=lambda o: [],
            cut=_full_only,
            schedule=lambda o: schedules.autoregressive,
            lookahead=lambda o: 1,
            lossless=True,
        ),
        Recipe(
            name="early_exit",
            description="LayerSkip early-exit inference (lossy)",
            options_type=EarlyExitOptions,
            passes=lambda o: [InsertExitHead(layer=o.exit_layer)],
            cut=early_exit_stages,
            schedule=lambda o: schedules.early_exit,
            lookahead=lambda o: 1,
            lossless=False,
        ),
        Recipe(
            name="layerskip",
            description="LayerSkip self-speculative decoding (lossless)",
            options_type=LayerSkipOptions,
            passes=lambda o: [InsertExitHead(layer=o.exit_layer)],
            cut=partition,
            schedule=lambda o: partial(
                schedules.self_speculative, num_speculations=o.num_speculations
            ),
            lookahead=lambda o: o.num_speculations + 1,
            lossless=True,
        ),
    )
}
