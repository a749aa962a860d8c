"""Layer-skip drafts (SWIFT, Draft & Verify, CLaSp): the model itself minus a set of layers.

``SkipLayers(layers)`` rewires every user of decoder layer i (i in ``layers``) to the hidden
state that entered it, the output of the nearest kept layer below, and drops what no longer
feeds the output. Layer 0 is never skipped (its input is the embedding, which some families
scale in nodes of their own). A skipped layer writes no cache layer: the verify pass, the full
model over [x, drafts], writes every layer's keys for those positions.

``DraftSkipSet(layers)`` only records the set on the graph (``leapfx.draft_skip``);
``swift_stages`` cuts ``full`` (every layer) and ``draft`` (``full`` through ``SkipLayers``)::

    >>> stages = swift_stages(DraftSkipSet(layers=(2, 3)).run(capture(hf_model)).graph_module)
    >>> sorted(stages.modules)
    ['draft', 'full']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from ..options import is_int
from .base import GraphPass, PassResult
from .capture import LAYER, nodes_by_role
from .partition import Stages, _has_side_effect, full_stage

DRAFT_SKIP = "leapfx.draft_skip"


def check_skip_set(layers, num_layers: int) -> tuple[int, ...]:
    """``layers`` as a sorted tuple; ValueError unless a non-empty set within 1..L-1."""
    ok = isinstance(layers, (tuple, list)) and all(
        is_int(i) and 1 <= i < num_layers for i in layers
    )
    if not ok or not layers or len(set(layers)) != len(layers):
        raise ValueError(
            f"skip_layers: {layers!r} is invalid; allowed: distinct layer indices in "
            f"1..{num_layers - 1}, at least one (layer 0 always runs)"
        )
    return tuple(sorted(layers))


@dataclass(frozen=True)
class SkipLayers(GraphPass):
    """Remove decoder layers ``layers`` from ``gm`` (a stage): their users read their input."""

    name: ClassVar[str] = "skip-layers"
    layers: tuple[int, ...] = ()

    def run(self, gm: fx.GraphModule) -> PassResult:
        skip = set(self.layers)
        kept, matches = None, 0
        for node in sorted(nodes_by_role(gm, "layer"), key=lambda n: n.meta[LAYER]):
            if node.meta[LAYER] not in skip:
                kept = node
                continue
            assert kept is not None, "layer 0 is never skipped"
            node.replace_all_uses_with(kept)
            matches += 1
        gm.graph.eliminate_dead_code(is_impure_node=_has_side_effect)
        gm.graph.lint()
        gm.recompile()
        return PassResult(gm, matches > 0, matches)


@dataclass(frozen=True)
class DraftSkipSet(GraphPass):
    """Record the draft's skip set on the graph for ``swift_stages``; changes no node."""

    name: ClassVar[str] = "draft-skip-set"
    layers: tuple[int, ...] = ()

    def run(self, gm: fx.GraphModule) -> PassResult:
        gm.meta[DRAFT_SKIP] = tuple(self.layers)
        return PassResult(gm, False, 0)


def skip_stage(gm: fx.GraphModule, layers: tuple[int, ...]) -> fx.GraphModule:
    """The ``draft`` stage: ``full_stage(gm)`` without decoder layers ``layers``. ``gm`` may be
    the rewritten graph or a ``full`` stage (the online skip-set search cuts its candidates
    from the one the runner holds); its submodules are shared, not copied."""
    draft = SkipLayers(layers=layers).run(full_stage(gm)).graph_module
    draft.meta["leapfx.stage"] = "draft"
    return draft


def swift_stages(gm: fx.GraphModule) -> Stages:
    """``full`` and ``draft`` (``full`` without the layers of ``gm.meta[DRAFT_SKIP]``)."""
    return Stages(modules={"full": full_stage(gm), "draft": skip_stage(gm, gm.meta[DRAFT_SKIP])})
